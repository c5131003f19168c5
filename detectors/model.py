"""Model detectors: the attention math, the model at init against golden runs, and the output contract.

- ``attend_contract`` calls the run's ``attend`` on random q, k, v (mask-free causal path, an arbitrary
  explicit mask, cached chunk and decode steps, large scores) and compares it with softmax(q k^T /
  sqrt(hs) + mask) v computed in float64. A mismatch where keys the mask forbids change a query's
  output is a mask bug (the mask is not honoured); any other mismatch is the attention math.
- ``init_envelope`` compares the model with ``ctx.golden`` (clean runs of the same recipe, other
  seeds): parameter structure (count, tied parameters), each parameter's RMS at init, and each
  module's output RMS in the first training forward. The first module (in completion order) whose
  output leaves the envelope localizes the seam (its nearest Block / attention / MLP / GPT).
- ``module_composition``: MLP, Block and GPT forwards equal the documented composition of the run's
  own submodules (e.g. a pre-norm block adds to the un-normalized residual stream).
- ``output_contract``: the model's output must be unnormalized scores (logits), not probabilities or
  log-probabilities (the loss applies log_softmax itself).

Detectors reach the run only through the context; nothing here imports the reference.
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, NotApplicable, register
from faultbench.detectors.probes import attend_diagnosis

ATTEND = "model.attention.attend"
GPT_FORWARD = "model.gpt.GPT.forward"
CLASS_SEAMS = {  # a module class of the reference -> the seam that computes its output
    "CausalSelfAttention": "model.attention.CausalSelfAttention.forward",
    "MLP": "model.gpt.MLP.forward",
    "Block": "model.gpt.Block.forward",
    "GPT": GPT_FORWARD,
}
ENVELOPE = 3.0  # a value is out of the golden envelope when > 3x its largest or < 1/3 of its smallest clean value
ZERO_EPS = 1e-6  # parameters that are exactly 0 at init in clean runs (biases) must stay below this


# ---------------------------------------------------------------------------------------------- attend

@register
class AttendContract(Detector):
    id = "attend_contract"
    needs_facts = ("device",)
    family = "model"
    passive = False
    description = ("the run's attend on random q,k,v (mask-free causal, arbitrary explicit mask, cached steps, large "
                   "scores) vs a float64 softmax(qk^T/sqrt(hs)+mask)v; forbidden keys changing the output -> mask; "
                   "repeat_kv gives query head h the kv head h // groups")

    def check_applicable(self, ctx) -> None:
        super().check_applicable(ctx)
        if not {"attend", "repeat_kv"} & ctx.roles.keys():
            raise NotApplicable("this run has no role attend or repeat_kv")

    def on_start(self, ctx) -> None:
        with ctx.probe():
            found = attend_diagnosis(ctx.role("attend"), probes.device(ctx)) if "attend" in ctx.roles else None
            grouped = repeat_kv_problem(ctx.role("repeat_kv")) if "repeat_kv" in ctx.roles else None
        if found is not None:
            confidence = {"mask": 0.9, "model": 0.9, "precision": 0.8}[found["subsystem"]]
            self.report(ctx, found["subsystem"], ctx.role_seam("attend"), f"attend breaks its contract on the "
                        f"{found['case']}: {found['problem']}", evidence={"cases": found["cases"]},
                        confidence=confidence)
        if grouped is not None:
            self.report(ctx, "model", ctx.role_seam("repeat_kv"), f"repeat_kv breaks its contract: {grouped}",
                        confidence=0.9)


def repeat_kv_problem(repeat) -> str | None:
    """Each of the 2 x 3 query heads of a (1, 2, 4, 8) key tensor repeated 3 times must read kv head h // 3."""
    kv = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(4))
    try:
        out = repeat(kv, 3)
    except Exception as exc:  # noqa: BLE001 - raising on a documented input breaks the contract
        return f"raised {type(exc).__name__}: {str(exc)[:120]}"
    if tuple(out.shape) != (1, 6, 4, 8):
        return f"shape {tuple(out.shape)} for 2 kv heads x 3 groups, expected (1, 6, 4, 8)"
    wrong = [h for h in range(6) if not torch.equal(out[0, h], kv[0, h // 3])]
    return f"query heads {wrong} do not read kv head h // 3" if wrong else None


# ---------------------------------------------------------------------------------------------- golden envelope

def _rms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean().sqrt())


def _envelope(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def _outside(value: float, lo: float, hi: float) -> bool:
    if not math.isfinite(value):
        return True
    if hi <= ZERO_EPS:
        return value > ZERO_EPS + 3 * hi
    return value > ENVELOPE * hi or value < lo / ENVELOPE


def _shared_groups(model) -> list[list[str]]:
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    return sorted(names for names in shared.values() if len(names) > 1)


@register
class InitEnvelope(Detector):
    id = "init_envelope"
    family = "model"
    passive = True
    description = ("parameter structure and RMS at init, and each module's output RMS in the first training forward, "
                   "vs golden runs (3x envelope); the first module out of it localizes the seam")

    def __init__(self) -> None:
        super().__init__()
        self._handles: list = []
        self._seen: list[tuple[str, float]] = []
        self._done = False

    def _runs(self, ctx) -> list[dict]:
        golden = ctx.golden or {}
        return [r for r in golden.get("runs", []) if r]

    def on_start(self, ctx) -> None:
        runs = self._runs(ctx)
        if not runs:
            self._done = True
            return
        model = ctx.run.model
        problems = {}
        structure = [r.get("structure", {}) for r in runs]
        num_params = sum(p.numel() for p in model.parameters())
        golden_counts = sorted({s.get("num_params") for s in structure if "num_params" in s})
        if golden_counts and num_params not in golden_counts:
            problems["num_params"] = {"run": num_params, "golden": golden_counts}
        shared = _shared_groups(model)
        golden_shared = [s["shared"] for s in structure if "shared" in s]
        if golden_shared and all(shared != g for g in golden_shared):
            problems["shared_parameters"] = {"run": shared, "golden": golden_shared[0]}
        rms_runs = [r.get("param_rms", {}) for r in runs]
        names = [n for n, _ in model.named_parameters()]
        missing = sorted(set(rms_runs[0]) - set(names)) if rms_runs[0] else []
        extra = sorted(set(names) - set(rms_runs[0])) if rms_runs[0] else []
        if missing or extra:
            problems["parameter_names"] = {"missing": missing[:8], "extra": extra[:8]}
        out_of_envelope = {}
        for name, p in model.named_parameters():
            values = [r[name] for r in rms_runs if name in r]
            if values:
                value = _rms(p)
                lo, hi = _envelope(values)
                if _outside(value, lo, hi):
                    out_of_envelope[name] = {"rms": value, "golden": [lo, hi]}
        if out_of_envelope:
            problems["param_rms"] = dict(list(out_of_envelope.items())[:8])
            problems["params_out_of_envelope"] = len(out_of_envelope)
        if problems:
            parts = []
            if "num_params" in problems or "shared_parameters" in problems or "parameter_names" in problems:
                parts.append(f"parameter structure differs from clean runs: {num_params} parameters (clean "
                             f"{golden_counts}), shared {shared} (clean {golden_shared[0] if golden_shared else '?'})")
            if out_of_envelope:
                worst = next(iter(out_of_envelope.items()))
                parts.append(f"{len(out_of_envelope)} parameters' RMS at init out of the clean envelope (e.g. "
                             f"{worst[0]}: {worst[1]['rms']:.4g} vs {worst[1]['golden'][0]:.4g}.."
                             f"{worst[1]['golden'][1]:.4g})")
            self.report(ctx, "model", ctx.role_seam("init_weights"), "; ".join(parts), evidence=problems,
                        confidence=0.85)
            self._done = True  # activations follow from the parameters: one root cause, one finding
            return
        for name, module in model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module, args, output):
            if module.training and not self._done and isinstance(output, torch.Tensor):
                self._seen.append((name, _rms(output)))
        return hook

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def on_forward(self, ctx, batch, logits) -> None:
        if self._done:
            return
        self._done = True
        self._remove()
        self._seen.append(("<model>", _rms(logits)))
        golden = [r.get("activation_rms", {}) for r in self._runs(ctx)]
        seen_once: dict[str, float] = {}
        for name, value in self._seen:
            seen_once.setdefault(name, value)
        for name, value in seen_once.items():
            values = [g[name] for g in golden if name in g]
            if not values:
                continue
            lo, hi = _envelope(values)
            if _outside(value, lo, hi):
                self._report_module(ctx, name, value, lo, hi)
                return

    def _report_module(self, ctx, name: str, value: float, lo: float, hi: float) -> None:
        model = ctx.run.model
        modules = dict(model.named_modules())
        path = name.split(".") if name != "<model>" else []
        seam, owner = None, None
        for cut in range(len(path), -1, -1):
            candidate = ".".join(path[:cut])
            module = modules.get(candidate)
            cls = type(module).__name__ if module is not None else None
            if cls in CLASS_SEAMS and CLASS_SEAMS[cls] in ctx.seams:
                seam, owner = CLASS_SEAMS[cls], candidate or "<model>"
                break
        evidence = {"module": name, "rms": value, "golden": [lo, hi], "owner": owner}
        confidence = 0.7
        if seam == CLASS_SEAMS["CausalSelfAttention"]:
            with ctx.probe():
                found = attend_diagnosis(ctx.seam(ATTEND), probes.device(ctx))
            if found is not None:
                seam = ATTEND
                evidence["attend"] = found["problem"]
        self.report(ctx, "model", seam, f"first training forward: {name} output RMS {value:.4g} is outside the "
                    f"clean envelope {lo:.4g}..{hi:.4g} (3x), the first module to leave it: {seam or 'unknown'}",
                    evidence=evidence, confidence=confidence)


# ---------------------------------------------------------------------------------------------- composition

def _reference_rope(head_dim: int, positions: torch.Tensor, base: float):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[..., None] * inv_freq.to(positions.device)
    return angles.cos().float().unsqueeze(1), angles.sin().float().unsqueeze(1)


def _relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())):
        return math.inf
    return float((got.float() - want.float()).abs().max() / max(1e-6, float(want.float().abs().max())))


COMPOSE_TOL = 1e-4  # relative; clean fp32 compositions agree to ~1e-7


@register
class ModuleComposition(Detector):
    id = "module_composition"
    needs_run = ("corpus.train",)
    needs_config = ("model.n_embd", "model.n_head", "model.rope_base", "train.device")
    needs_seams = (ATTEND, GPT_FORWARD)
    family = "model"
    passive = False
    description = ("MLP, Block and GPT forwards vs their documented composition of the run's own submodules "
                   "(proj(act(fc(x))); x + attn(ln_1 x), then + mlp(ln_2 x); lm_head(ln_f(blocks(wte ids))))")

    def on_start(self, ctx) -> None:
        with ctx.probe():
            for check in (self._mlp, self._block, self._gpt):
                try:
                    found = check(ctx)
                except Exception:  # noqa: BLE001 - a model unlike the reference's layout: nothing to compare
                    found = None
                if found:
                    seam, message, gap = found
                    self.report(ctx, "model", seam, message, evidence={"relative_gap": gap}, confidence=0.9)
                    return

    @staticmethod
    def _inputs(ctx, T: int = 10):
        gen = torch.Generator().manual_seed(23)
        C = ctx.config.model.n_embd
        x = torch.randn(2, T, C, generator=gen).to(probes.device(ctx))
        return x, gen

    def _mlp(self, ctx):
        mlps = [m for _, m in ctx.run.model.named_modules() if type(m).__name__ == "MLP"]
        if not mlps or "model.gpt.MLP.forward" not in ctx.seams:
            return None
        m = mlps[0]
        x, _ = self._inputs(ctx)
        gap = _relative_gap(m(x), m.proj(m.act(m.fc(x))))
        if gap > COMPOSE_TOL:
            return ("model.gpt.MLP.forward", f"MLP.forward differs from proj(act(fc(x))) in eval mode (relative "
                    f"{gap:.3g})", gap)
        return None

    def _block(self, ctx):
        blocks = [m for _, m in ctx.run.model.named_modules() if type(m).__name__ == "Block"]
        if not blocks or "model.gpt.Block.forward" not in ctx.seams:
            return None
        b = blocks[0]
        x, _ = self._inputs(ctx)
        mcfg = ctx.config.model
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        rope = _reference_rope(mcfg.n_embd // mcfg.n_head, pos, mcfg.rope_base)
        got = b(x, rope, None)
        h = x + b.attn(b.ln_1(x), rope, None)
        want = h + b.mlp(b.ln_2(h))
        gap = _relative_gap(got, want)
        if gap > COMPOSE_TOL:
            return ("model.gpt.Block.forward", "Block.forward differs from its pre-norm composition x + "
                    f"attn(ln_1(x)), then + mlp(ln_2(.)) of its own submodules (relative {gap:.3g}): the residual "
                    "stream is not carried as documented", gap)
        return None

    def _gpt(self, ctx):
        model = ctx.run.model
        if GPT_FORWARD not in ctx.seams:
            return None
        docs = [list(d) for d in ctx.run.corpus.train[:200] if len(d) >= 10][:2]
        ids = torch.tensor([d[:10] for d in docs], device=probes.device(ctx))
        ones = torch.ones_like(ids)
        got = model(ids)
        positions = ctx.seam("model.rope.position_ids_from_mask")(ones, 0)
        rope = ctx.seam("model.rope.rope_at")(model.rope_cos, model.rope_sin, positions)
        mask = ctx.seam("model.attention.build_attention_mask")(ones, ids.shape[1], torch.float32)
        x = model.wte(ids)
        for i, block in enumerate(model.blocks):
            x = block(x, rope, mask, None, i)
        want = model.lm_head(model.ln_f(x))
        gap = _relative_gap(got, want)
        if gap > COMPOSE_TOL:
            return (GPT_FORWARD, f"GPT.forward differs from lm_head(ln_f(blocks(wte(ids)))) composed of its own "
                    f"submodules and the run's position/rope/mask functions (relative {gap:.3g})", gap)
        return None


# ---------------------------------------------------------------------------------------------- output contract

def output_kind(logits: torch.Tensor) -> str | None:
    """'probabilities' or 'log-probabilities' when the output is normalized over the vocabulary, else None."""
    x = logits.detach().float()
    if x.numel() == 0 or not bool(torch.isfinite(x).all()):
        return None
    x = x.reshape(-1, x.shape[-1])
    if bool((x >= 0).all() and (x <= 1).all()) and bool(((x.sum(-1) - 1).abs() < 1e-2).all()):
        return "probabilities"
    if bool((x <= 1e-4).all()) and bool((x.logsumexp(-1).abs() < 1e-2).all()):
        return "log-probabilities"
    return None


@register
class OutputContract(Detector):
    id = "output_contract"
    needs_run = ("corpus.train",)
    needs_config = ("model.vocab_size", "train.device")
    needs_seams = (GPT_FORWARD,)
    family = "model"
    passive = True
    description = "the model returns unnormalized scores (B, T, vocab), not probabilities or log-probabilities"

    def __init__(self) -> None:
        super().__init__()
        self._checked_train = False

    def on_start(self, ctx) -> None:
        docs = [list(d) for d in ctx.run.corpus.train[:4]]
        width = min(len(d) for d in docs)
        ids = torch.tensor([d[:width] for d in docs], device=probes.device(ctx))
        with ctx.probe() as model:
            try:
                logits = model(ids)
            except Exception:  # noqa: BLE001 - a model that cannot run is other detectors' finding
                return
        self._check(ctx, logits, "eval-mode probe", tuple(ids.shape))

    def on_forward(self, ctx, batch, logits) -> None:
        if self._checked_train or self.findings:
            return
        self._checked_train = True
        self._check(ctx, logits, "first training forward", tuple(batch["input_ids"].shape))

    def _check(self, ctx, logits, where: str, shape) -> None:
        vocab = ctx.config.model.vocab_size
        if tuple(logits.shape) != (*shape, vocab):
            self.report(ctx, "model", GPT_FORWARD, f"{where}: output shape {tuple(logits.shape)}, expected "
                        f"{(*shape, vocab)}", confidence=0.8)
            return
        kind = output_kind(logits[:1])  # one row is enough and keeps the training-forward check cheap
        if kind:
            self.report(ctx, "model", GPT_FORWARD, f"{where}: the model returns {kind} (normalized over the "
                        "vocabulary), not logits; the loss's log_softmax then squashes them to near-uniform",
                        evidence={"min": float(logits.min()), "max": float(logits.max()),
                                  "row_sum": float(logits[0, 0].float().sum())}, confidence=0.9)
