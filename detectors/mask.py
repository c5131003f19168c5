"""Mask detectors: the additive attention mask (causality and padding) and how attention applies it.

Three probes, all at ``on_start`` on crafted inputs (no training step needed):
- ``mask_contract`` calls the run's ``build_attention_mask`` directly (left padding, a cached decode
  step, a prefill chunk; float32, bfloat16, float16) and also captures the mask the attention
  modules actually receive, and checks what the mask does: shape (B, 1, T_q, T_k); added to scores in
  the compute dtype it gives finite softmax rows (every query attends to some key), and each real
  query attends to exactly the keys causality and padding allow.
- ``causality_probe`` perturbs the tokens after position t and checks that the logits at <= t do not
  move, on the mask-free fast path (no padding: the mask builder returns None) and on the explicit
  mask path (left padding); whether the mask and attend keep their contracts localizes the cause.
- ``padding_invariance`` scores each document alone and inside a left- and a right-padded batch: the
  logits of its real tokens must not depend on the padding its batch needed.

Everything reaches the run through the context (its roles and facts); nothing imports the reference. Where the
run lacks a role a diagnosis would probe (``attend``, ``position_ids``), the finding says less about where.
"""

from __future__ import annotations

import abc

import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, register
from faultbench.detectors.probes import attend_diagnosis

GPT_FORWARD = "model.gpt.GPT.forward"  # the reference's forward: the masks its attention modules receive

# The crafted masks of the contract probe: (attention_mask rows, query_len, what it stands for).
LEFT_PADDED = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
CONTRACT_CASES = (
    (LEFT_PADDED, 6, "left-padded prefill"),
    ([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]], 1, "cached decode step (T_q=1)"),
    ([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]], 3, "cached chunk (T_q=3 < T_k)"),
    ([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], 6, "right-padded prefill (None allowed)"),
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LEAK_TOL = 1e-4  # fp32 probes: a causal model's early logits move by ~1e-7 when later tokens change


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


def mask_problems(mask, attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> list[str]:
    """What is wrong with ``mask`` as the additive mask of ``attention_mask`` for ``query_len`` queries, judged
    by what it does: added to random scores in ``dtype`` (the model's compute dtype), every softmax row
    must be finite (each query attends to at least one key), and a real query's softmax must be the
    softmax over exactly the keys causality and padding allow (what a pad query sees is free)."""
    batch, key_len = attention_mask.shape
    if mask is None:
        if query_len == key_len and is_right_padded(attention_mask):
            return []
        return ["returned None (plain causal) for a batch that needs an explicit mask (left padding or a cache)"]
    if not isinstance(mask, torch.Tensor):
        return [f"returned {type(mask).__name__}, not a tensor"]
    problems = []
    if tuple(mask.shape) != (batch, 1, query_len, key_len):
        problems.append(f"shape {tuple(mask.shape)}, expected {(batch, 1, query_len, key_len)}")
        try:
            mask = mask.expand(batch, 1, query_len, key_len)
        except RuntimeError:
            return problems
    if mask.dtype != dtype:
        problems.append(f"dtype {mask.dtype}, expected {dtype}")
    gen = torch.Generator().manual_seed(3)
    scores = (3 * torch.randn(batch, query_len, key_len, generator=gen)).to(device=mask.device, dtype=dtype)
    probs = (scores + mask[:, 0].to(dtype)).float().softmax(-1)  # (B, T_q, T_k)
    finite = torch.isfinite(probs).all(-1)
    if not bool(finite.all()):
        problems.append(f"{int((~finite).sum())} query rows softmax to NaN/inf in {str(dtype).replace('torch.', '')} "
                        "(a query left with no key, or a constant that is not finite in the compute dtype)")
    allowed = probes.allowed_attention(attention_mask, query_len)
    want = scores.float().masked_fill(~allowed, float("-inf")).softmax(-1)
    real_query = attention_mask.bool()[:, key_len - query_len:]  # (B, T_q)
    gap = (probs - want).abs().amax(-1)  # (B, T_q); NaN where not finite
    wrong = real_query & finite & (gap > max(1e-3, 4 * torch.finfo(dtype).eps))  # bf16 rounds scores coarsely
    if wrong.any():
        leaked = (probs > 1e-4) & ~allowed & wrong[..., None]
        dropped = (probs < want * 0.5) & allowed & wrong[..., None]
        key_pos = torch.arange(key_len, device=mask.device)
        query_pos = key_pos[key_len - query_len:, None]
        future = leaked & (key_pos > query_pos)
        problems.append(f"{int(wrong.sum())} real queries do not attend to exactly the keys causality and padding "
                        f"allow ({int(future.sum())} see later keys, {int((leaked & ~future).sum())} see pad keys, "
                        f"{int(dropped.sum())} allowed keys suppressed)")
    return problems


def check_build_mask(fn, device, cases=CONTRACT_CASES, dtypes=DTYPES) -> dict[str, list[str]]:
    """Run the mask builder on the crafted cases; {case/dtype: problems} for the failing ones."""
    failures = {}
    for rows, query_len, name in cases:
        attention_mask = torch.tensor(rows, dtype=torch.long, device=device)
        for dtype in dtypes:
            try:
                mask = fn(attention_mask, query_len, dtype)
                problems = mask_problems(mask, attention_mask, query_len, dtype)
            except Exception as exc:  # a crash on a documented input is a contract failure too
                problems = [f"raised {type(exc).__name__}: {str(exc)[:160]}"]
            if problems:
                failures[f"{name}, {str(dtype).replace('torch.', '')}"] = problems
    return failures


class capture_masks:
    """Context manager: the ``attn_mask`` every CausalSelfAttention module receives (forward pre-hooks)."""

    def __init__(self, ctx):
        self.modules = [m for _, m in probes.modules_named(ctx, "CausalSelfAttention")]
        self.masks: list = []
        self.handles: list = []

    def _hook(self, module, args, kwargs):
        self.masks.append(args[2] if len(args) > 2 else kwargs.get("attn_mask"))

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.modules]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def positions_problem(fn, device) -> str | None:
    """position_ids_from_mask on a left-padded mask (no cache, and a cache of 4 columns): real tokens
    must be numbered 0, 1, ... from each row's first real token."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], device=device)
    expected = (mask.cumsum(-1) - 1).clamp(min=0)
    for past_len in (0, 4):
        try:
            got = fn(mask, past_len)
        except Exception as exc:
            return f"past_len={past_len} raised {type(exc).__name__}"
        want = expected[:, past_len:]
        real = mask[:, past_len:].bool()
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(got[real].long(), want[real]):
            return f"past_len={past_len}: positions of real tokens {got.tolist()}, expected {want.tolist()}"
    return None


def _probe_docs(ctx, count: int = 4, max_len: int = 24) -> list[list[int]]:
    """``count`` training documents of distinct lengths between 8 and ``max_len`` tokens (from 4 tokens
    when the corpus has fewer than ``count`` such lengths)."""
    lengths = {len(doc) for doc in ctx.fact("train_docs")[:2000] if 8 <= len(doc) <= max_len}
    return probes.sample_docs(ctx, count, max_len=max_len, min_len=8 if len(lengths) >= count else 4)


def report_raise(detector, ctx, exc: BaseException, what: str) -> None:
    """A probe's forward raised on a documented input: report where (the innermost seam on the traceback)."""
    seam = ctx.raising_seam(exc)
    subsystem = ctx.seams.get(seam, "model") if seam else "model"
    detector.report(ctx, subsystem, seam, f"the model raises on {what}: {type(exc).__name__}: {str(exc)[:160]}",
                    evidence={"seam_on_traceback": seam}, confidence=0.6 if seam else 0.4)


def diagnose(ctx, role: str, check):
    """``check(the run's role)`` (its problems), or None where the run offers no such role."""
    return check(ctx.role(role)) if role in ctx.roles else None


def broken_mask_part(ctx) -> tuple[str, str] | None:
    """(role, problem) of the first part of the run's mask builder that breaks its contract, of those it offers as
    roles (mask functions and the causal skip; ``detectors.api.ROLES``), on a left-padded batch of 2 x 6; None
    where each offered part keeps it, or none is offered."""
    T = 6
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q, kv = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    causal = (kv <= q).expand(2, 1, T, T)
    padding = mask[b, kv].expand(2, 1, T, T)
    checks = {
        "causal_mask_mod": lambda fn: (fn(b, h, q, kv), causal),
        "padding_mask_mod": lambda fn: (fn(mask)(b, h, q, kv), padding),
        "and_mask_mods": lambda fn: (fn(lambda b_, h_, q_, kv_: kv_ <= q_, lambda b_, h_, q_, kv_: mask[b_, kv_])(
            b, h, q, kv), causal & padding),
    }
    for role, check in checks.items():
        if role not in ctx.roles:
            continue
        try:
            got, want = check(ctx.role(role))
            wrong = int((torch.as_tensor(got).bool().expand_as(want) != want).sum())
        except Exception as exc:  # noqa: BLE001 - raising on a documented input breaks the contract
            return role, f"{role} raises {type(exc).__name__}: {str(exc)[:120]}"
        if wrong:
            return role, f"{role} is wrong on {wrong} of {want.numel()} (query, key) pairs of a left-padded batch"
    if "causal_skip" in ctx.roles:
        try:
            if ctx.role("causal_skip")(mask.long(), T):
                return "causal_skip", "causal_skip drops the explicit mask of a left-padded batch"
        except Exception as exc:  # noqa: BLE001
            return "causal_skip", f"causal_skip raises {type(exc).__name__}: {str(exc)[:120]}"
    return None


def report_mask(detector, ctx, message: str, evidence: dict, confidence: float) -> None:
    """A finding that the run's mask builder breaks its contract, at the broken part where the run shows it."""
    part = broken_mask_part(ctx)
    if part is not None:
        evidence = {**evidence, "broken_part": part[1]}
        message = f"{message}; {part[1]}"
    detector.report(ctx, "mask", ctx.role_seam(part[0] if part else "mask_builder"), message, evidence,
                    confidence=confidence)


def _autocast(ctx):
    precision = ctx.config.train.precision
    return ctx.seam("model.precision.autocast_context")(precision, probes.device_type(ctx))


@register
class MaskContract(Detector):
    id = "mask_contract"
    needs_facts = ("device",)
    needs_roles = ("mask_builder",)
    family = "mask"
    passive = False
    description = ("build_attention_mask on crafted left-padded / cached masks in fp32, bf16, fp16 (and the mask the "
                   "attention modules receive): (B,1,Tq,Tk), finite softmax rows in the compute dtype, real queries "
                   "attend to exactly the causal real keys")

    def on_start(self, ctx) -> None:
        device = probes.device(ctx)
        failures = check_build_mask(ctx.role("mask_builder"), device)
        if failures:
            first = next(iter(failures.items()))
            report_mask(self, ctx, f"the mask builder breaks its contract ({len(failures)} of "
                        f"{len(CONTRACT_CASES) * 3} cases): {first[0]}: {'; '.join(first[1])}",
                        {"failures": {k: v for k, v in list(failures.items())[:6]}}, confidence=0.9)
            return
        if ctx.known_seam(GPT_FORWARD):
            self._check_received(ctx)

    def _check_received(self, ctx) -> None:
        """The builder is right: does the reference's model hand its attention modules what it builds?"""
        self.require(ctx, run=("corpus.train", "tokenizer.pad_id"),
                     config=("train.precision", "train.device", "model.n_layer", "data.seq_len"))
        docs = _probe_docs(ctx, 3, max_len=16)
        device = probes.device(ctx)
        ids, attention_mask = probes.pad(docs, ctx.fact("pad_id"), device)
        problems: dict[str, list[str]] = {}
        with ctx.probe() as model:
            runs = [("fp32", torch.float32, None)]
            precision = ctx.config.train.precision
            if precision in ("bf16", "fp16"):
                runs.append((precision, torch.bfloat16 if precision == "bf16" else torch.float16, _autocast))
            for name, dtype, autocast in runs:
                with capture_masks(ctx) as cap:
                    try:
                        if autocast is None:
                            model(ids, attention_mask)
                        else:
                            with autocast(ctx):
                                model(ids, attention_mask)
                    except Exception:  # noqa: BLE001 - a forward that raises is the model probes' finding
                        continue
                for i, mask in enumerate(cap.masks[:1]):
                    found = mask_problems(mask, attention_mask, ids.shape[1], dtype)
                    if found:
                        problems[f"left-padded forward ({name}), module {i}"] = found
            # one cached decode step
            try:
                cache = ctx.seam("model.gpt.KVCache")(ctx.config.model.n_layer, ids.shape[1] + 1)
                model(ids, attention_mask, cache=cache)
                step_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
                with capture_masks(ctx) as cap:
                    model(ids[:, -1:], step_mask, cache=cache)
                if cap.masks:
                    found = mask_problems(cap.masks[0], step_mask, 1, torch.float32)
                    if found:
                        problems["cached decode step"] = found
            except Exception:  # noqa: BLE001 - a broken cache is the kv_cache_consistency detector's finding
                pass
        if problems:
            first = next(iter(problems.items()))
            self.report(ctx, "mask", GPT_FORWARD,
                        "build_attention_mask is right when called directly, but the attention modules receive a "
                        f"different mask: {first[0]}: {'; '.join(first[1])}", evidence={"problems": problems},
                        confidence=0.8)


def _leak(logits_a: torch.Tensor, logits_b: torch.Tensor, keep: torch.Tensor) -> float:
    """Largest change of logits on the ``keep`` positions (B, T bool), relative to their scale."""
    if not keep.any():
        return 0.0
    a, b = logits_a[keep], logits_b[keep]
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf") if not torch.equal(a.isnan(), b.isnan()) else 0.0
    return float((a - b).abs().max() / max(1.0, float(a.abs().max())))


class _ProbedTwice(Detector, abc.ABC):
    """A forward probe run at the start and, if it found nothing, again on the trained model (which leans on
    context far more: a faint leak at init shows then). ``PROBED`` says what the probe feeds the model."""

    PROBED = ""

    def on_start(self, ctx) -> None:
        try:
            self._probe(ctx)
        except Exception as exc:  # noqa: BLE001 - a crash on a documented input is evidence
            report_raise(self, ctx, exc, self.PROBED)

    def on_end(self, ctx, metrics) -> None:
        if not self.findings:
            try:
                self._probe(ctx)
            except Exception:  # noqa: BLE001 - reported at on_start already
                pass

    @abc.abstractmethod
    def _probe(self, ctx) -> None:
        """Run the probe once; report what it finds."""


@register
class CausalityProbe(_ProbedTwice):
    id = "causality_probe"
    needs_facts = ("train_docs", "pad_id", "vocab_size", "device")
    needs_roles = ("forward",)
    family = "mask"
    passive = False
    description = ("perturb the tokens after t: logits at <= t must not move, on the mask-free path (no padding) "
                   "and the explicit-mask path (left padding); the leaking path localizes the cause")
    PROBED = "a causality probe (unpadded and left-padded batches)"

    def _probe(self, ctx) -> None:
        device = probes.device(ctx)
        vocab = ctx.fact("vocab_size")
        docs = _probe_docs(ctx, 4, max_len=24)
        width = min(len(d) for d in docs)
        leaks = {}
        with ctx.probe():
            model = ctx.role("forward")
            # mask-free path: every row real, the same length
            ids = torch.tensor([d[:width] for d in docs], device=device)
            t = width // 2
            perturbed = ids.clone()
            perturbed[:, t + 1:] = (perturbed[:, t + 1:] + 5) % vocab
            with capture_masks(ctx) as cap:
                a = model(ids).float()
            b = model(perturbed).float()
            none_path = bool(cap.masks) and cap.masks[0] is None
            keep = torch.zeros(ids.shape, dtype=torch.bool, device=device)
            keep[:, : t + 1] = True
            leaks["unpadded"] = _leak(a, b, keep)
            # explicit-mask path: left padding
            ids, attention_mask = probes.pad(docs, ctx.fact("pad_id"), device)
            width = ids.shape[1]
            t = width - 4
            perturbed = ids.clone()
            perturbed[:, t + 1:] = (perturbed[:, t + 1:] + 5) % vocab  # the last columns are real in every row
            a = model(ids, attention_mask).float()
            b = model(perturbed, attention_mask).float()
            keep = attention_mask.bool().clone()
            keep[:, t + 1:] = False
            leaks["left_padded"] = _leak(a, b, keep)
        none_leak, mask_leak = leaks["unpadded"] > LEAK_TOL, leaks["left_padded"] > LEAK_TOL
        if not (none_leak or mask_leak):
            return
        evidence = {"relative_logit_change": leaks, "unpadded_batch_used_mask_free_path": none_path}
        mask_failures = diagnose(ctx, "mask_builder",
                                 lambda build: check_build_mask(build, device, CONTRACT_CASES[:1], (torch.float32,)))
        if mask_leak and mask_failures:
            evidence["mask_problems"] = mask_failures
            report_mask(self, ctx, "future tokens change earlier logits with left padding, and the mask builder lets "
                        "queries see what they must not", evidence, confidence=0.8)
        elif attend := diagnose(ctx, "attend", lambda fn: attend_diagnosis(fn, device)):
            evidence["attend"] = attend["cases"]
            self.report(ctx, attend["subsystem"], ctx.role_seam("attend"), "future tokens change earlier logits "
                        f"although the mask builder is right; attend breaks its contract on the {attend['case']}: "
                        f"{attend['problem']}", evidence, confidence=0.75)
        else:
            checked = [r for r in ("mask_builder", "attend") if r in ctx.roles]
            self.report(ctx, "model" if mask_leak and len(checked) == 2 else "mask", None,
                        "future tokens change earlier logits although "
                        + (f"{' and '.join(checked)} keep their contracts" if checked else "nothing else was checked"),
                        evidence, confidence=0.4)


@register
class PaddingInvariance(_ProbedTwice):
    id = "padding_invariance"
    needs_facts = ("train_docs", "pad_id", "device")
    needs_roles = ("forward",)
    family = "mask"
    passive = False
    description = "each document alone vs inside a left- and a right-padded batch: its real-token logits must match"
    PROBED = "a document alone or in a padded batch"

    def _probe(self, ctx) -> None:
        device = probes.device(ctx)
        docs = _probe_docs(ctx, 4, max_len=24)
        gaps = {}
        with ctx.probe():
            model = ctx.role("forward")
            alone = [model(torch.tensor([d], device=device)).float()[0] for d in docs]
            for side in ("left", "right"):
                ids, attention_mask = probes.pad(docs, ctx.fact("pad_id"), device, side)
                batched = model(ids, attention_mask).float()
                worst = 0.0
                for row in range(len(docs)):
                    real = attention_mask[row].bool()
                    got, want = batched[row][real], alone[row]
                    if not torch.isfinite(got).all():
                        worst = float("inf")
                        break
                    worst = max(worst, float((got - want).abs().max() / max(1.0, float(want.abs().max()))))
                gaps[side] = worst
        bad = [side for side, gap in gaps.items() if gap > LEAK_TOL]
        if not bad:
            return
        evidence = {"relative_logit_gap": gaps}
        mask_failures = diagnose(ctx, "mask_builder",
                                 lambda build: check_build_mask(build, device, CONTRACT_CASES[:1], (torch.float32,)))
        positions = diagnose(ctx, "position_ids", lambda fn: positions_problem(fn, device))
        attend = diagnose(ctx, "attend", lambda fn: attend_diagnosis(fn, device))
        what = f"a document's real-token logits change when it is {' and '.join(bad)}-padded in a batch"
        if "left" in bad and mask_failures:
            evidence["mask_problems"] = mask_failures
            report_mask(self, ctx, f"{what}; the mask builder lets real tokens see pads or the future", evidence,
                        confidence=0.8)
        elif "left" in bad and positions:
            evidence["positions"] = positions
            self.report(ctx, "position", ctx.role_seam("position_ids"), f"{what}; left padding moves the positions",
                        evidence, confidence=0.75)
        elif attend:
            evidence["attend"] = attend["cases"]
            self.report(ctx, attend["subsystem"], ctx.role_seam("attend"), f"{what}; attend breaks its contract on the "
                        f"{attend['case']}: {attend['problem']}", evidence, confidence=0.7)
        elif bad == ["right"]:
            self.report(ctx, "mask", ctx.role_seam("attend"), f"{what}, while the left-padded (explicit mask) batch is "
                        "fine: the mask-free path lets real tokens see the pads after them", evidence, confidence=0.6)
        else:
            self.report(ctx, "mask", None, what, evidence, confidence=0.4)
