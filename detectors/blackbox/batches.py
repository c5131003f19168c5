"""Fingerprints of token batches, for the black-box track: which rows and batches a loop trained and evaluated on,
and where its special tokens sit, without keeping the batches.

A row's fingerprint is a hash of its real tokens (where attention_mask is 1) counted from its first real token, so
the same document padded on either side, or to another length, hashes the same; a batch's is a hash of its rows in
order. Both are wrapping int64 sums. The batch is copied to the host once and read with NumPy: a few small-array
ops per training forward, where the same ops as torch calls cost several times more (each pays the dispatcher, and
the caches are cold after a forward and backward).
"""

from __future__ import annotations

import numpy as np
import torch

_GEN = torch.Generator().manual_seed(0x5EED)
_WEIGHTS = (torch.randint(1, 2**62, (4096,), generator=_GEN, dtype=torch.int64) | 1).numpy()  # odd: products mix
_ROW_WEIGHTS = (torch.randint(1, 2**62, (4096,), generator=_GEN, dtype=torch.int64) | 1).numpy()


def _weights(table: np.ndarray, n: int) -> np.ndarray:
    if n <= table.size:
        return table[:n]
    reps = -(-n // table.size)
    return (np.tile(table, reps)[:n] * np.arange(1, n + 1, dtype=np.int64)) | 1


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _rows(ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray | None, bool]:
    """(ids as (B, T) int64, the keep mask or None when every position is real, whether every row starts at 0)."""
    if ids.dim() == 1:
        ids = ids[None]
    host = _host(ids).astype(np.int64, copy=False)
    if mask is None or mask.shape != ids.shape:
        return host, None, True
    keep = _host(mask) != 0
    return host, keep, bool(keep[:, 0].all()) if keep.shape[1] else True


def _row_hashes(ids: np.ndarray, keep: np.ndarray | None, aligned: bool) -> np.ndarray:
    t = ids.shape[-1]
    with np.errstate(over="ignore"):  # the hash wraps around, as intended
        if keep is None:
            return ((ids + 7) * _weights(_WEIGHTS, t)).sum(-1) ^ t
        if aligned:  # no left padding: positions are the columns
            weighted = (ids + 7) * _weights(_WEIGHTS, t)
        else:
            weighted = (ids + 7) * _weights(_WEIGHTS, t)[np.maximum(keep.cumsum(-1) - 1, 0)]
        return (weighted * keep).sum(-1) ^ keep.sum(-1)


def row_hashes(ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) int64 hash of each row's real tokens, counted from its first real token (padding side and length do
    not matter). ``ids``: (B, T) or (T,) integer tensor; ``mask``: attention mask of the same shape or None."""
    return torch.from_numpy(_row_hashes(*_rows(ids, mask)))


def batch_hash(rows) -> int:
    """One int for a batch from its row hashes (order matters): a tensor or array of them."""
    rows = np.asarray(rows, dtype=np.int64)
    with np.errstate(over="ignore"):
        return int((rows * _weights(_ROW_WEIGHTS, rows.size)).sum())


def fingerprint(ids: torch.Tensor, mask: torch.Tensor | None, special: dict[str, int]) -> tuple[list[int], dict]:
    """A training batch read once: its rows' hashes and its ``layout`` counts."""
    rows = _rows(ids, mask)
    return _row_hashes(*rows).tolist(), _layout(*rows, special)


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
    return _layout(*_rows(ids, mask), special)


def _layout(ids: np.ndarray, keep: np.ndarray | None, aligned: bool, special: dict[str, int]) -> dict[str, int]:
    b, t = ids.shape
    lengths = keep.sum(-1) if keep is not None else np.full(b, t)
    longest = int(lengths.max()) if b else t
    out = {"rows": b, "len": t, "cells": b * t, "idle": b * (t - longest)}
    if not special or t < 2:
        return out
    if keep is None:
        picked = ids[:, [0, 1, t - 1]]
    elif aligned:  # no left padding: the last real token sits at length - 1
        picked = np.concatenate([ids[:, :2], np.take_along_axis(ids, np.maximum(lengths - 1, 0)[:, None], 1)], 1)
    else:
        first = keep.argmax(-1)
        last = t - 1 - keep[:, ::-1].argmax(-1)
        picked = np.take_along_axis(ids, np.stack([first, np.minimum(first + 1, t - 1), last], 1), 1)
    hits = picked == np.array([special.get("bos", -1), special.get("bos", -1), special.get("eos", -1)])
    full = lengths == t
    if "bos" in special:
        out["bos"], out["bos2"] = int(hits[:, 0].sum()), int((hits[:, 0] & hits[:, 1]).sum())
    if "eos" in special:
        out["eos"], out["full"] = int(hits[:, 2].sum()), int(full.sum())
        out["full_eos"] = int((full & hits[:, 2]).sum())
    return out
