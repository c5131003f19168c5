"""Run one case of the reference (clean or with faults injected) and record what happened.

A scenario is a recipe a debugging engineer would run to reproduce a symptom:
- ``train``: train N steps, evaluate; records per-step metrics, the batch shapes the model saw, a
  crash with the seams on its traceback, the first non-finite step, graphs left alive, split overlap;
- ``resume``: train N steps uninterrupted, and again with a save/load at N/2; records how far the
  resumed run strays from the uninterrupted one (the clean reference: not at all);
- ``generate``: train N steps, then decode left-padded prompts with the KV cache and compare with
  uncached full forwards; records the logit gap and greedy agreement;
- ``ddp``: train N steps on 2 ranks (the rank pool); records rank disagreement and per-rank histories.
A crash is an outcome, never an exception out of ``run_scenario``.
"""

from __future__ import annotations

import gc
import math
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from faults.inject import injected
from model.config import RunConfig, get_preset

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Outcome:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    batch_shapes: list[tuple[int, int]] = field(default_factory=list)  # (B, T) of every training forward
    crash: dict | None = None  # {"type", "message", "step", "seams": [innermost last]}
    val_loss: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def nan_step(self) -> int | None:
        """First step whose loss is not finite."""
        return next((i for i, x in enumerate(self.losses) if not math.isfinite(x)), None)

    def final_loss(self, last: int = 5) -> float:
        tail = self.losses[-last:]
        return sum(tail) / len(tail) if tail else math.nan

    def to_dict(self) -> dict:
        return {**self.__dict__, "nan_step": self.nan_step}


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


def _crash(exc: BaseException, step: int) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:500], "step": step,
            "seams": seams_on_traceback(exc.__traceback__),
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


def scenario_config(variant: dict, steps: int, seed: int, preset: str = "tiny") -> RunConfig:
    base = get_preset(preset)
    train = {"steps": steps, "warmup_steps": min(base.train.warmup_steps, steps), **variant.get("train", {})}
    return base.replace(**{k: v for k, v in variant.items() if k != "train"}, train=train, seed=seed)


def _train(cfg: RunConfig, out: Outcome, until: int | None = None, run=None):
    """Train (a fresh run unless given) to ``until``; fill ``out``; return the run (None if it crashed)."""
    from model.evaluate import evaluate
    from model.run import build_run
    from model.train import train

    step = 0
    try:
        run = run or build_run(cfg)
        step = run.step
        handle = run.model.register_forward_pre_hook(
            lambda module, args: out.batch_shapes.append(tuple(args[0].shape)) if module.training else None)

        def record(run, rec):
            nonlocal step
            step = run.step
            out.losses.append(rec.loss)
            out.grad_norms.append(rec.grad_norm)
            out.lrs.append(rec.lr)
            out.scales.append(rec.scale)
            out.skipped.append(rec.skipped)
            out.tokens_per_s.append(rec.tokens_per_s)

        try:
            train(run, until, on_step=record)
        finally:
            handle.remove()
        out.val_loss = evaluate(run.model, run.corpus.val, run.tokenizer.pad_id, cfg.train.eval_batch_size,
                                cfg.train.precision, cfg.data.pad_side)
        train_docs = set(run.corpus.train)
        out.extra["val_docs_in_train"] = sum(doc in train_docs for doc in run.corpus.val)
        return run
    except Exception as exc:  # the crash is the outcome
        out.crash = _crash(exc, step)
        return None


def _live_graph_tensors() -> int:
    """Tensors still attached to an autograd graph: after a step none should survive."""
    gc.collect()
    with warnings.catch_warnings():  # touching every object trips torch's deprecated-alias warnings
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.grad_fn is not None)


def _scenario_train(cfg: RunConfig, steps: int) -> Outcome:
    out = Outcome()
    run = _train(cfg, out)
    out.extra["live_graph_tensors"] = _live_graph_tensors()
    del run
    return out


def _scenario_resume(cfg: RunConfig, steps: int) -> Outcome:
    from model.checkpoint import load_checkpoint, save_checkpoint
    from model.run import build_run

    whole = Outcome()
    _train(cfg, whole)
    out = Outcome()
    run = _train(cfg, out, until=steps // 2)
    if run is not None:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                save_checkpoint(run, Path(tmp) / "ckpt")
                resumed = build_run(cfg)
                load_checkpoint(resumed, Path(tmp) / "ckpt")
            except Exception as exc:
                out.crash = _crash(exc, steps // 2)
                return out
            run = _train(cfg, out, run=resumed)
    if whole.crash is None and out.crash is None:
        n = min(len(whole.losses), len(out.losses))
        out.extra["resume_loss_diff"] = max((abs(a - b) for a, b in zip(whole.losses[:n], out.losses[:n],
                                                                       strict=True)), default=0.0)
        out.extra["resume_steps"] = (len(whole.losses), len(out.losses))
        out.extra["resume_val_diff"] = abs(whole.val_loss - out.val_loss)
    return out


def _scenario_generate(cfg: RunConfig, steps: int) -> Outcome:
    from model.data import collate

    out = Outcome()
    run = _train(cfg, out)
    if run is None:
        return out
    model = run.model.eval()
    prompts = [doc[: 3 + 2 * i] for i, doc in enumerate(sorted(run.corpus.val, key=len)[-4:])]
    batch = collate(prompts, run.tokenizer.pad_id, "left")
    new = 12
    try:
        with torch.no_grad():
            cached = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=new)
            # the same tokens, scored without the cache: one full forward over prompt + generated
            mask = torch.cat([batch["attention_mask"], torch.ones(len(prompts), new, dtype=torch.long)], 1)
            full_logits = model(cached, mask)[:, batch["input_ids"].shape[1] - 1 : -1]
            greedy_full = full_logits.argmax(-1)
    except Exception as exc:
        out.crash = _crash(exc, run.step)
        return out
    generated = cached[:, batch["input_ids"].shape[1]:]
    out.extra["greedy_agreement"] = float((generated == greedy_full).float().mean())
    return out


def _scenario_ddp(cfg: RunConfig, steps: int, fault_ids: tuple[str, ...], plugins: tuple[str, ...], pool) -> Outcome:
    from harness.launch import RankFailure, RankPool

    out = Outcome()
    cfg = cfg.replace(train={"world_size": 2})
    own_pool = pool is None
    pool = pool or RankPool(2)
    try:
        ranks = pool.run(ddp_case, cfg.to_dict(), fault_ids, plugins, timeout_s=120)
    except RankFailure as exc:
        out.crash = {"type": "RankFailure", "message": str(exc)[:500], "step": None, "seams": []}
        return out
    finally:
        if own_pool:
            pool.close()
    first = ranks[0]
    if first.get("crash"):
        out.crash = first["crash"]
        return out
    out.losses = [r["loss"] for r in first["history"]]
    out.grad_norms = [r["grad_norm"] for r in first["history"]]
    out.val_loss = first["val_loss"]
    out.extra["rank_param_diff"] = max((ranks[0]["state"][k] - ranks[1]["state"][k]).abs().max().item()
                                       for k in ranks[0]["state"])
    out.extra["rank_loss_diff"] = max(abs(a["loss"] - b["loss"]) for a, b in
                                      zip(ranks[0]["history"], ranks[1]["history"], strict=True))
    return out


def ddp_case(rank: int, cfg_dict: dict, fault_ids: tuple[str, ...], plugins: tuple[str, ...]) -> dict:
    """Pool entry: train with the faults injected on this rank; a crash is returned, not raised."""
    from faults.registry import load_plugin
    from harness.training import train_reference

    for plugin in plugins:
        load_plugin(plugin)
    with injected(*fault_ids):
        try:
            return train_reference(RunConfig.from_dict(cfg_dict), rank, with_params=True)
        except Exception as exc:
            return {"crash": _crash(exc, None)}


def run_scenario(scenario: str, variant: dict, steps: int, seed: int, fault_ids=(), plugins=(), pool=None,
                 preset: str = "tiny") -> Outcome:
    """Run ``scenario`` on the ``variant`` config with ``fault_ids`` injected (none: the clean run)."""
    cfg = scenario_config(variant, steps, seed, preset)
    fault_ids = tuple(fault_ids)
    if scenario == "ddp":
        return _scenario_ddp(cfg, steps, fault_ids, tuple(plugins), pool)
    runner = {"train": _scenario_train, "resume": _scenario_resume, "generate": _scenario_generate}[scenario]
    with injected(*fault_ids):
        return runner(cfg, steps)


def main(argv=None) -> int:
    """``python -m harness.scenario SCENARIO STEPS SEED VARIANT_JSON``: one clean case, Outcome as JSON.

    Used to run a spliced copy of ``model/`` (put first on PYTHONPATH) with no injection machinery.
    """
    import json
    import sys

    torch.set_num_threads(1)
    scenario, steps, seed, variant = (argv or sys.argv[1:])[:4]
    outcome = run_scenario(scenario, json.loads(variant), int(steps), int(seed))
    print(json.dumps(outcome.to_dict(), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
