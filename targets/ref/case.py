"""One case of the reference: a recipe's run with a case's detectors wired in, as a JSON-able record.

The run trains with the white-box suite's hooks (``harness.suite``) and the watch (``harness.watched``) attached,
saves and resumes half-way for the resume recipes, evaluates, decodes with the KV cache, and returns the record
(``harness.record.empty_record``'s keys): per-step metrics, the crash (if any), every detector's findings, errors
and time. A crash is an outcome, a detector that raises is a detector error: neither escapes ``run_case``. The
caller injects the case's faults around it (``harness.case.run_target_case``).
"""

from __future__ import annotations

import hashlib
import tempfile
import time
import traceback
from pathlib import Path

import torch

from faultbench.detectors.api import RunContext
from faultbench.harness.record import Case, empty_record
from faultbench.harness.suite import Suite, crashed, finished
from faultbench.harness.watched import Watched, split_tracks
from faultbench.model.seams import SEAMS, resolve
from faultbench.targets.ref.recipes import RECIPES
from faultbench.targets.ref.roles import ROLES

ROOT = Path(__file__).resolve().parents[2]
EVAL_DOCS = 128  # validation documents evaluated at the end of a case (the full split takes 8x longer)
DECODE_PROMPTS, DECODE_TOKENS = 4, 8  # a case ends as real runs do: sampling from the model, with the KV cache


def seams_on_traceback(tb) -> list[str]:
    """The reference functions on a traceback, as seam-style names (``model.loss.lm_loss``), innermost last."""
    names = []
    for frame, _ in traceback.walk_tb(tb):
        path = Path(frame.f_code.co_filename)
        try:
            rel = path.resolve().relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts[0] == "model":
            names.append(".".join(rel.with_suffix("").parts) + "." + frame.f_code.co_qualname)
    return names


def crash_record(exc: BaseException, step: int | None) -> dict:
    """The crash as data: type, message, step, traceback, and the reference frames (``model.x.f``),
    innermost last, under "frames"."""
    return {"type": type(exc).__name__, "message": str(exc)[:500], "step": step,
            "frames": seams_on_traceback(exc.__traceback__),
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


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


def run_case(recipe: str, seed: int, detectors=(), golden: dict | None = None, rank: int = 0,
             workdir: str | None = None, capture_dir: str | None = None) -> dict:
    """Run ``recipe`` with ``detectors`` (on this process or this rank), faults already injected by the caller;
    never raises.

    ``workdir`` holds the resume recipes' checkpoint (every rank must be given the same one); default:
    a temporary directory. ``capture_dir``: keep the state before every step and every step's batch there
    (``harness.capture.StepCapture``), for a repro bundle.
    """
    case = Case(recipe, seed, (), tuple(detectors))
    with tempfile.TemporaryDirectory(prefix="faultbench-case-") as tmp:
        return _run(case, golden, rank, Path(workdir or tmp), capture_dir)


def _run(case: Case, golden: dict | None, rank: int, workdir: Path, capture_dir: str | None = None) -> dict:
    from faultbench.model.checkpoint import load_checkpoint, save_checkpoint
    from faultbench.model.evaluate import evaluate
    from faultbench.model.run import build_run

    recipe = RECIPES[case.recipe]
    cfg = recipe.config(case.seed)
    out = empty_record(case, rank)
    start = time.perf_counter()
    ctx = RunContext(run=None, seam_resolver=resolve, seams=dict(SEAMS), golden=golden, roles=dict(ROLES))
    white, black = split_tracks(case.detectors)
    # the reference's RoPE and its planned length, as its user would declare them to the watch
    declare = {"positions": "relative", "total_steps": cfg.train.steps}
    watched = Watched(black, rank, cfg.train.world_size, golden, declare) if black else None
    suite = None
    handles = []
    capture = None
    if capture_dir is not None:
        from faultbench.harness.capture import StepCapture

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
        crashed(out, exc, crash_record(exc, ctx.run.step if ctx.run is not None else None), suite, watched)
    finally:
        for h in handles:
            h.remove()
        if watched is not None:
            watched.close()
    return finished(out, ctx.run, start, suite, watched)


def _watch(watched: Watched | None, suite: Suite, run) -> None:
    """Attach the case's watch (if it has black-box detectors) to ``run`` as a user's loop would, quiet while the
    suite's hooks run."""
    if watched is not None:
        from faultbench.model.data import collate  # the loop's collate function, as its user would name it

        watched.attach(run.model, run.optimizer, scheduler=run.scheduler, scaler=run.scaler, tokenizer=run.tokenizer,
                       step=run.step, collate=collate)
        suite.quiet = watched.quiet


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
