"""Optimizer detectors: AdamW's parameter groups, the learning-rate schedule, and gradient hygiene.

- ``optimizer_config`` (on_start, on_checkpoint_load): every trainable parameter in exactly one param
  group; lr / betas / eps as configured; the configured weight decay on >= 2-D weights, none on 1-D ones
  (biases, norm gains); embeddings either (stacks differ: the reference spares them, Trainer decays them).
  Where the run offers its decay rule as a role (``decay_names``), a wrong decay is traced to it.
- ``lr_schedule`` (on_start probes, on_before_step / on_after_step checks): the learning rate of step s
  must be the configured linear warmup + cosine decay (computed here from the config's documented
  semantics, cross-checked with the golden runs). Localized by differential probes: the run's
  ``model.optim.lr_at`` against the formula, a fresh scheduler from ``model.optim.make_scheduler`` on a
  throwaway optimizer, and how far the live scheduler has advanced when the optimizer steps (the
  training step advances it; ``model.train.optimizer_step`` should do so exactly once per step).
- ``grad_hygiene`` (on_start probes; sampled on_before_step / on_after_step): ``optimizer_step`` on a
  throwaway parameter uses the gradients, clears them, advances the schedule once; ``clip_gradients``
  returns the pre-clip norm and clips; in the live run the optimizer sees gradients, they are cleared
  after the step, every parameter with a gradient changes, and the norm of the gradients the optimizer
  uses equals min(logged pre-clip norm, grad_clip).
- ``train_step_contract`` (on_start, single process): the run's ``model.train.train_step`` on a throwaway
  copy of the model, SGD, LambdaLR and GradScaler (scale 256 for fp16), judged by the run's own
  ``forward_loss``: it logs the window's loss and its true pre-clip norm, the optimizer receives the
  clipped gradients, the schedule advances as ``optimizer_step`` advances it, gradients are cleared.
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, NotApplicable, register

OPTIMIZER_STEP = "model.train.optimizer_step"
CLIP = "model.train.clip_gradients"
TRAIN_STEP = "model.train.train_step"
COUNT_TARGETS = "model.loss.count_targets"
FORWARD_LOSS = "model.train.forward_loss"


# ---------------------------------------------------------------------------------------------- helpers
def expected_lr(step: int, tcfg) -> float:
    """Linear warmup over ``warmup_steps`` (step s, 0-based, uses lr * (s + 1) / warmup_steps), then a
    half-cosine from ``lr`` to ``min_lr`` over the remaining ``steps - warmup_steps`` steps (min_lr after)."""
    if step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    span = max(tcfg.steps - tcfg.warmup_steps, 1)
    t = min((step - tcfg.warmup_steps) / span, 1.0)
    return tcfg.min_lr + (tcfg.lr - tcfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return probes.close(a, b, rel, 1e-12)


def probe_optimizer_step(ctx, enabled_scaler: bool = False) -> dict:
    """The run's optimizer_step on a throwaway parameter, SGD, LambdaLR and GradScaler: what it did.

    Returns {"used_grads", "cleared", "sched_advance", "returned", "error", ...}; with ``enabled_scaler``
    also whether the scaler was updated ("tracker" after one step) and a skipped step on inf gradients."""
    with probes.quiet():
        return _probe_optimizer_step(ctx, enabled_scaler)


def _probe_optimizer_step(ctx, enabled_scaler: bool) -> dict:
    fn = ctx.role("optimizer_step")
    device = probes.device(ctx)
    out: dict = {"error": None}
    p = torch.nn.Parameter(torch.ones(4, device=device))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scale = 16.0 if enabled_scaler else 1.0
    scaler = torch.amp.GradScaler(probes.device_type(ctx), init_scale=scale, enabled=enabled_scaler)
    scaler.scale(torch.ones((), device=device))  # a real step scales its loss first (the scaler's lazy init)
    p.grad = torch.full_like(p, 0.5 * scale)
    before = p.detach().clone()
    try:
        out["returned"] = bool(fn(opt, scaler, sched))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return out
    out["used_grads"] = not torch.equal(p.detach(), before)
    out["step_size"] = float((before - p.detach()).abs().max())
    out["cleared"] = p.grad is None or not bool(p.grad.any())
    out["sched_advance"] = int(sched.last_epoch)
    if not enabled_scaler:
        return out
    out["tracker"] = int(scaler.state_dict()["_growth_tracker"])
    scaler.scale(torch.ones((), device=device))
    p.grad = torch.full_like(p, 0.5 * scale)
    try:
        fn(opt, scaler, sched)
        out["second_step_error"] = None
    except Exception as exc:
        out["second_step_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return out
    scaler.scale(torch.ones((), device=device))
    p.grad = torch.full_like(p, math.inf)
    before, scale_before = p.detach().clone(), scaler.get_scale()
    try:
        out["inf_returned"] = bool(fn(opt, scaler, sched))
        out["inf_param_unchanged"] = torch.equal(p.detach(), before)
        out["inf_scale_after"] = [scale_before, scaler.get_scale()]
    except Exception as exc:
        out["inf_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return out


def scheduler_lrs(make_scheduler, lr: float, horizon: int) -> list[float]:
    """The lr of each of ``horizon`` steps from a fresh scheduler (``make_scheduler(optimizer)``) on a throwaway
    optimizer of base ``lr``, stepped once per optimizer step."""
    with probes.quiet():
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=lr)
        sched = make_scheduler(opt)
        got = []
        for _ in range(horizon):
            got.append(float(opt.param_groups[0]["lr"]))
            opt.step()
            sched.step()
    return got


def optimizer_step_problems(result: dict, enabled_scaler: bool = False) -> list[str]:
    problems = []
    if result.get("error"):
        return [f"optimizer_step raises on a throwaway optimizer ({result['error']})"]
    if not result["used_grads"]:
        problems.append("the optimizer step did not use the gradients (parameter unchanged: they were cleared "
                        "before optimizer.step)")
    if not result["cleared"]:
        problems.append("the gradients are not cleared after the step (the next backward adds to them)")
    if result["sched_advance"] != 1:
        problems.append(f"the schedule advanced {result['sched_advance']} times in one optimizer step (expected 1)")
    if result["returned"]:
        problems.append("it reports a skipped step on finite gradients")
    if enabled_scaler:
        if result.get("tracker") != 1 or result.get("second_step_error"):
            problems.append("the GradScaler is never updated after scaler.step (growth tracker "
                            f"{result.get('tracker')} after one finite step"
                            + (f"; the next step raises {result['second_step_error']}" if result.get(
                                "second_step_error") else "") + ")")
        elif result.get("inf_error"):
            problems.append(f"a step with inf gradients raises ({result['inf_error']})")
        elif "inf_returned" in result and not (result["inf_returned"] and result["inf_param_unchanged"]
                                               and result["inf_scale_after"][1] < result["inf_scale_after"][0]):
            problems.append("a step with inf gradients is not skipped with a smaller scale "
                            f"(returned {result['inf_returned']}, parameter unchanged {result['inf_param_unchanged']}, "
                            f"scale {result['inf_scale_after']})")
    return problems


def probe_clip(ctx, enabled_scaler: bool = False) -> dict:
    """The run's clip_gradients on a throwaway module with known gradients (norm G), max_norm = G / 2.

    Contract: returns G (the true, unscaled pre-clip norm) and leaves (unscaled) gradients of norm G / 2."""
    probe = probes.clip_probe(ctx, enabled_scaler)
    if probe["error"] is not None:
        exc = probe["error"]
        return {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    after = probes.l2_norm(p.grad for p in probe["module"].parameters() if p.grad is not None)
    return {"error": None, "true_norm": probe["true_norm"], "returned": probe["returned"], "norm_after": after,
            "scale": probe["scale"], "max_norm": probe["max_norm"]}


def clip_problems(result: dict) -> list[str]:
    if result.get("error"):
        return [f"clip_gradients raises on a throwaway module ({result['error']})"]
    problems = []
    if not _close(result["returned"], result["true_norm"], 1e-4):
        ratio = result["returned"] / result["true_norm"] if result["true_norm"] else math.nan
        hint = (" (the loss scale: the gradients were not unscaled first)"
                if result["scale"] > 1 and _close(ratio, result["scale"], 1e-3) else "")
        problems.append(f"returns norm {result['returned']:.6g}, the true pre-clip norm is {result['true_norm']:.6g} "
                        f"(x{ratio:.4g}{hint})")
    # the contract leaves unscaled gradients (unscale_ in place) clipped to max_norm
    if not problems and not _close(result["norm_after"], result["max_norm"], 1e-3):
        problems.append(f"after clipping to {result['max_norm']:.4g} the gradients have norm "
                        f"{result['norm_after']:.6g}")
    return problems


# -------------------------------------------------------------------------------------------- detectors
@register
class OptimizerConfig(Detector):
    id = "optimizer_config"
    needs_facts = ("lr", "betas", "eps", "weight_decay")
    needs_roles = ("optimizer_groups",)
    family = "optimizer"
    passive = False
    description = ("param groups vs the config: every trainable parameter in exactly one group, lr/betas/eps, decay "
                   "rule; under mixed precision the optimizer steps fp32 (master) weights")

    def problems(self, ctx) -> tuple[list[str], dict]:
        model, opt = ctx.run.model, ctx.run.optimizer
        lr, betas, eps, weight_decay = (ctx.fact(f) for f in ("lr", "betas", "eps", "weight_decay"))
        self._decay_problems = []
        names = {id(p): n for n, p in model.named_parameters()}
        trainable = {id(p): p for p in model.parameters() if p.requires_grad}
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        membership: dict[int, int] = {}
        problems: list[str] = []
        evidence: dict = {"groups": []}
        for gi, group in enumerate(opt.param_groups):
            evidence["groups"].append({k: v for k, v in group.items() if k in ("lr", "initial_lr", "betas", "eps",
                                                                               "weight_decay")}
                                      | {"params": len(group["params"])})
            for p in group["params"]:
                membership[id(p)] = membership.get(id(p), 0) + 1
                if id(p) not in trainable:
                    problems.append(f"group {gi} holds a tensor that is not a trainable parameter of the model "
                                    f"({names.get(id(p), tuple(p.shape))})")
                    continue
                wd = float(group.get("weight_decay", 0.0))
                if id(p) in embeddings and (wd == 0.0 or _close(wd, weight_decay)):
                    continue  # decayed or not: either is a stack's documented choice
                if p.dim() >= 2 and not _close(wd, weight_decay):
                    self._decay_problems.append(f"{names[id(p)]} ({p.dim()}-D weight) has weight_decay {wd}, "
                                                f"expected {weight_decay}")
                elif p.dim() < 2 and wd != 0.0:
                    self._decay_problems.append(f"{names[id(p)]} ({p.dim()}-D) has weight_decay {wd}, expected 0")
            group_betas = group.get("betas")
            if group_betas is not None and tuple(float(b) for b in group_betas) != tuple(float(b) for b in betas):
                problems.append(f"group {gi} has betas {tuple(group_betas)}, the config says {tuple(betas)}")
            if "eps" in group and not _close(float(group["eps"]), eps):
                problems.append(f"group {gi} has eps {group['eps']}, the config says {eps}")
            base = group.get("initial_lr", None)
            if base is not None and not _close(float(base), lr):
                problems.append(f"group {gi} has base lr {base}, the config says {lr}")
        problems += self._decay_problems
        missing = [names.get(i, "?") for i in trainable if membership.get(i, 0) == 0]
        twice = [names.get(i, "?") for i, c in membership.items() if c > 1]
        if missing:
            problems.insert(0, f"{len(missing)} of {len(trainable)} trainable parameters are in no param group, so "
                               f"never updated: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
        if twice:
            problems.insert(0, f"parameters in more than one group: {', '.join(twice[:6])}")
        evidence.update(missing=missing, duplicated=twice)
        return problems, evidence

    def _decay_rule_problem(self, ctx) -> str | None:
        """Where the decay is wrong and the run offers its decay rule: the 1-D parameters the rule decays."""
        if not self._decay_problems or "decay_names" not in ctx.roles:
            return None
        try:
            decayed = set(ctx.role("decay_names")(ctx.run.model))
        except Exception as exc:  # noqa: BLE001 - raising breaks the rule's contract too
            return f"the decay rule raises {type(exc).__name__}"
        wrong = [n for n, p in ctx.run.model.named_parameters() if p.dim() < 2 and n in decayed]
        return f"the decay rule names {len(wrong)} 1-D parameters ({', '.join(wrong[:3])})" if wrong else None

    def _master_weights(self, ctx) -> None:
        """Mixed precision (bf16/fp16 autocast) keeps the weights the optimizer steps in fp32: an update smaller than
        a low-precision weight's spacing would be lost."""
        try:
            precision = ctx.fact("precision")
        except NotApplicable:
            return
        if precision == "fp32":
            return
        low = [n for g in ctx.run.optimizer.param_groups for n, p in self._named(ctx, g["params"])
               if p.is_floating_point() and torch.finfo(p.dtype).bits < 32]
        if low:
            self.report(ctx, "precision", ctx.role_seam("place_model") or ctx.role_seam("optimizer_groups"),
                        f"the run trains in {precision} mixed precision, but the optimizer steps "
                        f"{len(low)} parameters held in low precision ({', '.join(low[:3])}): no fp32 master weights, "
                        "so updates below a weight's spacing are lost", {"low_precision_params": low[:8]},
                        confidence=0.85)

    @staticmethod
    def _named(ctx, params):
        names = {id(p): n for n, p in ctx.run.model.named_parameters()}
        return [(names.get(id(p), str(tuple(p.shape))), p) for p in params]

    def on_start(self, ctx) -> None:
        self._master_weights(ctx)
        problems, evidence = self.problems(ctx)
        self._at_start = bool(problems)
        if problems:
            rule = self._decay_rule_problem(ctx)
            self.report(ctx, "optimizer", ctx.role_seam("decay_names" if rule else "optimizer_groups"),
                        "the optimizer's param groups break the configuration: " + "; ".join(dict.fromkeys(problems))
                        + (f"; {rule}" if rule else ""), evidence, confidence=0.9)

    def on_checkpoint_load(self, ctx, path) -> None:
        if getattr(self, "_at_start", False):
            return
        problems, evidence = self.problems(ctx)
        if problems:
            self.report(ctx, "checkpoint", ctx.role_seam("restore_optimizer"), "after resuming, the optimizer's param "
                        "groups break the "
                        "configuration: " + "; ".join(dict.fromkeys(problems)), evidence, confidence=0.7)


@register
class LrSchedule(Detector):
    id = "lr_schedule"
    needs_facts = ("lr", "steps")
    needs_roles = ("train_step",)
    family = "optimizer"
    passive = True
    description = ("the lr of every step vs the schedule the configuration declares; lr_at / make_scheduler / the step "
                   "localized")

    def __init__(self) -> None:
        super().__init__()
        self._explained = False  # a finding already names the cause: do not report the live symptom again
        self._opt_step_advance: int | None = None
        self._table: list[float] = []

    def expected(self, ctx, step: int) -> float:
        if step < len(self._table):
            return self._table[step]
        return self._declared(ctx)(step)

    def _declared(self, ctx):
        """step -> the declared LR: the run's own statement of its schedule, or the reference's warmup + cosine."""
        try:
            return ctx.fact("lr_schedule")
        except NotApplicable:
            self.require(ctx, config=("train.lr", "train.warmup_steps", "train.steps", "train.min_lr"))
            return lambda step: expected_lr(step, ctx.config.train)

    def on_start(self, ctx) -> None:
        lr, horizon = ctx.fact("lr"), ctx.fact("steps") + 2
        declared = self._declared(ctx)
        self._table = [declared(s) for s in range(horizon)]
        golden = (ctx.golden or {}).get("runs") or []
        for trace in golden[:1]:  # the clean reference's logged lr: trust it where it disagrees with the formula
            lrs = trace.get("lr") or []
            if lrs and not all(_close(a, b) for a, b in zip(lrs, self._table, strict=False)):
                self._table[: len(lrs)] = [float(x) for x in lrs]
        # 1) lr_at against the declared schedule
        try:
            run_lr = [float(ctx.role("lr_at")(s)) for s in range(horizon)] if "lr_at" in ctx.roles else None
        except Exception as exc:
            run_lr = None
            self._explained = True
            self.report(ctx, "optimizer", ctx.role_seam("lr_at"),
                        f"lr_at raises ({type(exc).__name__}: {str(exc)[:120]})",
                        confidence=0.9)
        if run_lr is not None:
            bad = [s for s in range(horizon) if not _close(run_lr[s], self.expected(ctx, s))]
            if bad:
                self._explained = True
                self.report(ctx, "optimizer", ctx.role_seam("lr_at"),
                            f"lr_at disagrees with the schedule the config declares at {len(bad)} of {horizon} steps "
                            f"(step {bad[0]}: {run_lr[bad[0]]:.4g}, expected {self.expected(ctx, bad[0]):.4g})",
                            {"steps": bad[:10], "lr_at": [run_lr[s] for s in bad[:10]],
                             "expected": [self.expected(ctx, s) for s in bad[:10]],
                             "peak_lr_at": max(run_lr), "config_lr": lr}, confidence=0.9)
        # 2) a fresh scheduler from make_scheduler, stepped once per step, must follow lr_at
        reference = run_lr if run_lr is not None else self._table
        try:
            got = scheduler_lrs(ctx.role("make_scheduler"), lr, horizon) if "make_scheduler" in ctx.roles else None
        except Exception as exc:
            got = None
            self._explained = True
            self.report(ctx, "optimizer", ctx.role_seam("make_scheduler"),
                        f"make_scheduler's scheduler raises ({type(exc).__name__}: "
                        f"{str(exc)[:120]})", confidence=0.9)
        if got is not None:
            bad = [s for s in range(horizon) if not _close(got[s], reference[s])]
            if bad:
                self._explained = True
                ratio = got[bad[0]] / reference[bad[0]] if reference[bad[0]] else math.nan
                self.report(ctx, "optimizer", ctx.role_seam("make_scheduler"),
                            f"a fresh scheduler from make_scheduler on an optimizer with lr={lr:g}, stepped "
                            f"once per step, gives lr {got[bad[0]]:.4g} at step {bad[0]} where lr_at says "
                            f"{reference[bad[0]]:.4g} (x{ratio:.3g}); {len(bad)} of {horizon} steps disagree",
                            {"steps": bad[:10], "scheduler_lr": [got[s] for s in bad[:10]],
                             "lr_at": [reference[s] for s in bad[:10]]}, confidence=0.9)
        # 3) how many times optimizer_step advances a scheduler (used to localize live mismatches)
        if "optimizer_step" in ctx.roles:
            result = probe_optimizer_step(ctx)
            self._opt_step_advance = None if result.get("error") else result["sched_advance"]

    def _live_mismatch(self, ctx, step: int, lr: float, when: str) -> None:
        sched = ctx.run.scheduler
        last = int(getattr(sched, "last_epoch", -1))
        want = self.expected(ctx, step)
        evidence = {"step": step, "lr": lr, "expected": want, "scheduler_last_epoch": last, "when": when,
                    "optimizer_step_advances_schedule": self._opt_step_advance, "accum": ctx.fact("accum")}
        ahead = [s for s in range(len(self._table)) if _close(self._table[s], lr)]
        if ahead:
            evidence["lr_matches_schedule_step"] = ahead[0]
        self._explained = True
        checked = [r for r in ("lr_at", "make_scheduler") if r in ctx.roles]
        correct = f"{' and '.join(checked)} {'are' if len(checked) > 1 else 'is'} correct, so " if checked else ""
        if when == "before_step" and last > step:
            self.report(ctx, "optimizer", ctx.role_seam("train_step"),
                        f"when optimizer step {step} runs, the schedule has already advanced {last} times "
                        f"(lr {lr:.4g}, expected {want:.4g}); {correct}the training step advances the scheduler "
                        f"{last - step} extra times before the optimizer step", evidence, confidence=0.8)
        elif self._opt_step_advance is not None and self._opt_step_advance != 1 and last != step:
            self.report(ctx, "optimizer", ctx.role_seam("optimizer_step"),
                        f"step {step} uses lr {lr:.4g}, expected {want:.4g}; optimizer_step advances a scheduler "
                        f"{self._opt_step_advance} times per call (expected once)", evidence, confidence=0.8)
        else:
            self.report(ctx, "optimizer", ctx.role_seam("train_step"),
                        f"step {step} uses lr {lr:.4g}, expected {want:.4g} (scheduler at {last}); {correct}the "
                        "training step drives the schedule wrongly", evidence, confidence=0.7)

    def on_before_step(self, ctx) -> None:
        if self._explained:
            return
        lr = float(ctx.run.optimizer.param_groups[0]["lr"])
        if not _close(lr, self.expected(ctx, ctx.step)):
            self._live_mismatch(ctx, ctx.step, lr, "before_step")

    def on_after_step(self, ctx, record) -> None:
        if self._explained:
            return
        if not _close(float(record.lr), self.expected(ctx, record.step)):
            self._live_mismatch(ctx, record.step, float(record.lr), "after_step")
            return
        last = int(getattr(ctx.run.scheduler, "last_epoch", ctx.step))
        if last != ctx.step:  # the schedule did not advance exactly once per optimizer step
            self._live_mismatch(ctx, ctx.step, float(ctx.run.optimizer.param_groups[0]["lr"]), "after_step")

    def on_checkpoint_load(self, ctx, path) -> None:
        if self._explained:
            return
        last = int(getattr(ctx.run.scheduler, "last_epoch", ctx.step))
        lr = float(ctx.run.optimizer.param_groups[0]["lr"])
        if last != ctx.step or not _close(lr, self.expected(ctx, ctx.step)):
            self._explained = True
            self.report(ctx, "checkpoint", ctx.role_seam("restore_optimizer"),
                        f"after resuming at step {ctx.step} the scheduler is at {last} and the lr is {lr:.4g} "
                        f"(expected {self.expected(ctx, ctx.step):.4g}): the schedule's position was not restored "
                        "with the step", {"step": ctx.step, "scheduler_last_epoch": last, "lr": lr}, confidence=0.7)


@register
class GradHygiene(Detector):
    id = "grad_hygiene"
    needs_facts = ("grad_clip", "device")
    needs_roles = ("train_step",)
    family = "optimizer"
    passive = True
    description = ("optimizer_step/clip_gradients contracts on throwaway objects; live: grads present at the optimizer "
                   "step, cleared after, every parameter with a grad changes, post-clip norm == min(logged, clip)")

    def __init__(self) -> None:
        super().__init__()
        self._reported: set[str] = set()
        self._probe_step: dict = {}
        self._clip_ok = True
        self._step_ok = True
        self._pre: dict | None = None
        self._snapshot_next = False
        self._params: tuple | None = None  # (run, its trainable parameters)
        self._probed = False

    def on_start(self, ctx) -> None:
        self._probed = {"optimizer_step", "clip_gradients"} <= ctx.roles.keys()
        if self._probed:  # where the run offers them: on a live finding, they are known to keep their contracts
            with ctx.probe():  # the throwaway module's init draws from the global RNG: restore it
                self._probes(ctx)

    def _probes(self, ctx) -> None:
        self._probe_step = probe_optimizer_step(ctx)
        problems = optimizer_step_problems(self._probe_step)
        self._step_ok = not problems
        if problems:
            self._reported.add("optimizer_step")
            self.report(ctx, "optimizer", ctx.role_seam("optimizer_step"),
                        "optimizer_step on a throwaway parameter (grad 0.5, SGD lr 0.1): " + "; ".join(problems),
                        self._probe_step, confidence=0.9)
        clip = probe_clip(ctx)
        problems = clip_problems(clip)
        if ctx.run.scaler.is_enabled():  # the fp16 variant: an enabled scaler (reported by scaler_monitor)
            self._clip_ok = not problems and not clip_problems(probe_clip(ctx, enabled_scaler=True))
        else:
            self._clip_ok = not problems
        if problems:
            self._reported.add("clip")
            self.report(ctx, "optimizer", ctx.role_seam("clip_gradients"),
                        "clip_gradients on a throwaway module: " + "; ".join(problems), clip,
                        confidence=0.9)

    def on_before_step(self, ctx) -> None:
        if not probes.sampled(ctx.step, first=2, every=16) or len(self._reported) >= 3:
            self._pre = None
            return
        if self._params is None or self._params[0] is not ctx.run:
            self._params = (ctx.run, [p for p in ctx.run.model.parameters() if p.requires_grad])
        params = self._params[1]
        with_grad = [p for p in params if p.grad is not None]
        pre = {"step": ctx.step, "n_params": len(params), "n_with_grad": len(with_grad), "norm": 0.0, "snap": []}
        if with_grad:
            norms = torch.stack(torch._foreach_norm([p.grad for p in with_grad]))
            pre["norm"] = float(torch.linalg.vector_norm(norms))
            if ctx.step == 0 or self._snapshot_next:  # one snapshot per run (and after a resume)
                self._snapshot_next = False
                nonzero = (norms > 0).tolist()
                pre["snap"] = [(p, p.detach().clone()) for p, nz in zip(with_grad, nonzero, strict=True) if nz]
        self._pre = pre

    def on_checkpoint_load(self, ctx, path) -> None:
        self._snapshot_next = True

    def on_after_step(self, ctx, record) -> None:
        pre, self._pre = self._pre, None
        if not probes.sampled(record.step, first=2, every=16):
            return
        if pre is not None and pre["step"] == record.step and not record.skipped:
            self._check_step(ctx, record, pre)
        if self._step_ok and "not_cleared" not in self._reported:
            # zero_grad clears what the optimizer holds (parameters outside it are optimizer_config's business)
            held = [p for g in ctx.run.optimizer.param_groups for p in g["params"]]
            left = [p.grad for p in held if p.grad is not None]
            if left and float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(left)))) > 0:
                self._reported.add("not_cleared")
                self.report(ctx, "optimizer", ctx.role_seam("train_step"),
                            f"after step {record.step} {len(left)} parameters still hold non-zero gradients (the "
                            "next backward adds to them)" + self._probe_says("optimizer_step clears them"),
                            {"params_with_grad": len(left)}, confidence=0.7)

    def _probe_says(self, what: str) -> str:
        return f"; {what} in a probe" if self._probed else ""

    def _check_step(self, ctx, record, pre) -> None:
        world = ctx.run.world_size
        if pre["n_with_grad"] == 0:
            if self._step_ok and "no_grads" not in self._reported:
                self._reported.add("no_grads")
                self.report(ctx, "optimizer", ctx.role_seam("train_step"),
                            f"optimizer.step() of step {record.step} ran with no gradients at all (logged pre-clip "
                            f"norm {record.grad_norm:.4g})" + self._probe_says("optimizer_step keeps them")
                            + ": the training step clears them before the update",
                            {"logged_grad_norm": record.grad_norm},
                            confidence=0.7)
            return
        # every parameter that had a non-zero gradient must move
        unchanged = [p for p, old in pre["snap"] if torch.equal(p.detach(), old)]
        if unchanged and float(record.lr) > 0 and "unchanged" not in self._reported:  # lr 0 moves nothing
            self._reported.add("unchanged")
            names = {id(p): n for n, p in ctx.run.model.named_parameters()}
            in_opt = {id(p) for g in ctx.run.optimizer.param_groups for p in g["params"]}
            outside = [names.get(id(p), "?") for p in unchanged if id(p) not in in_opt]
            inside = [names.get(id(p), "?") for p in unchanged if id(p) in in_opt]
            evidence = {"unchanged_outside_optimizer": outside, "unchanged_in_optimizer": inside,
                        "lr": record.lr, "step": record.step}
            if outside:
                self.report(ctx, "optimizer", ctx.role_seam("optimizer_groups"),
                            f"{len(outside)} parameters with non-zero gradients did not change in step {record.step}: "
                            f"they are in no param group ({', '.join(outside[:5])})", evidence, confidence=0.8)
            else:
                self.report(ctx, "optimizer", None,
                            f"{len(inside)} parameters with non-zero gradients did not change in step {record.step} "
                            f"({', '.join(inside[:5])})", evidence, confidence=0.5)
        # the gradients the optimizer used vs the logged pre-clip norm and the clip threshold
        clip = ctx.fact("grad_clip")
        logged = float(record.grad_norm)
        if not math.isfinite(logged) or "norm" in self._reported or not (self._clip_ok and self._step_ok):
            return  # a broken clip_gradients / optimizer_step explains it (reported at start)
        want = min(logged, clip) if clip > 0 else logged
        got = pre["norm"]
        if abs(got - want) > 1e-3 * max(got, want) + 1e-6:
            self._reported.add("norm")
            evidence = {"logged_pre_clip_norm": logged, "grad_clip": clip, "expected_post_clip_norm": want,
                        "norm_seen_by_optimizer": got, "step": record.step, "world_size": world}
            self.report(ctx, "optimizer", ctx.role_seam("train_step"),
                        f"step {record.step}: the optimizer used gradients of norm {got:.4g}, but the logged "
                        f"pre-clip norm {logged:.4g} and grad_clip {clip:g} imply {want:.4g}"
                        + self._probe_says("clip_gradients honours its contract") + ": the step clips (or measures) "
                        "gradients other than the ones the optimizer then uses (clipping at the wrong point)",
                        evidence, confidence=0.75 if world == 1 else 0.55)


def probe_train_step(ctx) -> dict | None:
    """The run's train_step on a throwaway copy of the model with a throwaway SGD, LambdaLR (factor 1) and
    GradScaler (enabled, scale 256, for fp16 runs), on an accumulation window collated by the run.

    The reference is the run's own ``forward_loss`` summed over the window with the window's target count
    (``count_targets``): the step must backpropagate exactly that, log its value, its true pre-clip gradient
    norm, hand the optimizer the clipped gradients, advance the schedule as optimizer_step does, and clear
    the gradients. None when the probe cannot run (a distributed run: train_step would communicate)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    import types

    run, tcfg = ctx.run, ctx.config.train
    accum = max(int(tcfg.accum), 1)
    try:
        docs = probes.sample_docs(ctx, 2 * accum)
        micro = [probes.collate(ctx, docs[i::accum]) for i in range(accum)]
        model = probes.private_copy(run.model)  # fires no hooks of the run's (or other detectors'); eval mode
    except Exception:
        return None
    count, forward_loss = ctx.seam(COUNT_TARGETS), ctx.seam(FORWARD_LOSS)
    fp16 = tcfg.precision == "fp16"
    scale = 256.0 if fp16 else 1.0
    out: dict = {"accum": accum, "precision": tcfg.precision, "scale": scale, "grad_clip": tcfg.grad_clip}
    try:
        targets = sum(int(count(mb["labels"])) for mb in micro)
        with torch.enable_grad():
            ref_loss = 0.0
            for mb in micro:
                loss = forward_loss(model, mb, targets, tcfg.precision)
                (loss * scale).backward()
                ref_loss += float(loss.detach())
    except Exception:
        return None  # the loss functions are broken: their own contracts report it
    params = [p for p in model.parameters() if p.requires_grad]
    ref_norm = _grad_norm(params) / scale
    if not (math.isfinite(ref_loss) and math.isfinite(ref_norm)):
        return None  # the model's forward/backward is not finite here: nothing to judge train_step by
    with torch.no_grad():
        again = sum(float(forward_loss(model, mb, targets, tcfg.precision)) for mb in micro)
    if not math.isclose(again, ref_loss, rel_tol=1e-5):
        return None  # the forward is not deterministic: a step could not be compared with a reference
    for p in params:
        p.grad = None
    out.update(targets=targets, reference_loss=ref_loss, reference_grad_norm=ref_norm)
    opt = torch.optim.SGD(params, lr=tcfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler(probes.device_type(ctx), init_scale=scale, enabled=fp16)
    seen: dict = {}

    def pre_hook(optimizer, args, kwargs):
        seen.update(norm=_grad_norm(params), with_grad=sum(p.grad is not None for p in params),
                    schedule_before_step=int(sched.last_epoch))

    opt.register_step_pre_hook(pre_hook)
    fake = types.SimpleNamespace(config=run.config, corpus=run.corpus, model=model, train_model=model, optimizer=opt,
                                 scheduler=sched, scaler=scaler, sampler=None, rank=0, world_size=1, step=0,
                                 history=[])
    try:
        with torch.enable_grad(), probes.quiet():
            record = ctx.seam(TRAIN_STEP)(fake, micro)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return out
    out.update(error=None, logged_loss=float(record.loss), logged_grad_norm=float(record.grad_norm),
               logged_lr=float(record.lr), logged_scale=float(record.scale), skipped=bool(record.skipped),
               optimizer_saw=seen, schedule_after=int(sched.last_epoch), run_step_after=fake.step,
               history=len(fake.history), grads_left=sum(p.grad is not None and bool(p.grad.any()) for p in params))
    return out


def _grad_norm(params) -> float:
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0


@register
class TrainStepContract(Detector):
    id = "train_step_contract"
    needs_run = ("corpus",)
    needs_config = ("train.accum", "train.device")
    needs_seams = (TRAIN_STEP, COUNT_TARGETS, FORWARD_LOSS)
    family = "optimizer"
    passive = False
    description = ("train_step on a throwaway model copy / SGD / scaler: logs the window's loss and true pre-clip "
                   "norm, the optimizer gets the clipped gradients, the schedule advances once, gradients are cleared")

    def on_start(self, ctx) -> None:
        with ctx.probe():
            result = probe_train_step(ctx)
            if result is None:
                return
            step_probe = probe_optimizer_step(ctx, enabled_scaler=result["scale"] > 1)
            clip_ok = not clip_problems(probe_clip(ctx, enabled_scaler=result["scale"] > 1))
        step_ok = not step_probe.get("error")
        if result.get("error"):
            if step_ok and clip_ok:
                self.report(ctx, "optimizer", TRAIN_STEP, f"train_step raises on a throwaway copy of the run "
                            f"({result['error']}) while its parts work", result, confidence=0.7)
            return
        problems = []
        ref, logged, clip = result["reference_grad_norm"], result["logged_grad_norm"], result["grad_clip"]
        if clip_ok and not _close(logged, ref, 1e-2):
            ratio = logged / ref if ref else math.inf
            problems.append(f"logged pre-clip grad norm {logged:.5g}, the gradient of the window's loss has norm "
                            f"{ref:.5g} (x{ratio:.4g})")
        saw = result["optimizer_saw"]
        if clip_ok and step_ok and saw:
            want = min(ref, clip) if clip > 0 else ref
            if not _close(saw["norm"], want, 1e-2):
                problems.append(f"the optimizer stepped with gradients of norm {saw['norm']:.5g}, expected "
                                f"min(true norm {ref:.5g}, grad_clip {clip:g}) = {want:.5g}")
        if not _close(result["logged_loss"], result["reference_loss"], 1e-3):
            problems.append(f"logged loss {result['logged_loss']:.6g}, the window's token-mean loss is "
                            f"{result['reference_loss']:.6g}")
        if step_ok:
            per_call = step_probe["sched_advance"]  # what optimizer_step itself contributes
            if result["schedule_after"] != per_call:
                problems.append(f"the schedule advanced {result['schedule_after']} times in one train_step "
                                f"(optimizer_step advances it {per_call} time(s); accum = {result['accum']})")
            if step_probe["cleared"] and result["grads_left"]:
                problems.append(f"{result['grads_left']} parameters hold gradients after the step")
            if step_probe["used_grads"] and saw and saw.get("with_grad") == 0:
                problems.append("the optimizer stepped with no gradients")
        if result["run_step_after"] != 1 or result["history"] != 1:
            problems.append(f"run.step advanced to {result['run_step_after']} and {result['history']} records were "
                            "kept (expected 1 and 1)")
        if result["skipped"]:
            problems.append("the step was reported as skipped on finite gradients")
        if problems:
            self.report(ctx, ctx.seams.get(TRAIN_STEP, "optimizer"), TRAIN_STEP,
                        "train_step on a throwaway copy (its parts honour their contracts): " + "; ".join(problems),
                        result, confidence=0.85)
