"""Fingerprints of token batches, for the black-box track: which rows and batches a loop trained and evaluated on,
and where its special tokens sit, without keeping the batches.

A row's fingerprint is Python's hash of the tuple of its real tokens (where attention_mask is not 0), so the same
document padded on either side, or to another length, hashes the same; a batch's is the hash of its rows' in order.
Tuples of ints hash alike in every process (no hash randomization for ints), so ranks can compare them.

The batch is read into Python lists once (one ``tolist`` per tensor) and everything else is plain Python on them: on
a training forward's batch (caches cold after the previous step's forward and backward) each NumPy or torch call
costs 5-40 us, and the dozen a vectorized fingerprint needs cost several times this whole pass.
"""

from __future__ import annotations

from itertools import compress

import torch


def _real_rows(ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[list[tuple[int, ...]], int]:
    """(each row's real tokens as a tuple, the padded length). ``ids``: (B, T) or (T,); ``mask``: the attention
    mask of the same shape (positions where it is 0 are padding) or None."""
    rows = ids.tolist()
    if ids.dim() == 1:
        rows = [rows]
    width = len(rows[0]) if rows else 0
    if mask is None or mask.shape != ids.shape:
        return [tuple(r) for r in rows], width
    keep = mask.tolist()
    if ids.dim() == 1:
        keep = [keep]
    return [tuple(compress(r, k)) for r, k in zip(rows, keep, strict=True)], width


def _layout(rows: list[tuple[int, ...]], width: int, special: dict[str, int]) -> dict[str, int]:
    lengths = [len(r) for r in rows]
    out = {"rows": len(rows), "len": width, "cells": len(rows) * width,
           "idle": len(rows) * (width - max(lengths, default=width))}
    if not special or width < 2:
        return out
    if "bos" in special:
        bos = special["bos"]
        out["bos"] = sum(r[:1] == (bos,) for r in rows)
        out["bos2"] = sum(r[:2] == (bos, bos) for r in rows)
    if "eos" in special:
        eos = special["eos"]
        ends = [r[-1:] == (eos,) for r in rows]
        full = [n == width for n in lengths]
        out["eos"], out["full"] = sum(ends), sum(full)
        out["full_eos"] = sum(e and f for e, f in zip(ends, full, strict=True))
    return out


def row_hashes(ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) int64 hash of each row's real tokens (padding side and length do not matter). ``ids``: (B, T) or (T,)
    integer tensor; ``mask``: attention mask of the same shape or None."""
    return torch.tensor([hash(r) for r in _real_rows(ids, mask)[0]], dtype=torch.int64)


def packed_documents(row: tuple[int, ...], eos: int | None) -> list[tuple[int, ...]]:
    """The documents a packed row holds: for a row with an EOS before its last token, each EOS-ended stretch (what
    follows its last EOS is cut by the row's end, and left out: another row may hold the rest); [] for any other
    row (one document, or EOS not declared)."""
    if eos is None or eos not in row[:-1]:
        return []
    out, start = [], 0
    while eos in row[start:]:  # tuple searches: no Python loop over the tokens (every training batch passes here)
        end = row.index(eos, start) + 1
        out.append(row[start:end])
        start = end
    return out


def document_hashes(ids: torch.Tensor, mask: torch.Tensor | None, min_tokens: int, eos: int | None = None
                    ) -> list[int]:
    """The hashes of the documents (``min_tokens`` real tokens or more: not decoding steps) of a batch's rows: a
    row, or each document of a packed row (``packed_documents``)."""
    docs = [d for r in _real_rows(ids, mask)[0] for d in (packed_documents(r, eos) or [r])]
    return [hash(d) for d in docs if len(d) >= min_tokens]


def batch_hash(rows) -> int:
    """One int for a batch from its row hashes (order matters): a list, tensor or array of them."""
    return hash(tuple(int(h) for h in rows))


def fingerprint(ids: torch.Tensor, mask: torch.Tensor | None, special: dict[str, int] | None, documents: bool = True
                ) -> tuple[list[int], dict | None, list[int]]:
    """A training batch read once: its rows' hashes, unless ``special`` is None its ``layout`` counts, and (with
    ``documents``) the hashes of the documents its packed rows hold (``packed_documents``, by ``special``'s EOS)."""
    rows, width = _real_rows(ids, mask)
    eos = (special or {}).get("eos") if documents else None
    packed = [hash(d) for r in rows for d in packed_documents(r, eos)]
    return [hash(r) for r in rows], None if special is None else _layout(rows, width, special), packed


# a layout count -> the count it is a fraction of (what the golden envelope spans, per run)
# (full-width rows first: where they alone lost EOS, theirs is the finding that says why)
FRACTIONS = {"bos": "rows", "bos2": "rows", "full_eos": "full", "eos": "rows", "idle": "cells"}


def layout_fractions(layouts) -> dict[str, float]:
    """The FRACTIONS of layout counts summed over batches or steps (``layouts``: their count dicts), each where
    its whole is not 0."""
    total: dict[str, int] = {}
    for counts in layouts:
        for key, value in counts.items():
            total[key] = total.get(key, 0) + value
    return {k: total[k] / total[of] for k, of in FRACTIONS.items() if k in total and total.get(of)}


def layout(ids: torch.Tensor, mask: torch.Tensor | None, special: dict[str, int]) -> dict[str, int]:
    """Counts over a batch's rows: "rows", "len" (the padded length), "cells" (rows x length) and "idle" (the cells
    of columns past the batch's longest row: padding no row needs); with the tokenizer's BOS/EOS ids, "bos" (first
    real token is BOS), "bos2" (first two are BOS), "eos" (last real token is EOS), "full" (rows as long as the
    batch: its longest, and any cut at the length limit) and "full_eos" (of them, those ending with EOS)."""
    return _layout(*_real_rows(ids, mask), special)


def shown_pad_id(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int | None:
    """The one id the batch holds where its mask is 0 (its padding), None without a mask, padding or a single id."""
    if attention_mask is None:
        return None
    ids = torch.unique(input_ids[~attention_mask.bool()])
    return int(ids[0]) if len(ids) == 1 else None
