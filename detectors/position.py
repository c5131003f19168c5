"""Position detectors: position ids, the RoPE tables and rotation, and positions in cached decoding.

- ``rope_properties`` checks each position seam against its documented contract on crafted inputs:
  ``rope_tables`` has ``max_positions`` rows of unit (cos, sin) pairs whose angles grow linearly
  with the position at the frequencies base^(-2i/hs); ``rope_at`` picks the rows of the position ids;
  ``apply_rope`` is a rotation (norms kept, position 0 the identity, scores depend only on relative
  position, dtype kept); ``position_ids_from_mask`` numbers real tokens 0, 1, ... from each row's
  first real token, also for the new columns after ``past_len`` cached ones.
- ``shift_invariance``: RoPE makes attention depend on relative positions only, so shifting every
  position id by a constant must not change an attention module's output (tested on a copy of the
  run's attention module with sharpened weights) or the model's logits. If the rope functions keep
  their contracts, the module applying them (``CausalSelfAttention.forward``) is at fault.
- ``kv_cache_consistency``: cached greedy decoding of left-padded prompts must give the logits of one
  uncached forward over the same tokens, and ``model.generate`` the same tokens. Localized with the
  position contract (past_len), the KV cache's own contract (probed directly), the mask and attend.

Everything reaches the run through the context; nothing imports the reference.
"""

from __future__ import annotations

import copy

import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, register

TABLES = "model.rope.rope_tables"
ROPE_AT = "model.rope.rope_at"
APPLY = "model.rope.apply_rope"
POSITIONS = "model.rope.position_ids_from_mask"
ATTN_FORWARD = "model.attention.CausalSelfAttention.forward"
GPT_FORWARD = "model.gpt.GPT.forward"
GENERATE = "model.gpt.GPT.generate"
KV_UPDATE = "model.gpt.KVCache.update"
BUILD_MASK = "model.attention.build_attention_mask"
ATTEND = "model.attention.attend"
SHIFT_TOL = 1e-3  # relative output change under a position shift (clean fp32: ~1e-6)
CACHE_TOL = 1e-4  # relative gap between cached and uncached logits (clean fp32: ~1e-7)


def reference_tables(head_dim: int, rows: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin tables computed here in float64, returned in float32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(rows, dtype=torch.float64), inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)


# ---------------------------------------------------------------------------------------------- contracts

def tables_problem(fn, head_dim: int, max_positions: int, base: float) -> str | None:
    try:
        cos, sin = fn(head_dim, max_positions, base)
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}: {str(exc)[:120]}"
    want = (max_positions, head_dim // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            return f"{name} table has shape {tuple(t.shape)}, expected {want} (one row per position < max_positions)"
        if t.dtype != torch.float32:
            return f"{name} table is {t.dtype}, expected float32"
        if not bool(torch.isfinite(t).all()):
            return f"{name} table holds inf/NaN"
    c, s = cos.double().cpu(), sin.double().cpu()
    if not torch.allclose(c * c + s * s, torch.ones_like(c), atol=1e-4):
        return "cos^2 + sin^2 != 1: the tables are not angles of a rotation"
    if not (torch.allclose(c[0], torch.ones_like(c[0]), atol=1e-6) and torch.allclose(s[0], torch.zeros_like(s[0]),
                                                                                       atol=1e-6)):
        return "row 0 is not the identity (cos 1, sin 0)"
    ref_cos, ref_sin = reference_tables(head_dim, max_positions, base)
    if not (torch.allclose(c, ref_cos.double(), atol=1e-3) and torch.allclose(s, ref_sin.double(), atol=1e-3)):
        theta = torch.atan2(s[1], c[1])
        p = torch.arange(max_positions, dtype=torch.float64)[:, None]
        linear = torch.allclose(c, torch.cos(p * theta), atol=1e-3) and torch.allclose(s, torch.sin(p * theta),
                                                                                        atol=1e-3)
        return ("the angles are not position x base^(-2i/hs)" if linear
                else "the angles do not grow linearly with the position")
    return None


def rope_at_problem(fn, head_dim: int, device) -> str | None:
    cos, sin = reference_tables(head_dim, 16, 10000.0, device)
    position_ids = torch.tensor([[0, 1, 2, 5], [3, 3, 0, 15]], device=device)
    try:
        got_cos, got_sin = fn(cos, sin, position_ids)
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}: {str(exc)[:120]}"
    want = (2, 1, 4, head_dim // 2)
    if tuple(got_cos.shape) != want or tuple(got_sin.shape) != want:
        return f"shapes {tuple(got_cos.shape)}, {tuple(got_sin.shape)}, expected {want}"
    if not (torch.equal(got_cos[:, 0], cos[position_ids]) and torch.equal(got_sin[:, 0], sin[position_ids])):
        return "the rows returned are not the table rows of the position ids"
    return None


def apply_rope_problem(fn, head_dim: int, device) -> str | None:
    gen = torch.Generator().manual_seed(5)
    cos, sin = reference_tables(head_dim, 32, 10000.0, device)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]], device=device)
    rope = (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    x = torch.randn(2, 3, 5, head_dim, generator=gen).to(device)
    try:
        y = fn(x, *rope)
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}: {str(exc)[:120]}"
    if tuple(y.shape) != tuple(x.shape) or y.dtype != x.dtype:
        return f"returns {tuple(y.shape)} {y.dtype} for {tuple(x.shape)} {x.dtype}"
    if not torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-4, atol=1e-5):
        ratio = (y.norm(dim=-1) / x.norm(dim=-1))
        return (f"not a rotation: vector norms change (ratio {float(ratio.min()):.4g}..{float(ratio.max()):.4g})")
    if not torch.allclose(y[0, :, 0], x[0, :, 0], atol=1e-5):
        return "position 0 is not the identity"
    # scores depend only on m - n: the same q, k at positions shifted by 7
    q, k = x[0:1, :, :5], torch.randn(1, 3, 5, head_dim, generator=gen).to(device)
    rope_a = (cos[positions[0:1]].unsqueeze(1), sin[positions[0:1]].unsqueeze(1))
    rope_b = (cos[positions[1:2]].unsqueeze(1), sin[positions[1:2]].unsqueeze(1))
    sa = fn(q, *rope_a) @ fn(k, *rope_a).transpose(-2, -1)
    sb = fn(q, *rope_b) @ fn(k, *rope_b).transpose(-2, -1)
    if not torch.allclose(sa, sb, rtol=1e-3, atol=1e-4):
        return f"scores depend on absolute positions (max change {float((sa - sb).abs().max()):.3g} under a shift of 7)"
    xb = x.to(torch.bfloat16)
    try:
        yb = fn(xb, *rope)
    except Exception as exc:  # noqa: BLE001
        return f"bfloat16 input raised {type(exc).__name__}"
    if yb.dtype != torch.bfloat16:
        return f"bfloat16 input comes back as {yb.dtype}"
    return None


def rope_pair_problem(pair, head_dim: int, device) -> str | None:
    """The apply_rope role's contract: each of its outputs is a rotation (``apply_rope_problem``), and the scores of
    its rotated queries against its rotated keys depend only on relative positions."""
    for side, name in ((0, "queries"), (1, "keys")):
        problem = apply_rope_problem(lambda x, cos, sin, side=side: pair(x, x, cos, sin)[side], head_dim, device)
        if problem:
            return f"on the {name}: {problem}"
    gen = torch.Generator().manual_seed(6)
    cos, sin = reference_tables(head_dim, 32, 10000.0, device)
    q, k = (torch.randn(1, 2, 5, head_dim, generator=gen).to(device) for _ in range(2))
    scores = []
    for start in (0, 7):
        pos = torch.arange(start, start + 5, device=device)[None]
        rq, rk = pair(q, k, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
        scores.append(rq @ rk.transpose(-2, -1))
    if not torch.allclose(scores[0], scores[1], rtol=1e-3, atol=1e-4):
        return ("the scores of rotated queries against rotated keys depend on absolute positions (max change "
                f"{float((scores[0] - scores[1]).abs().max()):.3g} under a shift of 7): queries and keys are not "
                "rotated alike")
    return None


def positions_problem(fn, device) -> str | None:
    """Real tokens numbered 0, 1, ... from each row's first real token, for the columns after ``past_len``."""
    cases = (
        ([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], 0, "left/right padding, no cache"),
        ([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]], 5,
         "left padding, past_len=5 (a cached chunk)"),
        ([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]], 7,
         "left padding, past_len=7 (a decode step)"),
    )
    for rows, past_len, name in cases:
        mask = torch.tensor(rows, device=device)
        want = (mask.cumsum(-1) - 1)[:, past_len:]
        real = mask[:, past_len:].bool()
        try:
            got = fn(mask, past_len)
        except Exception as exc:  # noqa: BLE001
            return f"{name}: raised {type(exc).__name__}: {str(exc)[:120]}"
        if tuple(got.shape) != tuple(want.shape):
            return f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if got.dtype.is_floating_point or not torch.equal(got[real].long(), want[real]):
            return f"{name}: real-token positions {got.tolist()}, expected {want.masked_fill(~real, 0).tolist()}"
    return None


def _kv_states(device) -> tuple[torch.Tensor, ...]:
    """Keys and values of two appends: 3 positions, then 2 (B=2, nh=2, hs=4)."""
    gen = torch.Generator().manual_seed(9)
    return tuple(torch.randn(2, 2, n, 4, generator=gen).to(device) for n in (3, 3, 2, 2))


def _appended_in_order(append, k1, v1, k2, v2, verb: str) -> str | None:
    """``append(k, v)`` returns exactly what it was given first, then the old states followed by the new."""
    k, v = append(k1, v1)
    if not (torch.equal(k, k1) and torch.equal(v, v1)):
        return f"the first {verb} does not return exactly the keys/values it was given"
    k, v = append(k2, v2)
    if not (torch.equal(k, torch.cat([k1, k2], 2)) and torch.equal(v, torch.cat([v1, v2], 2))):
        return f"a second {verb} does not return the first keys/values followed by the new ones"
    return None


def kv_cache_problem(cls, device) -> str | None:
    """KVCache.update appends at the layer's length and returns everything cached, per layer."""
    k1, v1, k2, v2 = _kv_states(device)
    try:
        cache = cls(2, 8)
        problem = _appended_in_order(lambda k, v: cache.update(0, k, v), k1, v1, k2, v2, "update")
        if problem:
            return problem
        k, v = cache.update(1, k1 * 2, v1 * 2)
        if not (torch.equal(k, k1 * 2) and torch.equal(v, v1 * 2)):
            return "layers share storage or lengths"
        if cache.length != 5:
            return f"length is {cache.length} after appending 3 + 2 tokens to layer 0"
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}: {str(exc)[:120]}"
    return None


def kv_append_problem(fresh, device) -> str | None:
    """The kv_append role: a fresh cache returns exactly what it was given, then the old states followed by the new."""
    try:
        return _appended_in_order(fresh(), *_kv_states(device), "append")
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}: {str(exc)[:120]}"


def _mask_with_cache_problem(fn, device) -> str | None:
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], device=device)
    try:
        mask = fn(attention_mask, 1, torch.float32)
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}: {str(exc)[:120]}"
    if mask is None or tuple(mask.shape) != (2, 1, 1, 6):
        return f"decode-step mask is {None if mask is None else tuple(mask.shape)}, expected (2, 1, 1, 6)"
    allowed = attention_mask.bool()[:, None, None, :]
    if not (bool((mask[allowed] == 0).all()) and bool((mask[~allowed] < -1e3).all())):
        return "the decode-step mask does not allow exactly the real keys"
    return None


def _attend_decode_problem(fn, device) -> str | None:
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 2, n, 8, generator=gen).to(device) for n in (1, 6, 6))
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], device=device)
    additive = torch.zeros(2, 1, 1, 6, device=device).masked_fill(~attention_mask.bool()[:, None, None, :],
                                                                  torch.finfo(torch.float32).min)
    try:
        out = fn(q, k, v, additive, 0.0)
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}"
    ref = probes.softmax_attention(q, k, v, additive)
    if tuple(out.shape) != tuple(ref.shape) or not torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-4):
        return "attend of one query against cached keys differs from softmax(q k^T / sqrt(hs) + mask) v"
    return None


# ---------------------------------------------------------------------------------------------- detectors

@register
class RopeProperties(Detector):
    id = "rope_properties"
    needs_config = ("model.n_embd", "model.n_head", "model.max_positions", "model.rope_base", "train.device")
    needs_seams = (TABLES, ROPE_AT, APPLY, POSITIONS)
    family = "position"
    passive = False
    description = ("rope_tables (max_positions rows, unit angles, linear in position), rope_at, apply_rope (a "
                   "rotation: norms kept, relative scores) and position_ids_from_mask (left padding, past_len) vs "
                   "their contracts")

    def on_start(self, ctx) -> None:
        mcfg = ctx.config.model
        device = probes.device(ctx)
        head_dim = mcfg.n_embd // mcfg.n_head
        checks = (
            (TABLES, lambda: tables_problem(ctx.seam(TABLES), head_dim, mcfg.max_positions, mcfg.rope_base)),
            (ROPE_AT, lambda: rope_at_problem(ctx.seam(ROPE_AT), head_dim, device)),
            (APPLY, lambda: apply_rope_problem(ctx.seam(APPLY), head_dim, device)),
            (POSITIONS, lambda: positions_problem(ctx.seam(POSITIONS), device)),
        )
        with ctx.probe():
            for seam, check in checks:
                problem = check()
                if problem:
                    self.report(ctx, "position", seam, f"{seam.rsplit('.', 1)[-1]} breaks its contract: {problem}",
                                evidence={"problem": problem}, confidence=0.9)
            buffers = {n: b for n, b in ctx.run.model.named_buffers() if n in ("rope_cos", "rope_sin")}
            rows = {n: int(b.shape[0]) for n, b in buffers.items()}
            if rows and any(r != mcfg.max_positions for r in rows.values()) and not self.findings:
                self.report(ctx, "position", TABLES, f"the model's RoPE tables have {rows} rows, expected "
                            f"max_positions={mcfg.max_positions}", evidence={"rows": rows}, confidence=0.8)


def _rope_seam_at_fault(ctx, head_dim: int, device) -> tuple[str, str] | None:
    """(seam, problem) of the first RoPE part the run offers (its apply_rope role, the reference's rope_at) that
    breaks its contract; None if they keep them (or none is offered)."""
    checks = []
    if "apply_rope" in ctx.roles:
        checks.append((ctx.role_seam("apply_rope"), lambda: rope_pair_problem(ctx.role("apply_rope"), head_dim,
                                                                               device)))
    if ctx.known_seam(ROPE_AT):  # the reference's table lookup
        checks.append((ROPE_AT, lambda: rope_at_problem(ctx.seam(ROPE_AT), head_dim, device)))
    for seam, check in checks:
        problem = check()
        if problem:
            return seam, problem
    return None


@register
class ShiftInvariance(Detector):
    id = "shift_invariance"
    needs_facts = ("train_docs", "head_dim", "max_positions", "device")
    needs_roles = ("forward",)
    family = "position"
    passive = False
    description = ("shifting every position id by a constant must not change an attention module's output (a copy with "
                   "sharpened weights) nor the model's logits; localized with the rope contracts")

    def on_start(self, ctx) -> None:
        with ctx.probe():
            self._module_probe(ctx)
            if not self.findings:
                self._model_probe(ctx, "at init")

    def on_end(self, ctx, metrics) -> None:
        if not self.findings:
            with ctx.probe():
                self._model_probe(ctx, "after training")

    def _module_probe(self, ctx) -> None:
        """The reference's attention module alone (its forward takes the RoPE tables), where the run has it."""
        found = probes.modules_named(ctx, "CausalSelfAttention")
        if not found or not ctx.known_seam(ATTN_FORWARD):
            return
        self.require(ctx, config=("model.n_embd", "model.n_head", "model.rope_base"))
        module = copy.deepcopy(found[0][1]).eval()
        device = probes.device(ctx)
        gen = torch.Generator().manual_seed(17)
        C = ctx.config.model.n_embd
        head_dim = C // ctx.config.model.n_head
        for p in module.parameters():  # sharp, position-sensitive attention: scores of order 1
            p.copy_((torch.randn(p.shape, generator=gen) * (1.5 / C ** 0.5 if p.dim() > 1 else 0.1)).to(p))
        T, shift = 12, 9
        cos, sin = reference_tables(head_dim, T + shift, ctx.config.model.rope_base, device)
        x = torch.randn(2, T, C, generator=gen).to(device)
        outs = []
        for start in (0, shift):
            pos = torch.arange(start, start + T, device=device)[None].expand(2, T)
            try:
                outs.append(module(x, (cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)), None).float())
            except Exception:  # noqa: BLE001 - a module that cannot run is another detector's finding
                return
        gap = float((outs[0] - outs[1]).abs().max() / max(1e-6, float(outs[0].abs().max())))
        if gap <= SHIFT_TOL:
            return
        evidence = {"relative_change": gap, "shift": shift}
        at_fault = _rope_seam_at_fault(ctx, head_dim, device)
        if at_fault:
            evidence["rope_problem"] = at_fault[1]
            self.report(ctx, "position", at_fault[0], f"an attention module's output changes when every position is "
                        f"shifted by {shift} (relative {gap:.3g}); {at_fault[0]} breaks its contract", evidence,
                        confidence=0.8)
        else:
            self.report(ctx, "position", ATTN_FORWARD, f"an attention module's output changes when every position "
                        f"is shifted by {shift} (relative {gap:.3g}) although rope_at and apply_rope keep their "
                        "contracts: CausalSelfAttention.forward does not rotate queries and keys alike", evidence,
                        confidence=0.8)

    def _model_probe(self, ctx, when: str) -> None:
        device = probes.device(ctx)
        docs = [list(d) for d in ctx.fact("train_docs")[:400] if 16 <= len(d) <= 40][:3]
        if len(docs) < 2:
            return
        width = min(len(d) for d in docs)
        shift = min(8, ctx.fact("max_positions") - width)
        if shift <= 0:
            return
        ids = torch.tensor([d[:width] for d in docs], device=device)
        pos = torch.arange(width, device=device)[None].expand(len(docs), width)
        forward = ctx.role("forward")
        try:
            a = forward(ids, None, pos).float()
            b = forward(ids, None, pos + shift).float()
        except Exception:  # noqa: BLE001
            return
        gap = float((a - b).abs().max() / max(1.0, float(a.abs().max())))
        if gap <= SHIFT_TOL:
            return
        head_dim = ctx.fact("head_dim")
        evidence = {"relative_logit_change": gap, "shift": shift, "when": when}
        at_fault = _rope_seam_at_fault(ctx, head_dim, device)
        if at_fault:
            evidence["rope_problem"] = at_fault[1]
            self.report(ctx, "position", at_fault[0], f"{when}: the logits change when every position id is shifted "
                        f"by {shift}; {at_fault[0]} breaks its contract", evidence, confidence=0.75)
        else:
            self.report(ctx, "position", None, f"{when}: the logits change when every position id is shifted by "
                        f"{shift} (relative {gap:.3g}): attention is not relative in position", evidence,
                        confidence=0.5)


@register
class KVCacheConsistency(Detector):
    id = "kv_cache_consistency"
    needs_facts = ("train_docs", "val_docs", "pad_id", "max_positions", "device")
    needs_roles = ("forward",)
    family = "position"
    passive = False
    description = ("KVCache.update's contract; cached greedy decode of left-padded prompts vs one uncached forward "
                   "over the same tokens (logits) and model.generate (tokens); localized by the position, cache and "
                   "mask contracts")

    MAX_NEW = 8

    def on_start(self, ctx) -> None:
        if not ctx.known_seam(GENERATE):  # a stack whose cached decoding is offered as a role
            self.require(ctx, roles=("decode",))
            self._decode_by_role(ctx, "at init")
            return
        self.require(ctx, config=("model.n_layer",), seams=(KV_UPDATE, POSITIONS, BUILD_MASK, ATTEND))
        with ctx.probe():
            problem = kv_cache_problem(ctx.seam("model.gpt.KVCache"), probes.device(ctx))
        if problem:
            self.report(ctx, "model", KV_UPDATE, f"KVCache.update breaks its contract: {problem}",
                        evidence={"problem": problem}, confidence=0.9)
            return
        self._decode_probe(ctx, "at init")

    def on_end(self, ctx, metrics) -> None:
        if not self.findings:
            if ctx.known_seam(GENERATE):
                self._decode_probe(ctx, "after training")
            else:
                self._decode_by_role(ctx, "after training")

    def _prompts(self, ctx):
        docs = [list(d) for d in ctx.fact("val_docs")[:200] if len(d) >= 12][:3]
        if len(docs) < 3:
            docs = [list(d) for d in ctx.fact("train_docs")[:400] if len(d) >= 12][:3]
        prompts = [d[:n] for d, n in zip(docs, (5, 12, 8), strict=False)]
        return probes.pad(prompts, ctx.fact("pad_id"), probes.device(ctx), "left")

    def _decode_by_role(self, ctx, when: str) -> None:
        """The decode role's greedy cached decoding of left-padded prompts against one uncached forward (the forward
        role, positions counted from each row's first real token) over the same tokens."""
        n = self.MAX_NEW
        with ctx.probe():
            ids, mask = self._prompts(ctx)
            T0 = ids.shape[1]
            if T0 + n > ctx.fact("max_positions"):
                return
            try:
                tokens, cached = ctx.role("decode")(ids, mask, n)
                full_ids = torch.cat([ids, tokens[:, :-1]], dim=1)
                full_mask = torch.cat([mask, torch.ones_like(full_ids[:, T0:])], dim=1)
                positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
                uncached = ctx.role("forward")(full_ids, full_mask, positions).float()[:, T0 - 1:]
            except Exception as exc:  # noqa: BLE001 - a crash in cached decoding is evidence too
                self._localize_by_role(ctx, when, f"cached decoding raises {type(exc).__name__}: {str(exc)[:160]}",
                                       {"error": str(exc)[:300]})
                return
        cached = cached.float()
        if tuple(cached.shape) != tuple(uncached.shape):
            gap = float("inf")
        elif bool(torch.isfinite(uncached).all()) and bool(torch.isfinite(cached).all()):
            gap = float((cached - uncached).abs().max() / max(1.0, float(uncached.abs().max())))
        else:
            gap = float("inf")
        if gap > CACHE_TOL:
            self._localize_by_role(ctx, when, "cached decoding disagrees with an uncached forward over the same "
                                   f"tokens (relative logit gap {gap:.3g})",
                                   {"relative_logit_gap": gap, "when": when, "prompt_lengths": mask.sum(1).tolist()})

    def _localize_by_role(self, ctx, when: str, what: str, evidence: dict) -> None:
        """The KV cache's own contract where the run offers it as a role; else the decoding loop's state."""
        if "kv_append" in ctx.roles:
            with ctx.probe():
                problem = kv_append_problem(ctx.role("kv_append"), probes.device(ctx))
            if problem:
                evidence["contract_problem"] = problem
                self.report(ctx, "model", ctx.role_seam("kv_append"), f"{when}: {what}; the KV cache breaks its "
                            f"contract: {problem}", evidence, confidence=0.8)
                return
        self.report(ctx, "position", ctx.role_seam("decode"), f"{when}: {what}; the KV cache keeps its contract, so "
                    "the state decoding carries from step to step (positions, cache offsets, mask) is suspect",
                    evidence, confidence=0.6)

    def _decode_probe(self, ctx, when: str) -> None:
        cfg = ctx.config.model
        n = self.MAX_NEW
        with ctx.probe() as model:
            ids, mask = self._prompts(ctx)
            T0 = ids.shape[1]
            if T0 + n > cfg.max_positions:
                return
            try:
                cache = ctx.seam("model.gpt.KVCache")(cfg.n_layer, T0 + n)
                logits = model(ids, mask, cache=cache).float()
                cached, tokens, step_mask = [logits[:, -1]], [], mask
                for i in range(n):
                    tokens.append(cached[-1].argmax(-1, keepdim=True))
                    if i + 1 < n:
                        step_mask = torch.cat([step_mask, torch.ones_like(tokens[-1])], dim=1)
                        cached.append(model(tokens[-1], step_mask, cache=cache).float()[:, -1])
                cached = torch.stack(cached, 1)  # (B, n, V)
                full_ids = torch.cat([ids, *tokens[:-1]], dim=1)
                full_mask = torch.cat([mask, torch.ones_like(full_ids[:, T0:])], dim=1)
                uncached = model(full_ids, full_mask).float()[:, T0 - 1:]
                generated = model.generate(ids, mask, max_new_tokens=n)
            except Exception as exc:  # noqa: BLE001 - a crash in cached decoding is evidence too
                self._localize(ctx, when, f"cached decoding raises {type(exc).__name__}: {str(exc)[:160]}",
                               {"error": str(exc)[:300]})
                return
        if bool(torch.isfinite(uncached).all()) and bool(torch.isfinite(cached).all()):
            gap = float((cached - uncached).abs().max() / max(1.0, float(uncached.abs().max())))
        else:  # non-finite logits in decoding: a mismatch whatever the cause
            gap = float("inf")
        evidence = {"relative_logit_gap": gap, "when": when, "prompt_lengths": mask.sum(1).tolist()}
        if gap > CACHE_TOL:
            per_row = ((cached - uncached).abs().amax(dim=(1, 2))).tolist()
            evidence["gap_per_row"] = per_row
            self._localize(ctx, when, f"cached decoding disagrees with an uncached forward over the same tokens "
                           f"(relative logit gap {gap:.3g})", evidence)
            return
        mine = torch.cat([ids, *tokens], dim=1)
        top2 = uncached.topk(2, dim=-1).values
        sure = (top2[..., 0] - top2[..., 1]) > 1e-3  # (B, n): argmax well defined
        if tuple(generated.shape) != tuple(mine.shape):
            differs = torch.ones_like(sure)
        else:
            differs = generated[:, T0:] != mine[:, T0:]
        if bool((differs & sure).any()):
            evidence["generated"] = generated.tolist()
            evidence["expected"] = mine.tolist()
            self.report(ctx, "model", GENERATE, f"{when}: model.generate's greedy tokens differ from a cached decode "
                        "loop whose logits match the uncached forward", evidence, confidence=0.7)

    def _localize(self, ctx, when: str, what: str, evidence: dict) -> None:
        device = probes.device(ctx)
        with ctx.probe():
            checks = (
                ("position", POSITIONS, lambda: positions_problem(ctx.seam(POSITIONS), device), 0.8),
                ("model", KV_UPDATE, lambda: kv_cache_problem(ctx.seam("model.gpt.KVCache"), device), 0.8),
                ("mask", BUILD_MASK, lambda: _mask_with_cache_problem(ctx.seam(BUILD_MASK), device), 0.8),
                ("model", ATTEND, lambda: _attend_decode_problem(ctx.seam(ATTEND), device), 0.7),
            )
            for subsystem, seam, check, confidence in checks:
                problem = check()
                if problem:
                    evidence["contract_problem"] = problem
                    self.report(ctx, subsystem, seam, f"{when}: {what}; {seam.rsplit('.', 1)[-1]} breaks its "
                                f"contract: {problem}", evidence, confidence=confidence)
                    return
        self.report(ctx, "model", GPT_FORWARD, f"{when}: {what}; the position, cache, mask and attention contracts "
                    "hold, so the cached forward path itself is suspect", evidence, confidence=0.5)
