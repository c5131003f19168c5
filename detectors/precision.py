"""Precision detectors: the fp16 GradScaler, non-finite values, and fp16-unsafe attention math.

- ``scaler_monitor`` (fp16 runs; on_start probes, on_after_step): the run's scaler is enabled with a
  scale > 1 (else ``model.precision.make_grad_scaler`` is probed for the config's precision); the run's
  ``model.train.optimizer_step`` updates an enabled throwaway scaler (growth tracker advances, a second
  step works, inf gradients skip the step and halve the scale); ``model.train.clip_gradients`` unscales
  before it measures and clips; live: the scaler's growth tracker / scale advance every step, and long
  runs of skipped steps (overflowing gradients) are reported.
- ``nonfinite_origin`` (on_start, on_batch, on_after_step): when the loss turns non-finite, the step's
  first micro-batch is replayed in a probe with forward hooks on every module (with the current weights,
  or a private copy of the initial ones when an update already wrote inf/NaN), in the run's precision
  and in fp32: the module where non-finite values originate (finite inputs, non-finite output), and
  whether fp32 is fine (then: precision).
- ``fp16_attention_stress`` (on_start, reduced-precision runs): the run's ``model.attention.attend`` on
  crafted queries/keys with large attention scores (|score| up to ~25: exp overflows fp16 past ~11)
  in the compute dtype vs an fp32 softmax reference; a throwaway copy of the model with enlarged
  query/key weights must stay finite under the run's autocast.
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, register

MAKE_SCALER = "model.precision.make_grad_scaler"
OPTIMIZER_STEP = "model.train.optimizer_step"
CLIP = "model.train.clip_gradients"
ATTEND = "model.attention.attend"
AUTOCAST = "model.precision.autocast_context"
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def scaled_optimizer_step_probe(ctx) -> dict:
    """The run's optimizer_step with an enabled GradScaler on a throwaway parameter (SGD, LambdaLR).

    Contract: the step unscales and applies the gradients, updates the scaler (its growth tracker counts
    the finite step; a second step works); inf gradients skip the update and halve the scale."""
    fn = ctx.seam(OPTIMIZER_STEP)
    device = ctx.config.train.device
    p = torch.nn.Parameter(torch.ones(4, device=device))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler(probes.device_type(ctx), init_scale=16.0, enabled=True)
    out: dict = {"problems": []}
    problems = out["problems"]
    for label, grad in (("first", 8.0), ("second", 8.0), ("inf", math.inf)):
        scaler.scale(torch.ones((), device=device))  # a real step scales its loss first (the scaler's lazy init)
        p.grad = torch.full_like(p, grad)
        before, scale_before = p.detach().clone(), scaler.get_scale()
        try:
            skipped = bool(fn(opt, scaler, sched))
        except Exception as exc:
            problems.append(f"the {label} step raises {type(exc).__name__}: {str(exc)[:120]}"
                            + (" (the scaler was not updated after the previous step)" if label != "first" else ""))
            break
        state = scaler.state_dict()
        out[label] = {"skipped": skipped, "tracker": int(state["_growth_tracker"]), "scale": [scale_before,
                      scaler.get_scale()], "param_step": float((before - p.detach()).abs().max())}
        if label == "first":
            if out[label]["tracker"] != 1:
                problems.append(f"after one finite step the scaler's growth tracker is {out[label]['tracker']} "
                                "(expected 1): scaler.update() is not called")
            if not math.isclose(out[label]["param_step"], 0.05, rel_tol=1e-3):
                problems.append(f"the update moved the parameter by {out[label]['param_step']:.4g}, expected 0.05 "
                                "(lr 0.1 x the unscaled gradient 0.5)")
        if label == "inf" and not (skipped and out[label]["param_step"] == 0.0
                                   and scaler.get_scale() < scale_before):
            problems.append(f"inf gradients: returned skipped={skipped}, parameter moved by "
                            f"{out[label]['param_step']:.3g}, scale {scale_before:g} -> {scaler.get_scale():g} "
                            "(expected: skipped, unchanged, smaller scale)")
        if problems:
            break
    return out


def scaled_clip_probe(ctx) -> dict:
    """The run's clip_gradients with an enabled GradScaler (scale 1024) on a throwaway module whose true
    gradient norm is G, max_norm = G / 2. Contract: returns G (unscaled) and leaves gradients of true norm
    G / 2 (unscaled in place, so scaler.step does not unscale them again)."""
    probe = probes.clip_probe(ctx, enabled_scaler=True)
    true_norm, scale, module, exc = probe["true_norm"], probe["scale"], probe["module"], probe["error"]
    out: dict = {"true_norm": true_norm, "max_norm": probe["max_norm"], "scale": scale, "problems": []}
    if exc is not None:
        out["problems"].append(f"raises {type(exc).__name__}: {str(exc)[:120]}")
        return out
    returned = probe["returned"]
    before_step = probes.l2_norm(p.grad for p in module.parameters())
    with probes.quiet():
        probe["scaler"].step(probe["optimizer"])  # unscales only if clip_gradients did not: what the optimizer used
    used = probes.l2_norm(p.grad for p in module.parameters())
    out.update(returned=returned, grad_norm_after_clip=before_step, grad_norm_used=used)
    if not math.isclose(returned, true_norm, rel_tol=1e-4):
        ratio = returned / true_norm
        hint = " = the loss scale: the gradients were not unscaled first" if math.isclose(ratio, scale, rel_tol=1e-3) \
            else ""
        out["problems"].append(f"returns norm {returned:.6g}, the true pre-clip norm is {true_norm:.6g} "
                               f"(x{ratio:.4g}{hint})")
    if not math.isclose(used, true_norm / 2, rel_tol=1e-3):
        out["problems"].append(f"the optimizer then uses gradients of norm {used:.6g}, expected max_norm "
                               f"{true_norm / 2:.6g}")
    return out


@register
class ScalerMonitor(Detector):
    id = "scaler_monitor"
    needs_config = ("train.precision", "train.init_scale", "train.device")
    needs_seams = (MAKE_SCALER, OPTIMIZER_STEP, CLIP)
    family = "precision"
    passive = True
    description = ("fp16: scaler enabled with scale > 1; optimizer_step updates the scaler; clip_gradients unscales "
                   "first; live growth tracker / scale advance; long runs of skipped steps")

    SKIP_STREAK = 3

    def __init__(self) -> None:
        super().__init__()
        self._active = False
        self._reported: set[str] = set()
        self._tracker: int | None = None
        self._scale: float | None = None
        self._streak = 0
        self._skips: list[int] = []

    def _state(self, ctx) -> tuple[int, float]:
        state = ctx.run.scaler.state_dict()
        return int(state.get("_growth_tracker", 0)), float(ctx.run.scaler.get_scale())

    def on_start(self, ctx) -> None:
        tcfg = ctx.config.train
        self._active = tcfg.precision == "fp16"
        if not self._active:
            return
        scaler = ctx.run.scaler
        with ctx.probe():
            if not scaler.is_enabled() or scaler.get_scale() <= 1.0:
                try:
                    fresh = ctx.seam(MAKE_SCALER)("fp16", probes.device_type(ctx), tcfg.init_scale)
                    fresh_ok, fresh_desc = fresh.is_enabled() and fresh.get_scale() > 1.0, (
                        f"enabled={fresh.is_enabled()}, scale={fresh.get_scale()}")
                except Exception as exc:
                    fresh_ok, fresh_desc = False, f"raises {type(exc).__name__}: {str(exc)[:100]}"
                evidence = {"run_scaler_enabled": scaler.is_enabled(), "run_scale": scaler.get_scale(),
                            "make_grad_scaler_fp16": fresh_desc, "init_scale": tcfg.init_scale}
                self._reported.add("disabled")
                if not fresh_ok:
                    self.report(ctx, "precision", MAKE_SCALER,
                                f"an fp16 run trains without loss scaling (scaler enabled={scaler.is_enabled()}, "
                                f"scale {scaler.get_scale()}): make_grad_scaler('fp16', ...) gives a scaler with "
                                f"{fresh_desc}; small gradients underflow to zero in fp16", evidence, confidence=0.9)
                else:
                    self.report(ctx, "precision", None,
                                f"an fp16 run trains without loss scaling (scaler enabled={scaler.is_enabled()}, scale "
                                f"{scaler.get_scale()}) although make_grad_scaler('fp16', ...) builds an enabled one",
                                evidence, confidence=0.6)
            with probes.quiet():
                update = scaled_optimizer_step_probe(ctx)
                clip = scaled_clip_probe(ctx)
            if update["problems"]:
                self._reported.add("update")
                self.report(ctx, "precision", OPTIMIZER_STEP,
                            "optimizer_step with an enabled throwaway GradScaler (scale 16): "
                            + "; ".join(update["problems"]), update, confidence=0.9)
            if clip["problems"]:
                self._reported.add("clip")
                self.report(ctx, "precision", CLIP,
                            "clip_gradients with an enabled GradScaler (scale 1024) on a throwaway module: "
                            + "; ".join(clip["problems"]), clip, confidence=0.9)
        self._tracker, self._scale = self._state(ctx)

    def on_after_step(self, ctx, record) -> None:
        if not self._active or not ctx.run.scaler.is_enabled():
            return
        tracker, scale = self._state(ctx)
        prev_tracker, prev_scale = self._tracker, self._scale
        self._tracker, self._scale = tracker, scale
        if record.skipped:
            self._streak += 1
            self._skips.append(record.step)
        else:
            self._streak = 0
        # an update moves the tracker (+1, or reset to 0 when the scale grows or backs off)
        if (prev_tracker is not None and tracker == prev_tracker and scale == prev_scale
                and not {"update", "frozen"} & self._reported):
            self._reported.add("frozen")
            self.report(ctx, "precision", OPTIMIZER_STEP,
                        f"step {record.step}: the GradScaler's growth tracker ({tracker}) and scale ({scale:g}) did "
                        "not move: scaler.update() is not called after scaler.step()",
                        {"growth_tracker": tracker, "scale": scale, "step": record.step}, confidence=0.8)
        if self._streak >= self.SKIP_STREAK and "skips" not in self._reported:
            self._reported.add("skips")
            self.report(ctx, "precision", None,
                        f"the GradScaler skipped {self._streak} steps in a row (inf/NaN gradients; scale now "
                        f"{scale:g}, logged scale {record.scale:g}): the gradients overflow fp16 step after step",
                        {"skipped_steps": self._skips[-10:], "scale": scale}, confidence=0.45)


@register
class NonfiniteOrigin(Detector):
    id = "nonfinite_origin"
    needs_config = ("train.precision",)
    needs_seams = (AUTOCAST,)
    family = "precision"
    passive = True
    description = ("when the loss turns non-finite: the module where non-finite values originate (finite inputs, "
                   "non-finite output), replayed in the run's precision and in fp32")

    def __init__(self) -> None:
        super().__init__()
        self._batch: dict | None = None
        self._initial = None
        self._done = False

    def on_start(self, ctx) -> None:
        try:  # the initial weights, to replay a batch when an update has already written inf/NaN
            self._initial = probes.private_copy(ctx.run.model)
        except Exception:
            self._initial = None

    def on_batch(self, ctx, micro_batches) -> None:
        if not self._done:
            self._batch = micro_batches[0]

    def on_after_step(self, ctx, record) -> None:
        if self._done or math.isfinite(float(record.loss)) or self._batch is None:
            return
        self._done = True
        precision = ctx.config.train.precision
        params_finite = all(bool(torch.isfinite(p).all()) for p in ctx.run.model.parameters())
        model, weights = (ctx.run.model, "current") if params_finite else (self._initial, "initial")
        evidence = {"step": record.step, "loss": str(record.loss), "precision": precision,
                    "params_finite_after_step": params_finite, "replayed_with": weights}
        if model is None:
            return
        origin = {prec: self._origin(ctx, model, self._batch, prec) for prec in dict.fromkeys((precision, "fp32"))}
        evidence["origin"] = origin
        low, high = origin.get(precision), origin.get("fp32")
        if low is None and high is None:
            if weights == "initial":
                self.report(ctx, "optimizer", None,
                            f"the loss of step {record.step} is non-finite, the parameters are inf/NaN after it, and "
                            "the same batch is finite with the initial weights: the updates diverged", evidence,
                            confidence=0.3)
            return
        if precision != "fp32" and low is not None and high is None:
            self.report(ctx, "precision", None,
                        f"the loss of step {record.step} is non-finite in {precision} but the same batch is finite in "
                        f"fp32 ({weights} weights); non-finite values originate in {low['module']} ({low['type']})",
                        evidence, confidence=0.5)
        elif high is not None:
            self.report(ctx, "model", None,
                        f"the loss of step {record.step} is non-finite; replayed with the {weights} weights, "
                        f"non-finite values originate in {high['module']} ({high['type']}), in fp32 too", evidence,
                        confidence=0.3)

    @staticmethod
    def _origin(ctx, model, batch, precision) -> dict | None:
        """The first module (in completion order) whose output is non-finite while its inputs are finite."""
        found: list[dict] = []

        def hook(name):
            def fn(module, args, output):
                if isinstance(output, torch.Tensor) and output.is_floating_point() and len(found) < 50 \
                        and not bool(torch.isfinite(output).all()):
                    inputs_finite = all(bool(torch.isfinite(a).all()) for a in args
                                        if isinstance(a, torch.Tensor) and a.is_floating_point())
                    found.append({"module": name or "<model>", "type": type(module).__name__,
                                  "inputs_finite": inputs_finite})
            return fn

        handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
        was_training = model.training
        try:
            with ctx.probe(), ctx.seam(AUTOCAST)(precision, batch["input_ids"].device.type):
                model.eval()
                model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        except Exception as exc:
            return {"module": "raised", "type": type(exc).__name__, "inputs_finite": None}
        finally:
            model.train(was_training)
            for h in handles:
                h.remove()
        origins = [f for f in found if f["inputs_finite"]]
        return (origins or found or [None])[0]


@register
class Fp16AttentionStress(Detector):
    id = "fp16_attention_stress"
    needs_config = ("train.precision", "train.device", "model.n_embd", "model.n_head")
    needs_seams = (ATTEND, AUTOCAST)
    family = "precision"
    passive = False
    description = ("attend() with large attention scores in the compute dtype vs an fp32 softmax reference; a model "
                   "copy with large query/key weights stays finite under autocast")

    TARGET = 40.0  # the largest attention-score bound in the model stress (fp16's exp overflows past ~11)

    def on_start(self, ctx) -> None:
        precision = ctx.config.train.precision
        if precision not in _DTYPES:
            return
        dtype = _DTYPES[precision]
        with ctx.probe():
            low = self._attend_error(ctx, dtype)
            if low is not None:
                high = self._attend_error(ctx, torch.float32)
                if high is None:
                    self.report(ctx, "precision", ATTEND,
                                f"attend() in {precision} with attention scores up to {low['max_score']:.3g} "
                                f"{low['what']}, while in fp32 it matches softmax(q k^T / sqrt(d) + mask) v: the "
                                "attention math is not safe in reduced precision (e.g. exp without subtracting the row "
                                "max)", low, confidence=0.9)
                return  # fp32 fails too: an attention bug, not a precision one (the model detectors' business)
            model_problem = self._model_stress(ctx, precision)
            if model_problem is not None:
                self.report(ctx, "precision", None,
                            "a copy of the model with large query/key weights gives non-finite logits under "
                            f"{precision} autocast but finite ones in fp32", model_problem, confidence=0.5)

    @staticmethod
    def _attend_error(ctx, dtype) -> dict | None:
        attend = ctx.seam(ATTEND)
        device = ctx.config.train.device
        gen = torch.Generator().manual_seed(11)
        B, H, T, D = 2, 2, 12, 16
        q = torch.randn(B, H, T, D, generator=gen)
        k = torch.randn(B, H, T, D, generator=gen)
        v = torch.randn(B, H, T, D, generator=gen)
        # scale so that the largest |q.k| / sqrt(D) is ~25: exp(25) overflows fp16 (max ~65504 = e^11.1)
        raw = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        q = q * (25.0 / float(raw.abs().max()))
        # an additive mask: row 1 left-padded by 3 (each query still sees itself), built in the compute dtype
        allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T).clone()
        allowed[1, :, :, :3] = False
        allowed |= torch.eye(T, dtype=torch.bool)
        worst: dict | None = None
        for name, mask_bool in (("causal (mask None)", None), ("additive padding mask", allowed)):
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
            scores = scores.masked_fill(~(mask_bool if mask_bool is not None else
                                          torch.ones(T, T, dtype=torch.bool).tril()), float("-inf"))
            ref = torch.softmax(scores.double(), -1).float() @ v
            add = None
            if mask_bool is not None:
                add = torch.zeros(B, 1, T, T, dtype=dtype).masked_fill(~mask_bool, torch.finfo(dtype).min).to(device)
            try:
                with probes.quiet():
                    out = attend(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), add, 0.0)
            except Exception as exc:
                return {"what": f"raises {type(exc).__name__}: {str(exc)[:120]}", "case": name, "max_score": 25.0}
            out = out.float().cpu()
            finite = bool(torch.isfinite(out).all())
            err = float((out - ref).abs().max()) if finite else math.inf
            tol = 0.05 if dtype != torch.float32 else 1e-3
            if not finite or err > tol:
                what = (f"gives {int((~torch.isfinite(out)).sum())} non-finite outputs" if not finite
                        else f"is off by {err:.3g} (tolerance {tol})")
                worst = {"what": what, "case": name, "max_score": 25.0, "max_abs_error": str(err),
                         "dtype": str(dtype)}
                break
        return worst

    @staticmethod
    def _model_stress(ctx, precision) -> dict | None:
        """A copy of the model whose query/key weights are scaled so that the largest attention score bound
        |q| |k| / sqrt(d) reaches ~TARGET; its logits must be finite under the run's autocast when they are in fp32."""
        try:
            model = probes.private_copy(ctx.run.model)
            batch = probes.probe_batch(ctx)
        except Exception:
            return None
        C, heads = ctx.config.model.n_embd, ctx.config.model.n_head
        qkv = [m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.endswith("attn.qkv") and m.weight.shape[0] == 3 * C]
        if not qkv:
            return None
        seen: dict[int, float] = {}

        def measure(module, args, output):  # bound on |score| per layer: max |q_h| * max |k_h| / sqrt(hs)
            q, k = output.float()[..., :C], output.float()[..., C : 2 * C]
            hs = C // heads
            qn = q.reshape(*q.shape[:-1], heads, hs).norm(dim=-1).max()
            kn = k.reshape(*k.shape[:-1], heads, hs).norm(dim=-1).max()
            seen[id(module)] = float(qn * kn) / math.sqrt(hs)

        handles = [m.register_forward_hook(measure) for m in qkv]
        try:
            model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        finally:
            for h in handles:
                h.remove()
        for m in qkv:  # bound x f^2 = TARGET; the realized maximum score is a good share of the bound
            factor = math.sqrt(Fp16AttentionStress.TARGET / max(seen.get(id(m), 1.0), 1e-6))
            m.weight.data[: 2 * C] *= factor
            if m.bias is not None:
                m.bias.data[: 2 * C] *= factor
        autocast = ctx.seam(AUTOCAST)
        device_type = batch["input_ids"].device.type
        out = {}
        for prec in (precision, "fp32"):
            try:
                with autocast(prec, device_type):
                    logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            except Exception as exc:
                out[prec] = f"raises {type(exc).__name__}"
                continue
            out[prec] = int((~torch.isfinite(logits.float())).sum())
        if out.get(precision) and out.get("fp32") == 0:
            return {"nonfinite_logits": out, "score_bound": Fp16AttentionStress.TARGET}
        return None
