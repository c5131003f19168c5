"""One case on the HF target: a recipe, a seed, a detector suite; faults are injected by the caller.

Train (resume recipes: train to ``resume_at`` with a save, then a fresh Trainer resumes from that
checkpoint), evaluate, decode a few prompts with ``generate`` (DynamicCache), and return the record of
``harness.record`` (history, crash, val_loss, findings, outputs, timings). Never raises.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
import time
import traceback
from pathlib import Path

import torch

from faultbench.detectors.api import RunContext
from faultbench.guard import frame_qualname
from faultbench.harness.record import empty_record
from faultbench.harness.suite import Suite, crashed, finished
from faultbench.harness.watched import Watched, split_tracks
from faultbench.targets.hf.hooks import checkpoint_dir, train
from faultbench.targets.hf.recipes import RECIPES
from faultbench.targets.hf.roles import ROLES
from faultbench.targets.hf.run import HFRun, build_run, evaluate
from faultbench.targets.hf.seams import SEAMS, resolve

DECODE_PROMPTS, DECODE_TOKENS = 4, 8


def seams_on_traceback(tb) -> list[str]:
    """The seams whose code is on a traceback (``module.qualname`` in the seam table), innermost last."""
    return [n for n in (frame_qualname(frame) for frame, _ in traceback.walk_tb(tb)) if n in SEAMS]


def crash_record(exc: BaseException, step: int | None) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:500], "step": step,
            "frames": seams_on_traceback(exc.__traceback__),
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


def _train(run: HFRun, suite, watched, out: dict, **kwargs) -> None:
    """``hooks.train`` whose step records (and time, and tokens) go into ``out`` even if it crashes; with the
    case's black-box detectors watching through the Trainer callback a user would add."""
    if watched is not None:
        run.trainer.add_callback(watched.callback())
        suite.quiet = watched.quiet
    start, done = time.perf_counter(), len(run.history)
    try:
        train(run, suite, **kwargs)
    finally:
        out["train_s"] += time.perf_counter() - start
        out["history"] += [r.to_dict() for r in run.history[done:]]
        out["outputs"]["positions"] += sum(r.tokens for r in run.history[done:])


def decode(run: HFRun) -> dict:
    """Greedy ``generate`` (KV cache) from the first tokens of the ``DECODE_PROMPTS`` longest val documents,
    left-padded: {"decoded": (B, DECODE_TOKENS) lists, "decode_logits": sha1 of every step's logits}."""
    texts = sorted(run.texts.val, key=len)[-DECODE_PROMPTS:]
    ids = [run.tokenizer(t, truncation=True)["input_ids"][: 3 + 2 * i] for i, t in enumerate(texts)]
    tok = run.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    try:
        batch = tok.pad({"input_ids": ids}, return_tensors="pt")
    finally:
        tok.padding_side = side
    model = run.model.eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    logits = torch.stack(out.logits, 1).float()
    return {"decoded": out.sequences[:, batch["input_ids"].shape[1]:].tolist(),
            "decode_logits": hashlib.sha1(logits.numpy().tobytes()).hexdigest()}


def run_case(recipe: str, seed: int, detectors=(), golden: dict | None = None, rank: int = 0,
             workdir: str | None = None) -> dict:
    """The record of one case (see module doc); ``workdir`` holds checkpoints (the same on every rank)."""
    with tempfile.TemporaryDirectory(prefix="faultbench-hf-") as tmp:
        return _run(RECIPES[recipe], seed, tuple(detectors), golden, rank, Path(workdir or tmp))


def _run(recipe, seed: int, detectors: tuple, golden, rank: int, workdir: Path) -> dict:
    out = empty_record_for(recipe.name, seed, detectors, rank)
    start = time.perf_counter()
    ctx = RunContext(run=None, seam_resolver=resolve, seams=dict(SEAMS), golden=golden, roles=dict(ROLES))
    white, black = split_tracks(detectors)
    # Llama's RoPE, as its user would declare it (the callback declares Trainer's max_steps itself)
    watched = Watched(black, rank, recipe.world_size, golden, {"positions": "relative"}) if black else None
    suite = None
    try:
        ctx.run = build_run(recipe, seed, workdir, rank)
        suite = Suite(white, ctx)
        if recipe.resume_at is None:
            _train(ctx.run, suite, watched, out)
        else:
            _train(ctx.run, suite, watched, out, stop_at=recipe.resume_at)
            path = checkpoint_dir(str(workdir), recipe.resume_at)
            resumed = build_run(recipe, seed, workdir, rank)
            ctx.run = resumed
            out["resumed_at"] = recipe.resume_at
            _train(resumed, suite, watched, out, begin_hook="on_checkpoint_load", checkpoint=path, resume=path)
        ctx.phase = "eval"
        out["val_loss"] = evaluate(ctx.run)
        out["outputs"].update(decode(ctx.run))
        suite.fire("on_end", {"val_loss": out["val_loss"]})
    except Exception as exc:  # the crash is the outcome
        crashed(out, exc, crash_record(exc, ctx.run.step if ctx.run is not None else None), suite, watched)
    finally:
        if watched is not None:
            watched.close()
    return finished(out, ctx.run, start, suite, watched)


def empty_record_for(recipe: str, seed: int, detectors: tuple, rank: int) -> dict:
    """``harness.record.empty_record`` with this target's case description."""
    from faultbench.harness.record import Case

    return empty_record(Case(recipe, seed, (), detectors, target="hf"), rank)


def warm_up(recipe: str) -> None:
    """Build a run of ``recipe`` and train one step (transformers' and accelerate's lazy imports, the corpus and
    tokenizer caches), so that the cases forked from this process start warm."""
    with tempfile.TemporaryDirectory(prefix="faultbench-hf-warm-") as tmp:
        run = build_run(dataclasses.replace(RECIPES[recipe], steps=1, warmup_steps=1, resume_at=None), 0, Path(tmp))
        train(run)


def run_case_on_rank(rank: int, recipe: str, seed: int, detectors=(), golden: dict | None = None,
                     workdir: str | None = None) -> dict:
    """``harness.launch.RankPool`` entry: the case on this rank (the process group is initialized)."""
    torch.set_num_threads(1)
    return run_case(recipe, seed, detectors, golden, rank, workdir)
