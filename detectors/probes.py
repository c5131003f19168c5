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

from faultbench.detectors.api import Detector


def sample_docs(ctx, count: int = 4, max_len: int | None = None, distinct_lengths: bool = True,
                min_len: int = 4) -> list[list[int]]:
    """``count`` training documents of different lengths (shortest to longest within ``min_len`` ..
    ``max_len``), picked deterministically from the run's corpus."""
    limit = max_len or ctx.fact("seq_len")
    by_length: dict[int, list[int]] = {}
    for doc in ctx.fact("train_docs")[:2000]:
        if min_len <= len(doc) <= limit:
            by_length.setdefault(len(doc), list(doc))
    lengths = sorted(by_length)
    if not distinct_lengths:
        return [by_length[lengths[len(lengths) // 2]]] * count
    picks = [lengths[round(i * (len(lengths) - 1) / max(count - 1, 1))] for i in range(count)]
    return [by_length[n] for n in picks]


def collate(ctx, docs, pad_side: str | None = None) -> dict:
    """The run's collate role on ``docs`` with the run's pad id, moved to the run's device."""
    side = pad_side or ctx.fact("pad_side")
    batch = ctx.role("collate")(docs, ctx.fact("pad_id"), side)
    dev = device(ctx)
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def logits(ctx, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
    """The model's logits (float32) for a batch, through the run's forward role; call inside ``ctx.probe()``."""
    return ctx.role("forward")(input_ids, attention_mask, position_ids).float()


def modules_named(ctx, class_name: str):
    """(name, module) of every submodule of the run's model whose class is ``class_name``."""
    return [(n, m) for n, m in ctx.run.model.named_modules() if type(m).__name__ == class_name]


def ignore_value(labels: torch.Tensor, attention_mask: torch.Tensor) -> int | None:
    """The label value collate uses for 'no target': the label of row 0's first real token (BOS) where it is no
    token id (negative), else the label of a pad (a stack may leave BOS's label as the token itself: its shifted
    loss never scores a row's first label from a real position); BOS's label when nothing is padded."""
    first = int(attention_mask[0].nonzero()[0]) if attention_mask[0].any() else 0
    value = int(labels[0, first])
    pads = labels[attention_mask == 0]
    return int(pads[0]) if value >= 0 and len(pads) else value


# ---------------------------------------------------------------------------------------------- the run
def device(ctx) -> torch.device:
    """The run's training device."""
    return torch.device(ctx.fact("device"))


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
            return inspect_batch(ctx.role("collate")(docs, ctx.fact("pad_id"), side)), None
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


def _attend_close(out, ref, tol: float = 1e-4) -> bool:
    return (isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(ref.shape)
            and bool(torch.allclose(out.double(), ref, atol=tol, rtol=tol, equal_nan=True)))


def _attend_cases(device, gen) -> list[tuple[str, tuple, torch.Tensor]]:
    """(name, (q, k, v, attn_mask), allowed (B, 1, T_q, T_k) bool) on random inputs: the mask-free causal
    path, an arbitrary explicit mask (random pad keys anywhere, causal, each query sees itself), and a
    cached chunk and decode step (T_q < T_k) with random pad keys."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    B, nh, T, hs = 2, 2, 7, 8
    cases = []
    q, k, v = rand(B, nh, T, hs), rand(B, nh, T, hs), rand(B, nh, T, hs)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    cases.append(("mask-free causal path (attn_mask=None)", (q, k, v, None), causal.expand(B, 1, T, T)))
    for name, query_len in (("explicit mask, arbitrary pad keys", T), ("cached chunk (T_q=3 < T_k)", 3),
                            ("cached decode step (T_q=1 < T_k)", 1)):
        real = (torch.rand(B, T, generator=gen) > 0.35).to(device)
        allowed = allowed_attention(real.long(), query_len)[:, None]  # (B, 1, T_q, T)
        additive = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)
        cases.append((name, (q[:, :, T - query_len:], k, v, additive), allowed))
    return cases


def _leaks(fn, inputs, allowed, out, gen) -> bool:
    """Whether a key the mask forbids to a query changes that query's output: each query's forbidden keys
    (and values) are replaced by fresh random ones, one query at a time."""
    q, k, v, mask = inputs
    for i in range(q.shape[2]):
        forbidden = ~allowed[:, :, i, :, None]  # (B, 1, T_k, 1)
        if not forbidden.any():
            continue
        k2 = torch.where(forbidden, torch.randn(k.shape, generator=gen).to(k.device), k)
        v2 = torch.where(forbidden, torch.randn(v.shape, generator=gen).to(v.device), v)
        again = fn(q, k2, v2, mask, 0.0)
        if not _attend_close(again[:, :, i], out[:, :, i].double()):
            return True
    return False


def _weights_normalized(fn, inputs) -> bool:
    """Whether each query's attention weights sum to one (a weighted average of the values): with every
    value 1, each finite output must be 1 (rows that come out NaN are judged by the mask checks)."""
    q, k, v, mask = inputs
    out = fn(q, k, torch.ones_like(v), mask, 0.0).double()
    finite = torch.isfinite(out)
    return bool(torch.allclose(out[finite], torch.ones_like(out[finite]), atol=1e-4))


def attend_diagnosis(fn, device) -> dict | None:
    """Check an attend(q, k, v, attn_mask, dropout_p) against softmax(q k^T / sqrt(hs) + mask) v (float64,
    computed here) on random inputs, then on scores of a few hundred. None when it keeps its contract;
    otherwise {"subsystem", "case", "problem", "cases"}: mask when each query's weights sum to one but a key
    the mask forbids changes its output (the mask or causality is not honoured), precision when only large
    scores break it, else model (the attention math)."""
    gen = torch.Generator().manual_seed(11)
    failures, leaking = {}, None
    for name, inputs, allowed in _attend_cases(device, gen):
        q, k, v, mask = inputs
        ref = softmax_attention(q, k, v, mask, keep=allowed)
        try:
            out = fn(q, k, v, mask, 0.0)
            if _attend_close(out, ref):
                continue
            failures[name] = "differs from softmax(q k^T / sqrt(hs) + mask) v"
            if not _weights_normalized(fn, inputs):
                failures[name] += "; a query's attention weights do not sum to one"
            elif leaking is None and _leaks(fn, inputs, allowed, out, gen):
                leaking = name
                failures[name] += "; keys the mask forbids change the output"
        except Exception as exc:  # noqa: BLE001 - raising on a documented input breaks the contract
            failures.setdefault(name, f"raised {type(exc).__name__}: {str(exc)[:120]}")
    if failures:
        case = leaking or next(iter(failures))
        return {"subsystem": "mask" if leaking else "model", "case": case, "problem": failures[case],
                "cases": failures}
    q, k, v, _ = _attend_cases(device, gen)[0][1]
    big = 40.0 ** 0.5  # scores of a few hundred: a softmax without max subtraction overflows even in fp32
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=device).tril()
    try:
        stable = _attend_close(fn(q * big, k * big, v, None, 0.0), softmax_attention(q * big, k * big, v, keep=causal),
                               1e-3)
    except Exception:  # noqa: BLE001
        stable = False
    if not stable:
        return {"subsystem": "precision", "case": "large scores", "problem": "wrong or non-finite for scores of a few "
                "hundred (a softmax without max subtraction overflows)", "cases": {}}
    return None


# ---------------------------------------------------------------------------------------------- gradients
def l2_norm(tensors) -> float:
    """The float64 L2 norm of a sequence of tensors taken together."""
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def clip_probe(ctx, enabled_scaler: bool = False) -> dict:
    """The run's ``clip_gradients`` on a throwaway Linear(6, 5) with seeded gradients of true norm G and
    max_norm = G / 2; with ``enabled_scaler`` the gradients are scaled by 1024 and an enabled GradScaler of
    that scale is passed. Returns {"true_norm", "max_norm", "scale", "module", "error" (the exception or
    None), "returned"}; call inside ``ctx.probe()`` (the module's init draws from the global RNG)."""
    fn = ctx.role("clip_gradients")
    dev = device(ctx)
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
