"""One bench case: a recipe of the reference, the faults injected (none: a clean case), a seed, a suite.

The case trains with the detectors' hooks wired in, saves and resumes half-way for the resume
recipes, evaluates, and returns a JSON-able record: per-step metrics, the crash (if any), every
detector's findings, errors and time. It runs in one process, or on every rank of a ``RankPool``
(``run_case_on_rank``) for the data-parallel recipes. A crash is an outcome, a detector that raises
is a detector error: neither escapes ``run_case``.

When the hooks fire (see ``detectors.api.Detector``):
  on_start        after the run is built, before step 0
  on_batch        after ``next_micro_batches``, before ``train_step``
  on_forward      forward hook of the model, training forwards only
  on_backward     hook on the logits' gradient, one call per micro-batch
  on_before_step  the optimizer's step pre-hook (skipped steps of fp16 never reach it)
  on_after_step   after ``train_step`` returns its record
  on_checkpoint_save / on_checkpoint_load   after the save, after the load into a fresh run
  on_end          after the evaluation on the first ``EVAL_DOCS`` validation documents
  on_crash        the run raised
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from faultbench import targets
from faultbench.detectors.api import HOOKS, Detector, NotApplicable, RunContext, all_detectors, rank_findings, rank_key
from faultbench.harness.watched import Watched, split_tracks
from faultbench.model.config import DataConfig, RunConfig, get_preset
from faultbench.model.seams import SEAMS, resolve

EVAL_DOCS = 128  # validation documents evaluated at the end of a case (the full split takes 8x longer)
DECODE_PROMPTS, DECODE_TOKENS = 4, 8  # a case ends as real runs do: sampling from the model, with the KV cache


# The combined recipes' small corpus: 143 training documents, 8 global batches of 16 an epoch, so their
# 12 steps cross an epoch boundary (at step 8, after the resume at 6); a quarter of it is validation.
SMALL_EPOCH = {"num_docs": 200, "val_fraction": 0.25}
COMBINED = {"train": {"precision": "fp16", "accum": 2}, "data": {"pad_side": "left", **SMALL_EPOCH},
            "model": {"dropout": 0.1}}


@dataclass(frozen=True)
class Recipe:
    """A clean-matrix variant: config overrides per section, steps, world size, resume point."""

    name: str
    overrides: dict
    steps: int = 16
    world_size: int = 1
    resume_at: int | None = None  # save at this step and continue from a fresh run loaded from it

    def config(self, seed: int) -> RunConfig:
        base = get_preset("tiny")
        train = {"steps": self.steps, "warmup_steps": min(8, self.steps), "world_size": self.world_size,
                 **self.overrides.get("train", {})}
        sections = {k: v for k, v in self.overrides.items() if k != "train"}
        return base.replace(**sections, train=train, seed=seed)


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("fp32", {}),
    Recipe("bf16", {"train": {"precision": "bf16"}}),
    Recipe("fp16", {"train": {"precision": "fp16"}}, steps=10),  # fp16 matmuls are emulated on CPU: 7x slower
    Recipe("left_pad", {"data": {"pad_side": "left"}}),
    Recipe("accum", {"train": {"accum": 4}}),
    Recipe("resume", {"model": {"dropout": 0.1}}, resume_at=8),
    Recipe("ddp", {"train": {"accum": 2}}, world_size=2),
    Recipe("zero", {"train": {"zero": True}}, world_size=2),
    Recipe("ddp_resume", {}, world_size=2, resume_at=8),
    # what real runs combine: fp16 with its GradScaler, accumulation, left padding, dropout, a resume
    # mid-run and an epoch boundary after it; on one process and on two ranks
    Recipe("combined", COMBINED, steps=12, resume_at=6),
    Recipe("ddp_combined", COMBINED, steps=12, world_size=2, resume_at=6),
)}


# ---- which recipe can show a fault --------------------------------------------------------------------
# A manifest's variant mixes two kinds of keys. Essential keys switch a code path on (precision, pad side,
# accumulation, dropout, ZeRO, ranks, truncation, bias, device): a recipe must match them, or the fault's
# code may never run. Tuning keys only make the proof test sharp (a short seq_len, a large init_std, a
# tiny vocabulary, a batch size, a clip value, an initial loss scale, the corpus size): the recipe's own
# values stand in for them, and the case's manifested flag (``harness.bench.mark_manifested``) says
# whether the fault still showed. A key in neither list is essential and must match exactly.
TUNING = {
    "data": {"seq_len", "vocab_size", "num_docs", "val_fraction", "num_words", "branching", "short_stop",
             "long_fraction", "long_stop", "max_words", "corpus_seed"},
    "model": {"vocab_size", "init_std", "n_layer", "n_head", "n_embd", "max_positions", "rope_base"},
    "train": {"steps", "batch_size", "lr", "min_lr", "warmup_steps", "weight_decay", "betas", "eps", "grad_clip",
              "init_scale", "eval_batch_size"},
}
# essential keys whose value matters only as on/off (accum 4 and accum 2 both accumulate)
SWITCHES = {("train", "accum"): lambda v: v > 1, ("model", "dropout"): lambda v: v > 0,
            ("train", "world_size"): lambda v: v > 1}
# what a run does beyond its config, derived from a manifest's scenario and steps; every case decodes a
# few prompts with the KV cache at its end, so the generate scenario needs nothing more
RESUME, EPOCH = ("run", "resume"), ("run", "crosses_epoch")


class NotRunnable(ValueError):
    """No recipe of the matrix satisfies a fault's manifest."""


@lru_cache(maxsize=32)
def train_docs(data: DataConfig) -> int:
    """Documents in the training split of ``data``'s corpus (sampled and split, not tokenized)."""
    from faultbench.model.corpus import MarkovSource, split_of

    texts = MarkovSource.from_config(data).sample(data.num_docs, seed=data.corpus_seed + 1)
    return sum(split_of(t, data.val_fraction) == "train" for t in texts)


def crosses_epoch(cfg: RunConfig) -> bool:
    """Whether ``cfg``'s run consumes more global batches than one epoch holds."""
    return cfg.train.steps > train_docs(cfg.data) // cfg.train.batch_size


def _feature(section: str, key: str, value):
    switch = SWITCHES.get((section, key))
    return switch(value) if switch else value


def needs(manifest) -> dict[tuple[str, str], object]:
    """What a recipe must have for the fault to show: (section, key) -> value (on/off for a switch)."""
    from faultbench.harness.scenario import scenario_config

    out = {(section, key): _feature(section, key, value) for section, keys in manifest.variant.items()
           for key, value in keys.items() if key not in TUNING.get(section, ())}
    if manifest.scenario in ("resume", "ddp_resume"):
        out[RESUME] = True
    if manifest.scenario in ("ddp", "ddp_resume"):
        out[("train", "world_size")] = True
    if crosses_epoch(scenario_config(manifest.variant, manifest.steps, 0)):
        out[EPOCH] = True
    return out


def has(recipe: Recipe, need: tuple[str, str]):
    """The recipe's value for one of ``needs``'s keys (None: its config has no such field)."""
    section, key = need
    if need == RESUME:
        return recipe.resume_at is not None
    if need == EPOCH:
        return crosses_epoch(recipe.config(0))
    return _feature(section, key, getattr(getattr(recipe.config(0), section, None), key, None))


def features(recipe: Recipe) -> int:
    """How many code paths the recipe switches on beyond the plain fp32 run."""
    cfg = recipe.config(0)
    return sum((cfg.train.precision != "fp32", cfg.data.pad_side != "right", cfg.train.accum > 1,
                cfg.model.dropout > 0, cfg.train.zero, recipe.world_size > 1, recipe.resume_at is not None,
                crosses_epoch(cfg)))


# ---- the matcher, for any target: its needs/has/features (the reference's are above) -------------------

def _label(need: tuple[str, str], value) -> str:
    section, key = need
    return f"{section}.{key}={value}" if section else f"{key}={value}"


def unmet(manifest, recipe, target: str = "ref") -> list[str]:
    """The manifest's needs that ``recipe`` (of ``target``) does not meet, as "section.key=value" (empty: it
    can show there)."""
    stack = targets.get(target)
    return [_label(need, v) for need, v in stack.needs(manifest).items() if stack.has(recipe, need) != v]


def recipes_for(manifest, target: str = "ref") -> list[str]:
    """Every recipe of ``target`` that meets the manifest's needs, the plainest first (fewest ``features``,
    then order)."""
    stack = targets.get(target)
    recipes = stack.recipes()
    fit = [name for name, r in recipes.items() if not unmet(manifest, r, target)]
    return sorted(fit, key=lambda name: stack.features(recipes[name]))


def recipe_for(manifest, target: str = "ref") -> str:
    """The plainest recipe of ``target`` in which the fault's manifest says it shows; ``NotRunnable`` if none can.

    Only the recipe reaches the case: its detectors see the same config as the clean cases of it.
    """
    fit = recipes_for(manifest, target)
    if not fit:
        stack = targets.get(target)
        closest = min(stack.recipes().values(), key=lambda r: len(unmet(manifest, r, target)))
        wanted = ", ".join(_label(need, v) for need, v in stack.needs(manifest).items())
        raise NotRunnable(f"needs {wanted}: no {target} recipe has all of it (closest, {closest.name}, lacks "
                          f"{', '.join(unmet(manifest, closest, target))})")
    return fit[0]


MIN_SUBSYSTEMS = 3  # a recipe that holds faults holds faults of this many subsystems at least, on every target


def assign_recipes(specs: dict) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The recipes each fault runs in (of its own target), and why the others cannot run: ({fault id:
    [recipes]}, {fault id: reason}).

    A fault runs in its plainest fitting recipe (``recipe_for``). A recipe that then holds faults of fewer
    than ``MIN_SUBSYSTEMS`` subsystems would tell a detector that recognises its config where to look, so
    it also gets, one per missing subsystem, a fault of its target it can show that it does not hold yet: the
    one with the most needs (it exercises the recipe's combination), then the one run in the fewest recipes
    so far, then a fault that acts on every step, then by id.
    """
    runs, not_runnable = {}, {}
    for fault_id, spec in specs.items():
        try:
            runs[fault_id] = [recipe_for(spec.manifest, spec.target)]
        except NotRunnable as exc:
            not_runnable[fault_id] = str(exc)
    fits = {f: recipes_for(specs[f].manifest, specs[f].target) for f in runs}
    for target in dict.fromkeys(specs[f].target for f in runs):
        mine = [f for f in runs if specs[f].target == target]
        stack = targets.get(target)
        for recipe in stack.recipes():
            held = {specs[f].subsystem for f in mine if recipe in runs[f]}
            while held and len(held) < MIN_SUBSYSTEMS:
                candidates = [f for f in mine if recipe in fits[f] and specs[f].subsystem not in held]
                if not candidates:
                    break
                pick = min(candidates, key=lambda f: (-len(stack.needs(specs[f].manifest)), len(runs[f]),
                                                      specs[f].trigger != "always", f))
                runs[pick].append(recipe)
                held.add(specs[pick].subsystem)
    return runs, not_runnable


@dataclass(frozen=True)
class Case:
    """A recipe of a target (``targets.get``), the faults injected (none: clean), a seed, the detectors."""

    recipe: str
    seed: int
    faults: tuple[str, ...] = ()
    detectors: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    target: str = "ref"

    @property
    def name(self) -> str:
        """``fault/recipe/sSEED`` on the reference, ``target:fault/recipe/sSEED`` on another target."""
        prefix = "" if self.target == "ref" else f"{self.target}:"
        return f"{prefix}{'+'.join(self.faults) or 'clean'}/{self.recipe}/s{self.seed}"

    @property
    def world_size(self) -> int:
        return targets.get(self.target).recipes()[self.recipe].world_size

    def to_dict(self) -> dict:
        return {"target": self.target, "recipe": self.recipe, "seed": self.seed, "faults": list(self.faults),
                "detectors": list(self.detectors), "plugins": list(self.plugins)}


def crash_record(exc: BaseException, step: int | None) -> dict:
    """The crash as data: type, message, step, traceback, and the reference frames (``model.x.f``),
    innermost last, under "frames" (the scenarios' crash record calls them "seams")."""
    from faultbench.harness.scenario import _crash

    record = _crash(exc, step)
    record["frames"] = record.pop("seams")
    return record


def empty_record(case: Case, rank: int = 0) -> dict:
    """A case record before anything ran: no history, no findings, no crash."""
    return {"case": case.to_dict(), "rank": rank, "history": [], "crash": None, "val_loss": None, "train_s": 0.0,
            "wall_s": 0.0, "resumed_at": None, "findings": [], "detector_errors": {}, "step_seconds": {},
            "other_seconds": {}, "summaries": {}, "outputs": {"positions": 0}}


def failed_record(case: Case, kind: str, message: str) -> dict:
    """The record of a case whose process failed outside the run (a hang, a dead worker, a rank failure)."""
    return {**empty_record(case), "hang": kind == "Hang",
            "crash": {"type": kind, "message": message[:500], "step": None, "frames": [], "traceback": ""}}


class Suite:
    """The detectors of a case and the dispatcher of their hooks: each call is timed and contained.

    Before a detector's first hook its declared needs are checked (``Detector.check_applicable``); a
    detector that is not applicable to the run (there, or by raising ``NotApplicable`` from a hook) has
    its reason recorded once in ``not_applicable`` (and its summary) and is called no more.
    """

    def __init__(self, ids, ctx: RunContext):
        from faultbench.harness.golden import GoldenRecorder

        registry = {**all_detectors(), GoldenRecorder.id: GoldenRecorder}
        self.ctx = ctx
        self.detectors: list[Detector] = [registry[i]() for i in ids]
        self.errors: dict[str, str] = {}
        self.not_applicable: dict[str, str] = {}  # detector id -> why its assumptions do not hold for the run
        self._checked: set[str] = set()
        self.step_seconds = {d.id: 0.0 for d in self.detectors}  # inside training steps: the overhead
        self.other_seconds = {d.id: 0.0 for d in self.detectors}  # probes at start, checkpoint, end
        # only detectors that override a hook are called for it (the base class's hooks do nothing)
        self._subscribers = {hook: [d for d in self.detectors if getattr(type(d), hook) is not getattr(Detector, hook)]
                             for hook in HOOKS}
        self.in_step = False
        self.quiet: Callable[[bool], None] = lambda on: None  # another observer of the run (the watch) looks away

    def wants(self, hook: str) -> bool:
        return bool(self._subscribers[hook])

    def fire(self, hook: str, *args) -> None:
        timer = self.step_seconds if self.in_step else self.other_seconds
        for det in self._subscribers[hook]:
            if det.id in self.errors or det.id in self.not_applicable:
                continue
            start = time.perf_counter()
            self.quiet(True)
            try:
                if det.id not in self._checked:
                    self._checked.add(det.id)
                    det.check_applicable(self.ctx)
                getattr(det, hook)(self.ctx, *args)
            except NotApplicable as exc:  # said once, with its reason: neither a finding nor an error
                self.not_applicable[det.id] = f"{hook}: {exc}"[:500]
            except Exception as exc:  # a broken detector is recorded and silenced, never fatal
                self.errors[det.id] = f"{hook}: {type(exc).__name__}: {exc}"[:500]
            finally:
                self.quiet(False)
                timer[det.id] += time.perf_counter() - start

    def summaries(self) -> dict:
        out = {d.id: d.summary() for d in self.detectors if d.summary()}
        for det, reason in self.not_applicable.items():
            out[det] = {**out.get(det, {}), "not_applicable": reason}
        return out

    def findings(self) -> list:
        return rank_findings([f for d in self.detectors for f in d.findings])


def _attach(suite: Suite, run) -> list:
    """Wire the model and optimizer hooks to the suite; returns the handles to remove."""
    handles = []
    if suite.wants("on_forward") or suite.wants("on_backward"):
        def forward_hook(module, args, output):
            if not module.training or suite.ctx.phase != "train":
                return
            batch = {"input_ids": args[0], "attention_mask": args[1] if len(args) > 1 else None,
                     "position_ids": args[2] if len(args) > 2 else None}
            suite.fire("on_forward", batch, output)
            if suite.wants("on_backward") and output.requires_grad:
                output.register_hook(lambda grad: suite.fire("on_backward", batch, grad))

        handles.append(run.model.register_forward_hook(forward_hook))
    if suite.wants("on_before_step"):
        handles.append(run.optimizer.register_step_pre_hook(lambda opt, args, kwargs: suite.fire("on_before_step")))
    return handles


def _train_until(run, suite: Suite, until: int, out: dict, capture=None) -> None:
    from faultbench.model.train import next_micro_batches, train_step

    run.model.train()
    while run.step < until:
        if capture is not None:  # outside the step's timing: a bundle's capture is not detector overhead
            capture.state(run)
        start = time.perf_counter()
        suite.in_step = True
        try:
            micro_batches = next_micro_batches(run)
            out["outputs"]["positions"] += sum(b["input_ids"].numel() for b in micro_batches)  # compute spent
            if capture is not None:
                capture.batch(run.step, micro_batches)
            suite.fire("on_batch", micro_batches)
            record = train_step(run, micro_batches)
            suite.fire("on_after_step", record)
        finally:
            suite.in_step = False
        out["train_s"] += time.perf_counter() - start
        # the record's own fields, not ``to_dict``: its deep copy raises on a loss tensor that holds a graph
        fields = {**vars(record), "tokens_per_s": record.tokens_per_s}
        out["history"].append({k: (float(v.detach()) if isinstance(v, torch.Tensor) else v) for k, v in fields.items()})


def run_case(case: Case, golden: dict | None = None, rank: int = 0, workdir: str | None = None,
             capture_dir: str | None = None) -> dict:
    """Run ``case`` with its faults injected (on this process or this rank); never raises.

    ``workdir`` holds the resume recipes' checkpoint (every rank must be given the same one); default:
    a temporary directory. ``capture_dir``: keep the state before every step and every step's batch there
    (``harness.bundle.StepCapture``), for a repro bundle.
    """
    from faultbench.faults.inject import injected
    from faultbench.faults.registry import load_plugin

    for plugin in case.plugins:
        load_plugin(plugin)
    random.seed(case.seed)
    with injected(*case.faults), tempfile.TemporaryDirectory(prefix="faultbench-case-") as tmp:
        return _run(case, golden, rank, Path(workdir or tmp), capture_dir)


def _run(case: Case, golden: dict | None, rank: int, workdir: Path, capture_dir: str | None = None) -> dict:
    from faultbench.model.checkpoint import load_checkpoint, save_checkpoint
    from faultbench.model.evaluate import evaluate
    from faultbench.model.run import build_run

    recipe = RECIPES[case.recipe]
    cfg = recipe.config(case.seed)
    out = empty_record(case, rank)
    start = time.perf_counter()
    ctx = RunContext(run=None, seam_resolver=resolve, seams=dict(SEAMS), golden=golden,
                     roles=targets.get("ref").roles())
    white, black = split_tracks(case.detectors)
    # the reference's RoPE and its planned length, as its user would declare them to the watch
    declare = {"positions": "relative", "total_steps": cfg.train.steps}
    watched = Watched(black, rank, cfg.train.world_size, golden, declare) if black else None
    suite = None
    handles = []
    capture = None
    if capture_dir is not None:
        from faultbench.harness.bundle import StepCapture

        capture = StepCapture(Path(capture_dir), rank)
    try:
        ctx.run = build_run(cfg, rank)
        suite = Suite(white, ctx)
        handles = _attach(suite, ctx.run)
        _watch(watched, suite, ctx.run)
        suite.fire("on_start")
        if recipe.resume_at is not None:
            _train_until(ctx.run, suite, recipe.resume_at, out, capture)
            path = workdir / "ckpt"
            save_checkpoint(ctx.run, path)
            suite.fire("on_checkpoint_save", path)
            for h in handles:
                h.remove()
            resumed = build_run(cfg, rank)
            load_checkpoint(resumed, path)
            ctx.run = resumed
            handles = _attach(suite, resumed)
            _watch(watched, suite, resumed)
            out["resumed_at"] = resumed.step
            suite.fire("on_checkpoint_load", path)
        _train_until(ctx.run, suite, cfg.train.steps, out, capture)
        if capture is not None:
            capture.state(ctx.run)  # what the evaluation and the end-of-run probes saw
        ctx.phase = "eval"
        out["val_loss"] = evaluate(ctx.run.model, ctx.run.corpus.val[:EVAL_DOCS], ctx.run.tokenizer.pad_id,
                                   cfg.train.eval_batch_size, cfg.train.precision, cfg.data.pad_side)
        if watched is not None:
            watched.observe_eval(out["val_loss"])
        out["outputs"].update(decode(ctx.run))
        suite.fire("on_end", {"val_loss": out["val_loss"]})
        if watched is not None:
            watched.finish()
    except Exception as exc:  # the crash is the outcome
        out["crash"] = crash_record(exc, ctx.run.step if ctx.run is not None else None)
        if suite is not None:
            suite.fire("on_crash", out["crash"])
        if watched is not None:
            watched.finish(exc)
    finally:
        for h in handles:
            h.remove()
        if watched is not None:
            watched.close()
    if ctx.run is not None:
        out["outputs"].update(final_state(ctx.run))
    out["wall_s"] = time.perf_counter() - start
    return suite_into(out, suite, watched)


def _watch(watched: Watched | None, suite: Suite, run) -> None:
    """Attach the case's watch (if it has black-box detectors) to ``run`` as a user's loop would, quiet while the
    suite's hooks run."""
    if watched is not None:
        watched.attach(run.model, run.optimizer, scheduler=run.scheduler, scaler=run.scaler, tokenizer=run.tokenizer,
                       step=run.step)
        suite.quiet = watched.quiet


def suite_into(out: dict, suite: Suite | None, watched: Watched | None) -> dict:
    """``out`` with what the case's detectors saw, both tracks (of a run that could not even be built, what the
    black-box track's guard located)."""
    if suite is not None:
        out.update(findings=[f.to_dict() for f in suite.findings()], detector_errors=suite.errors,
                   step_seconds=suite.step_seconds, other_seconds=suite.other_seconds, summaries=suite.summaries())
    if watched is not None:
        watched.merge_into(out)
    return out


def decode(run) -> dict:
    """Greedy decode of the ``DECODE_PROMPTS`` longest validation documents' first tokens, left-padded, with
    the KV cache: {"decoded": (B, DECODE_TOKENS) token lists, "decode_logits": sha1 of every cached step's
    logits}. The model is left in eval mode."""
    from faultbench.model.data import collate
    from faultbench.model.precision import autocast_context

    prompts = [doc[: 3 + 2 * i] for i, doc in enumerate(sorted(run.corpus.val, key=len)[-DECODE_PROMPTS:])]
    batch = collate(prompts, run.tokenizer.pad_id, "left")
    model = run.model.eval()
    logits = []
    hook = model.register_forward_hook(lambda module, args, output: logits.append(output[:, -1].float()))
    try:
        with torch.no_grad(), autocast_context(run.config.train.precision, "cpu"):
            tokens = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=DECODE_TOKENS)
    finally:
        hook.remove()
    digest = hashlib.sha1(torch.cat(logits, 1).numpy().tobytes()).hexdigest()
    return {"decoded": tokens[:, batch["input_ids"].shape[1]:].tolist(), "decode_logits": digest}


def final_state(run) -> dict:
    """What the run left behind: a sha1 of its parameters, and how many of its step records still hold an
    autograd graph (a kept graph changes no number, only memory)."""
    digest = hashlib.sha1()
    for p in run.model.parameters():
        digest.update(p.detach().cpu().float().numpy().tobytes())
    held = sum(any(isinstance(v, torch.Tensor) and v.grad_fn is not None for v in vars(rec).values())
               for rec in run.history)
    return {"params": digest.hexdigest(), "graphs_held": held}


def behaviour(record: dict) -> str:
    """What a case's run did, timing left out, as one string: the step history, crash (type, step), val loss,
    decoded tokens and logits, final parameters, positions computed and graphs kept. A fault manifested in a
    case iff this differs from the clean case of the same recipe, seed and detectors."""
    crash = record["crash"] or {}
    history = [{k: v for k, v in h.items() if k not in ("seconds", "tokens_per_s")} for h in record["history"]]
    return json.dumps({"history": history, "crash": [crash.get("type"), crash.get("step")],
                       "val_loss": record["val_loss"], "outputs": record.get("outputs", {})}, sort_keys=True)


def case_from_dict(d: dict) -> Case:
    return Case(d["recipe"], d["seed"], tuple(d["faults"]), tuple(d["detectors"]), tuple(d["plugins"]),
                d.get("target", "ref"))  # a record or bundle from before targets is the reference's


def run_target_case(case: Case, golden: dict | None = None, rank: int = 0, workdir: str | None = None,
                    capture_dir: str | None = None) -> dict:
    """``case`` on its target, in this process (or on this rank): plugins loaded, faults injected around the
    target's ``run_case``; never raises (a crash is recorded). ``capture_dir`` (a repro bundle's steps) is
    passed on only to a target that captures (``Target.captures``)."""
    from faultbench.faults.inject import injected
    from faultbench.faults.registry import load_plugin

    for plugin in case.plugins:
        load_plugin(plugin)
    stack = targets.get(case.target)
    options = {"capture_dir": capture_dir} if capture_dir is not None and stack.captures else {}
    random.seed(case.seed)
    with injected(*case.faults):
        record = stack.run_case(case.recipe, case.seed, case.detectors, golden, rank, workdir, **options)
    record["case"] = case.to_dict()
    return record


def run_case_on_rank(rank: int, case_dict: dict, golden: dict | None, workdir: str,
                     capture_dir: str | None = None) -> dict:
    """RankPool entry: the case on this rank (the process group is initialized), on its target."""
    torch.set_num_threads(1)
    return run_target_case(case_from_dict(case_dict), golden, rank, workdir, capture_dir)


def case_hash(case: Case, code_digest: str) -> str:
    """Cache key: the case and the digest of every source file that can change its result."""
    blob = json.dumps({"case": case.to_dict(), "code": code_digest}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def source_digest(*folders: str) -> str:
    """sha256 over the Python sources of ``folders`` (relative to the repository root; a file counts as itself)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in folders:
        top = root / folder
        for path in [top] if top.is_file() else sorted(top.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def execute(case: Case, golden: dict | None = None, pool=None, timeout_s: float = 120.0,
            capture_dir: str | None = None) -> dict:
    """Run a case on its target where its recipe needs it: here, or on every rank of ``pool`` (findings of
    all ranks merged, the record of rank 0 otherwise). A rank failure (raise, death, hang) is a crash record."""
    if case.world_size == 1:
        return run_target_case(case, golden, capture_dir=capture_dir)
    from faultbench.harness.launch import RankFailure

    try:
        with tempfile.TemporaryDirectory(prefix="faultbench-case-") as workdir:
            ranks = pool.run(run_case_on_rank, case.to_dict(), golden, workdir, capture_dir, timeout_s=timeout_s,
                             retire=bool(case.faults or case.plugins))
    except RankFailure as exc:
        return failed_record(case, "RankFailure", str(exc))
    out = ranks[0]
    seen = {(f["detector"], f["subsystem"], f["seam"]) for f in out["findings"]}
    for other in ranks[1:]:
        for f in other["findings"]:
            if (f["detector"], f["subsystem"], f["seam"]) not in seen:
                seen.add((f["detector"], f["subsystem"], f["seam"]))
                out["findings"].append({**f, "evidence": {**f["evidence"], "rank": other["rank"]}})
        out["crash"] = out["crash"] or other["crash"]
        for d, err in other["detector_errors"].items():
            out["detector_errors"].setdefault(d, f"rank {other['rank']}: {err}")
    out["findings"].sort(key=rank_key)
    return out
