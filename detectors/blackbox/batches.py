"""Fingerprints of token batches, for the black-box track: which rows and batches a loop trained and evaluated on,
and where its special tokens sit, without keeping the batches.

A row's fingerprint is a hash of its real tokens (where attention_mask is 1) counted from its first real token, so
the same document padded on either side, or to another length, hashes the same; a batch's is a hash of its rows in
order. Both are int64 sums over the tensor (a few vectorized ops per forward).
"""

from __future__ import annotations

import torch

_GEN = torch.Generator().manual_seed(0x5EED)
_WEIGHTS = torch.randint(1, 2**62, (4096,), generator=_GEN, dtype=torch.int64) | 1  # odd: multiplication mixes
_ROW_WEIGHTS = torch.randint(1, 2**62, (4096,), generator=_GEN, dtype=torch.int64) | 1


def _weights(table: torch.Tensor, n: int) -> torch.Tensor:
    if n <= table.numel():
        return table[:n]
    reps = -(-n // table.numel())
    return (table.repeat(reps)[:n] * torch.arange(1, n + 1, dtype=torch.int64)) | 1


def _rows(ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(ids as (B, T), the keep mask or None when every position is real, whether every row starts at 0)."""
    ids = ids.detach()
    if ids.dim() == 1:
        ids = ids[None]
    if mask is None or mask.shape != ids.shape:
        return ids, None, True
    keep = mask.detach() != 0
    return ids, keep, bool(keep[:, 0].all())


def row_hashes(ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) int64 hash of each row's real tokens, counted from its first real token (padding side and length do
    not matter). ``ids``: (B, T) or (T,) integer tensor; ``mask``: attention mask of the same shape or None."""
    ids, keep, aligned = _rows(ids, mask)
    ids = ids.to("cpu", torch.int64)
    t = ids.shape[-1]
    if keep is None:
        return ((ids + 7) * _weights(_WEIGHTS, t)).sum(-1) ^ t
    keep = keep.to("cpu")
    if aligned:  # no left padding: positions are the columns
        weighted = (ids + 7) * _weights(_WEIGHTS, t)
    else:
        weighted = (ids + 7) * _weights(_WEIGHTS, t)[(keep.cumsum(-1) - 1).clamp_min(0)]
    return (weighted * keep).sum(-1) ^ keep.sum(-1)


def batch_hash(rows: torch.Tensor) -> int:
    """One int for a batch from its row hashes (order matters)."""
    return int((rows * _weights(_ROW_WEIGHTS, rows.numel())).sum())


def special_ids(tokenizer) -> dict[str, int]:
    """{"bos": id, "eos": id} of a tokenizer (HF names or ``bos_id``/``eos_id``), those it has."""
    out = {}
    for key in ("bos", "eos"):
        for name in (f"{key}_token_id", f"{key}_id"):
            value = getattr(tokenizer, name, None)
            if isinstance(value, int):
                out[key] = value
                break
    return out


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
    batch: its longest, and any cut at the length limit) and "full_eos" (of them, those ending with EOS). A few
    tensor ops on the mask's row sums and the rows' first, second and last tokens, one transfer."""
    ids, keep, aligned = _rows(ids, mask)
    b, t = ids.shape
    lengths = keep.sum(-1) if keep is not None else torch.full((b,), t, device=ids.device)
    counts = [lengths.max() if b else torch.tensor(t)]
    if special and t >= 2:
        counts += _ends(ids, keep, aligned, lengths, special)
    longest, *ends = torch.stack([c.to(ids.device) for c in counts]).tolist()
    out = {"rows": b, "len": t, "cells": b * t, "idle": b * (t - longest)}
    if ends:
        first_bos, both_bos, last_eos, full, full_eos = ends
        if "bos" in special:
            out["bos"], out["bos2"] = first_bos, both_bos
        if "eos" in special:
            out["eos"], out["full"], out["full_eos"] = last_eos, full, full_eos
    return out


def _ends(ids, keep, aligned, lengths, special) -> list[torch.Tensor]:
    """[rows starting with BOS, with two BOS, ending with EOS, as long as the batch, of them ending with EOS]."""
    t = ids.shape[1]
    if keep is None:
        picked = ids[:, [0, 1, t - 1]]
    elif aligned:  # no left padding: the last real token sits at length - 1
        picked = torch.cat([ids[:, :2], ids.gather(1, (lengths[:, None] - 1).clamp_min(0))], 1)
    else:
        first = keep.int().argmax(-1)
        last = t - 1 - keep.int().flip(-1).argmax(-1)
        picked = ids.gather(1, torch.stack([first, (first + 1).clamp_max(t - 1), last], 1))
    bos, eos = special.get("bos", -1), special.get("eos", -1)
    hits = picked == torch.tensor([bos, bos, eos], device=ids.device)
    full = lengths == t
    return [hits[:, 0].sum(), (hits[:, 0] & hits[:, 1]).sum(), hits[:, 2].sum(), full.sum(), (full & hits[:, 2]).sum()]
