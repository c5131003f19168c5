"""Helpers shared by detectors: crafted inputs from the run's own corpus, the run's components, reference
computations (attention, norms), probes of seams used by several detectors, and ``BatchWatch``.

Everything here goes through the run context (``ctx.run``, ``ctx.seam``); nothing imports the
reference. Probes run inside ``ctx.probe()`` so they leave no trace on the run.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from detectors.api import Detector


def sample_docs(ctx, count: int = 4, max_len: int | None = None, distinct_lengths: bool = True,
                min_len: int = 4) -> list[list[int]]:
    """``count`` training documents of different lengths (shortest to longest within ``min_len`` ..
    ``max_len``), picked deterministically from the run's corpus."""
    limit = max_len or ctx.config.data.seq_len
    by_length: dict[int, list[int]] = {}
    for doc in ctx.run.corpus.train[:2000]:
        if min_len <= len(doc) <= limit:
            by_length.setdefault(len(doc), list(doc))
    lengths = sorted(by_length)
    if not distinct_lengths:
        return [by_length[lengths[len(lengths) // 2]]] * count
    picks = [lengths[round(i * (len(lengths) - 1) / max(count - 1, 1))] for i in range(count)]
    return [by_length[n] for n in picks]


def collate(ctx, docs, pad_side: str | None = None) -> dict:
    """The run's collate on ``docs`` with the tokenizer's pad id, moved to the run's device."""
    side = pad_side or ctx.config.data.pad_side
    batch = ctx.seam("model.data.collate")(docs, ctx.run.tokenizer.pad_id, side)
    device = ctx.config.train.device
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def logits(ctx, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
    """The model's logits (float32) for a batch; call inside ``ctx.probe()``."""
    return ctx.run.model(input_ids, attention_mask, position_ids).float()


def modules_named(ctx, class_name: str):
    """(name, module) of every submodule of the run's model whose class is ``class_name``."""
    return [(n, m) for n, m in ctx.run.model.named_modules() if type(m).__name__ == class_name]


def ignore_value(labels: torch.Tensor, attention_mask: torch.Tensor) -> int | None:
    """The label value collate uses for 'no target', read off the first real token (BOS) of row 0."""
    first = int(attention_mask[0].nonzero()[0]) if attention_mask[0].any() else 0
    return int(labels[0, first])


# ---------------------------------------------------------------------------------------------- the run
def device(ctx) -> torch.device:
    """The run's training device."""
    return torch.device(ctx.config.train.device)


def device_type(ctx) -> str:
    """The run's device type (``"cpu"``, ``"cuda"``), as autocast and GradScaler take it."""
    return device(ctx).type


def group_ready(ctx) -> bool:
    """A multi-rank run in an initialized process group (a condition every rank shares)."""
    return ctx.run.world_size > 1 and dist.is_available() and dist.is_initialized()


def sampled(step: int, first: int = 5, every: int = 8) -> bool:
    """Whether a passive hook looks at ``step``: the first ``first`` steps, then every ``every``-th."""
    return step < first or step % every == 0


def close(a: float, b: float, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    """Both finite and equal within ``rel`` (relative to the larger) plus ``abs_``."""
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel * max(abs(a), abs(b)) + abs_


@contextlib.contextmanager
def quiet():
    """Silence warnings of throwaway optimizers, schedulers and scalers (e.g. LambdaLR's step-order warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def private_copy(model):
    """A deep copy of the model in eval mode that fires none of the hooks registered on the original."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
    twin.eval()
    return twin


# ---------------------------------------------------------------------------------------------- batches
def probe_batch(ctx, count: int = 4) -> dict:
    """The run's collate on ``count`` training documents of distinct lengths (raises if collate does)."""
    return collate(ctx, sample_docs(ctx, count))


def pad(docs, pad_id: int, device, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``docs`` padded on ``side``, built here so a collate bug cannot leak
    into a probe."""
    width = max(len(d) for d in docs)
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.long)
    for row, doc in enumerate(docs):
        cols = slice(width - len(doc), None) if side == "left" else slice(None, len(doc))
        ids[row, cols] = torch.tensor(doc)
        mask[row, cols] = 1
    return ids.to(device), mask.to(device)


def documents(batch: dict, pad_side: str) -> list[list[int]] | None:
    """The documents of a collated batch read off its attention mask, or None when the mask cannot be
    trusted (not a (B, T) 0/1 tensor, or a row whose real tokens do not touch the padding side's edge)."""
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        return None
    m = mask.long().cpu()
    if m.numel() == 0 or bool(((m != 0) & (m != 1)).any()):
        return None
    if not bool((m[:, 0] if pad_side == "right" else m[:, -1]).all()):
        return None
    ids = ids.cpu()
    return [ids[r][m[r].bool()].tolist() for r in range(ids.shape[0])]


def recollate(ctx, docs, side: str, inspect_batch: Callable[[dict], Any]) -> tuple[Any, str | None]:
    """(``inspect_batch`` of the run's collate on ``docs`` with tokenizer.pad_id and ``side``, None), run in a
    probe; (None, the error) when either raises. Tells whether collate or its caller shaped a real batch."""
    with ctx.probe():
        try:
            return inspect_batch(ctx.seam("model.data.collate")(docs, ctx.run.tokenizer.pad_id, side)), None
        except Exception as exc:  # noqa: BLE001
            return None, f"{type(exc).__name__}: {exc}"


class BatchWatch(Detector, abc.ABC):
    """A passive detector that checks the real micro-batches of sampled steps one by one with
    ``check_batch(ctx, batch)`` until a check reports (returns True): one finding per run."""

    def __init__(self) -> None:
        super().__init__()
        self._done = False

    def on_batch(self, ctx, micro_batches) -> None:
        if self._done or not sampled(ctx.step):
            return
        for batch in micro_batches:
            if self.check_batch(ctx, batch):
                self._done = True
                return

    @abc.abstractmethod
    def check_batch(self, ctx, batch: dict) -> bool:
        """Check one micro-batch; True when it reported (the watch then stops)."""


def default_ignore_index(fn) -> int | None:
    """The integer default of ``fn``'s ``ignore_index`` parameter (collate's documented ignore value), or None."""
    try:
        param = inspect.signature(fn).parameters.get("ignore_index")
    except (TypeError, ValueError):
        return None
    return param.default if param is not None and isinstance(param.default, int) else None


# ---------------------------------------------------------------------------------------------- attention
def allowed_attention(attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """(B, T_q, T_k) bool: the entries build_attention_mask's contract allows (causal and key real, plus
    the query itself); the queries are the last ``query_len`` positions."""
    key_len = attention_mask.shape[1]
    query_pos = torch.arange(key_len - query_len, key_len, device=attention_mask.device)[:, None]
    key_pos = torch.arange(key_len, device=attention_mask.device)[None, :]
    return ((key_pos <= query_pos) & attention_mask.bool()[:, None, :]) | (key_pos == query_pos)


def softmax_attention(q, k, v, additive=None, keep=None) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(hs) + additive) v; ``keep`` (bool) masks the scores with -inf."""
    scores = (q.double() @ k.double().transpose(-2, -1)) * q.size(-1) ** -0.5
    if additive is not None:
        scores = scores + additive.double()
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v.double()


# ---------------------------------------------------------------------------------------------- gradients
def l2_norm(tensors) -> float:
    """The float64 L2 norm of a sequence of tensors taken together."""
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def clip_probe(ctx, enabled_scaler: bool = False) -> dict:
    """The run's ``clip_gradients`` on a throwaway Linear(6, 5) with seeded gradients of true norm G and
    max_norm = G / 2; with ``enabled_scaler`` the gradients are scaled by 1024 and an enabled GradScaler of
    that scale is passed. Returns {"true_norm", "max_norm", "scale", "module", "error" (the exception or
    None), "returned"}; call inside ``ctx.probe()`` (the module's init draws from the global RNG)."""
    fn = ctx.seam("model.train.clip_gradients")
    dev = ctx.config.train.device
    gen = torch.Generator().manual_seed(7)
    module = torch.nn.Linear(6, 5).to(dev)
    grads = [torch.randn(p.shape, generator=gen).to(dev) for p in module.parameters()]
    true_norm = l2_norm(grads)
    scale = 1024.0 if enabled_scaler else 1.0
    for p, g in zip(module.parameters(), grads, strict=True):
        p.grad = g * scale
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device_type(ctx), init_scale=scale, enabled=enabled_scaler)
    if enabled_scaler:  # the scaler records its scale on first use (scaler.scale(loss) in a real step)
        scaler.scale(torch.ones((), device=dev))
    out = {"true_norm": true_norm, "max_norm": true_norm / 2, "scale": scale, "module": module,
           "optimizer": opt, "scaler": scaler, "error": None}
    try:
        with quiet():
            out["returned"] = float(fn(module, opt, scaler, true_norm / 2))
    except Exception as exc:
        out["error"] = exc
    return out
