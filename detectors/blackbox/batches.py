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


def row_hashes(ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) int64 hash of each row's real tokens, counted from its first real token (padding side and length do
    not matter). ``ids``: (B, T) or (T,) integer tensor; ``mask``: attention mask of the same shape or None."""
    ids = ids.detach()
    if ids.dim() == 1:
        ids = ids[None]
    ids = ids.to("cpu", torch.int64)
    if mask is not None and mask.shape == ids.shape:
        keep = mask.detach().to("cpu") != 0
        pos = (keep.cumsum(-1) - 1).clamp_min(0)
    else:
        keep = torch.ones_like(ids, dtype=torch.bool)
        pos = torch.arange(ids.shape[-1]).expand_as(ids)
    w = _weights(_WEIGHTS, ids.shape[-1])[pos]
    return torch.where(keep, (ids + 7) * w, 0).sum(-1) ^ keep.sum(-1)


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


def layout(ids: torch.Tensor, mask: torch.Tensor | None, special: dict[str, int]) -> dict[str, int]:
    """Counts over a batch's rows: "rows", "bos" (first real token is BOS), "bos2" (first two are BOS), "eos" (last
    real token is EOS), "has_eos" (EOS anywhere among the real tokens), "len" (the padded length)."""
    ids = ids.detach()
    if ids.dim() == 1:
        ids = ids[None]
    b, t = ids.shape
    out = {"rows": b, "len": t}
    if not special or t < 2:
        return out
    if mask is not None and mask.shape == ids.shape:
        keep = mask.detach() != 0
        first = keep.int().argmax(-1)
        last = t - 1 - keep.int().flip(-1).argmax(-1)
    else:
        keep = torch.ones_like(ids, dtype=torch.bool)
        first = torch.zeros(b, dtype=torch.long, device=ids.device)
        last = torch.full((b,), t - 1, dtype=torch.long, device=ids.device)
    rows = torch.arange(b, device=ids.device)
    if "bos" in special:
        at_first = ids[rows, first] == special["bos"]
        second = ids[rows, (first + 1).clamp_max(t - 1)] == special["bos"]
        out["bos"] = int(at_first.sum())
        out["bos2"] = int((at_first & second).sum())
    if "eos" in special:
        is_eos = (ids == special["eos"]) & keep
        out["eos"] = int(is_eos[rows, last].sum())
        out["has_eos"] = int(is_eos.any(-1).sum())
    return out
