"""Run one case of the reference (clean or with faults injected) and record what happened.

A scenario is a recipe a debugging engineer would run to reproduce a symptom:
- ``train``: train N steps, evaluate; records per-step metrics, the batch shapes the model saw, a
  crash with the seams on its traceback, the first non-finite step, graphs left alive, split overlap,
  the share of exactly-zero entries in the first step's gradients, the number of distinct parameters;
- ``resume``: train N steps uninterrupted, and again with a save/load at N/2; records how far the
  resumed run strays from the uninterrupted one (the clean reference: not at all);
- ``generate``: train N steps, then decode left-padded prompts with the KV cache and compare with
  uncached full forwards; records the logit gap and greedy agreement, and two invariance probes of
  the trained model: each prompt alone vs in the left-padded batch (pad_logit_gap), and every position
  shifted by the same amount (rope_shift_gap; RoPE is relative, so zero up to rounding);
- ``ddp``: train N steps on 2 ranks (the rank pool); records rank disagreement (parameters, losses,
  grad norms, whether the ranks trained on the same batches) and per-rank histories;
- ``ddp_resume``: ``ddp`` uninterrupted, and again saved at N/2 and resumed on every rank; records the
  rank disagreement of the resumed run and how far it strays from the uninterrupted one.
A crash is an outcome, never an exception out of ``run_scenario``.
"""

from __future__ import annotations

import gc
import importlib
import math
import random
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from faultbench import targets
from faultbench.faults.inject import injected
from faultbench.model.config import RunConfig
from faultbench.targets.ref.case import crash_record
from faultbench.targets.ref.recipes import scenario_config


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


def _crash(exc: BaseException, step: int) -> dict:
    """The reference's crash record, its frames called "seams" (the proofs' vocabulary)."""
    record = crash_record(exc, step)
    record["seams"] = record.pop("frames")
    return record


def _train(cfg: RunConfig, out: Outcome, until: int | None = None, run=None):
    """Train (a fresh run unless given) to ``until``; fill ``out``; return the run (None if it crashed)."""
    from faultbench.model.evaluate import evaluate
    from faultbench.model.run import build_run
    from faultbench.model.train import train

    step = 0
    try:
        run = run or build_run(cfg)
        step = run.step
        handle = run.model.register_forward_pre_hook(
            lambda module, args: out.batch_shapes.append(tuple(args[0].shape)) if module.training else None)
        # exactly-zero entries of the first step's gradients (fp16 underflow flushes small ones to zero)
        zeros = [0, 0]

        def count_zeros(grad):
            zeros[0] += int((grad == 0).sum())
            zeros[1] += grad.numel()

        grad_hooks = [p.register_hook(count_zeros) for p in run.model.parameters() if p.requires_grad]

        def record(run, rec):
            nonlocal step
            step = run.step
            if grad_hooks:
                for h in grad_hooks:
                    h.remove()
                grad_hooks.clear()
                out.extra["grad_zero_fraction"] = zeros[0] / max(zeros[1], 1)
            out.losses.append(float(rec.loss))
            out.grad_norms.append(rec.grad_norm)
            out.lrs.append(rec.lr)
            out.scales.append(rec.scale)
            out.skipped.append(rec.skipped)
            out.tokens_per_s.append(rec.tokens_per_s)

        try:
            train(run, until, on_step=record)
        finally:
            handle.remove()
            for h in grad_hooks:
                h.remove()
        out.val_loss = evaluate(run.model, run.corpus.val, run.tokenizer.pad_id, cfg.train.eval_batch_size,
                                cfg.train.precision, cfg.data.pad_side)
        train_docs = set(run.corpus.train)
        out.extra["val_docs_in_train"] = sum(doc in train_docs for doc in run.corpus.val)
        out.extra["num_params"] = run.model.num_params()  # distinct parameters: a tied matrix counts once
        return run
    except Exception as exc:  # the crash is the outcome
        out.crash = _crash(exc, step)
        return None


def _live_graph_tensors() -> int:
    """Tensors still attached to an autograd graph among the objects gc tracks (after a collection)."""
    gc.collect()
    with warnings.catch_warnings():  # touching every object trips torch's deprecated-alias warnings
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.grad_fn is not None)


def _scenario_train(cfg: RunConfig, steps: int) -> Outcome:
    out = Outcome()
    # Only the run's own objects are counted: what the process held already (other tests' objects) is frozen
    # out of gc's view for the run, which also spares scanning the whole heap twice (seconds in a big process).
    # Where something else froze objects already, unfreezing would undo it: count everything, minus the start.
    own_freeze = gc.get_freeze_count() == 0
    if own_freeze:
        gc.freeze()
    before = 0 if own_freeze else _live_graph_tensors()
    try:
        run = _train(cfg, out)
        out.extra["live_graph_tensors"] = _live_graph_tensors() - before
    finally:
        if own_freeze:
            gc.unfreeze()
    del run
    return out


def _scenario_resume(cfg: RunConfig, steps: int) -> Outcome:
    from faultbench.model.checkpoint import load_checkpoint, save_checkpoint
    from faultbench.model.run import build_run

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
        out.extra.update(_resume_gaps(whole.losses, out.losses, whole.val_loss, out.val_loss))
    return out


def _resume_gaps(whole_losses: list[float], resumed_losses: list[float], whole_val: float,
                 resumed_val: float) -> dict:
    """How far a resumed run strays from the uninterrupted one (the clean reference: not at all)."""
    n = min(len(whole_losses), len(resumed_losses))
    return {
        "resume_loss_diff": max((abs(a - b) for a, b in zip(whole_losses[:n], resumed_losses[:n], strict=True)),
                                default=0.0),
        "resume_steps": (len(whole_losses), len(resumed_losses)),
        "resume_val_diff": abs(whole_val - resumed_val),
    }


def _scenario_generate(cfg: RunConfig, steps: int) -> Outcome:
    from faultbench.model.data import collate

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
            step_logits = []  # what each cached forward of generate() returned
            hook = model.register_forward_hook(lambda module, args, output: step_logits.append(output[:, -1]))
            try:
                cached = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=new)
            finally:
                hook.remove()
            # the same tokens, scored without the cache: one full forward over prompt + generated
            mask = torch.cat([batch["attention_mask"], torch.ones(len(prompts), new, dtype=torch.long)], 1)
            full_logits = model(cached, mask)[:, batch["input_ids"].shape[1] - 1 : -1]
            greedy_full = full_logits.argmax(-1)
            cached_gap = (torch.stack(step_logits, 1).float() - full_logits.float()).abs().max().item()
            # padding invariance: each prompt alone vs its row of the left-padded batch (real columns)
            padded = model(batch["input_ids"], batch["attention_mask"])
            pad_gap = max((model(torch.tensor([p]))[0] - padded[i, -len(p):]).abs().max().item()
                          for i, p in enumerate(prompts))
            # RoPE is relative: shifting every position by the same amount leaves the logits unchanged
            positions = mask.cumsum(-1) - 1
            shifted = model(cached, mask, positions.clamp(min=0) + 8)
            real = mask.bool()
            shift_gap = (shifted - model(cached, mask, positions.clamp(min=0)))[real].abs().max().item()
    except Exception as exc:
        out.crash = _crash(exc, run.step)
        return out
    generated = cached[:, batch["input_ids"].shape[1]:]
    out.extra["greedy_agreement"] = float((generated == greedy_full).float().mean())
    out.extra["cached_logit_gap"] = cached_gap  # max |cached decode logits - uncached logits|
    out.extra["pad_logit_gap"] = pad_gap  # max |logits alone - logits in a left-padded batch|
    out.extra["rope_shift_gap"] = shift_gap  # max |logits at positions + 8 - logits at positions|
    return out


def _run_ranks(pool, cfg: RunConfig, fault_ids, plugins, **train_kwargs) -> tuple[list[dict], dict | None]:
    """``ddp_case`` on every rank: the ranks' results and the first crash among them (None if none)."""
    ranks = pool.run(ddp_case, cfg.to_dict(), fault_ids, plugins, train_kwargs, timeout_s=120,
                     retire=bool(fault_ids or plugins))
    return ranks, next((r["crash"] for r in ranks if r.get("crash")), None)


def _scenario_ddp(cfg: RunConfig, steps: int, fault_ids: tuple[str, ...], plugins: tuple[str, ...], pool,
                  resume: bool = False) -> Outcome:
    from faultbench.harness.launch import RankFailure, RankPool

    out = Outcome()
    cfg = cfg.replace(train={"world_size": 2})
    own_pool = pool is None
    pool = pool or RankPool(2)
    whole = None
    try:
        ranks, crash = _run_ranks(pool, cfg, fault_ids, plugins)
        if resume and crash is None:  # the same run again, saved at N/2 and resumed on every rank
            whole = ranks
            with tempfile.TemporaryDirectory() as tmp:
                ckpt = str(Path(tmp) / "ckpt")
                ranks, crash = _run_ranks(pool, cfg, fault_ids, plugins, until=steps // 2, save=ckpt)
                if crash is None:
                    ranks, crash = _run_ranks(pool, cfg, fault_ids, plugins, resume=ckpt)
    except RankFailure as exc:
        out.crash = {"type": "RankFailure", "message": str(exc)[:500], "step": None, "seams": []}
        return out
    finally:
        if own_pool:
            pool.close()
    if crash:
        out.crash = crash
        return out
    first = ranks[0]
    out.losses = [r["loss"] for r in first["history"]]
    out.grad_norms = [r["grad_norm"] for r in first["history"]]
    out.val_loss = first["val_loss"]
    out.extra["rank_param_diff"] = max((ranks[0]["state"][k] - ranks[1]["state"][k]).abs().max().item()
                                       for k in ranks[0]["state"])
    for key in ("loss", "grad_norm"):
        out.extra[f"rank_{key}_diff"] = max(abs(a[key] - b[key]) for a, b in
                                            zip(ranks[0]["history"], ranks[1]["history"], strict=True))
    # share of training forwards in which both ranks were fed the very same batch (disjoint shards: 0)
    same = [a == b for a, b in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True)]
    out.extra["rank_batches_identical"] = sum(same) / max(len(same), 1)
    if whole is not None:
        out.extra.update(_resume_gaps([r["loss"] for r in whole[0]["history"]], out.losses,
                                      whole[0]["val_loss"], out.val_loss))
    return out


def ddp_case(rank: int, cfg_dict: dict, fault_ids: tuple[str, ...], plugins: tuple[str, ...],
             train_kwargs: dict | None = None) -> dict:
    """Pool entry: train with the faults injected on this rank; a crash is returned, not raised.

    ``train_kwargs`` go to ``train_reference`` (``until``, ``save``, ``resume``). The result holds a digest
    of every batch this rank trained on, to compare the ranks' shards.
    """
    import hashlib

    from faultbench.faults.registry import load_plugin
    from faultbench.harness.training import train_reference
    from faultbench.model.gpt import GPT

    for plugin in plugins:
        load_plugin(plugin)
    batches = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: batches.append(hashlib.sha1(args[0].cpu().numpy().tobytes()).hexdigest())
        if isinstance(module, GPT) and module.training else None)
    with injected(*fault_ids):
        try:
            summary = train_reference(RunConfig.from_dict(cfg_dict), rank, with_params=True, **(train_kwargs or {}))
        except Exception as exc:
            return {"crash": _crash(exc, None)}
        finally:
            handle.remove()
    return {**summary, "batches": batches}


def run_scenario(scenario: str, variant: dict, steps: int, seed: int, fault_ids=(), plugins=(), pool=None,
                 preset: str = "tiny", target: str = "ref") -> Outcome:
    """Run ``scenario`` on the ``variant`` config of ``target`` with ``fault_ids`` injected (none: clean)."""
    if target != "ref":
        return _target_scenario(target, scenario, variant, steps, seed, tuple(fault_ids), tuple(plugins), pool)
    cfg = scenario_config(variant, steps, seed, preset)
    fault_ids = tuple(fault_ids)
    if scenario in ("ddp", "ddp_resume"):
        return _scenario_ddp(cfg, steps, fault_ids, tuple(plugins), pool, resume=scenario == "ddp_resume")
    runner = {"train": _scenario_train, "resume": _scenario_resume, "generate": _scenario_generate}[scenario]
    random.seed(seed)  # deterministic even where the code under test draws from Python's global RNG
    with injected(*fault_ids):
        return runner(cfg, steps)


def target_scenario_on_rank(rank: int, target: str, scenario: str, variant: dict, steps: int, seed: int,
                            fault_ids: tuple, plugins: tuple, workdir: str | None = None) -> dict:
    """A target's scenario on this process (a ``RankPool`` rank, or the caller's), faults injected here."""
    from faultbench.faults.registry import load_plugin

    for plugin in plugins:
        load_plugin(plugin)
    module = importlib.import_module(f"faultbench.targets.{target}.scenario")
    random.seed(seed)
    with injected(*fault_ids):
        return module.run_scenario(scenario, variant, steps, seed, rank, workdir)


def _target_scenario(target: str, scenario: str, variant: dict, steps: int, seed: int, fault_ids: tuple,
                     plugins: tuple, pool) -> Outcome:
    """Another target's scenario (``targets/<target>/scenario.py``): 2 ranks of ``pool`` for ``ddp``."""
    targets.get(target)  # the target's import-time set-up (HF: no hub access) before anything else of it
    if scenario != "ddp":
        return Outcome(**target_scenario_on_rank(0, target, scenario, variant, steps, seed, fault_ids, plugins))
    from faultbench.harness.launch import RankFailure, RankPool

    own_pool = pool is None
    pool = pool or RankPool(2)
    try:
        with tempfile.TemporaryDirectory(prefix="faultbench-scenario-") as workdir:
            ranks = pool.run(target_scenario_on_rank, target, scenario, variant, steps, seed, fault_ids, plugins,
                             workdir, timeout_s=180, retire=bool(fault_ids or plugins))
    except RankFailure as exc:
        return Outcome(crash={"type": "RankFailure", "message": str(exc)[:500], "step": None, "seams": []})
    finally:
        if own_pool:
            pool.close()
    out = Outcome(**ranks[0])
    out.crash = next((r["crash"] for r in ranks if r["crash"]), None)
    return out


def main(argv=None) -> int:
    """``python -m faultbench.harness.scenario SCENARIO STEPS SEED VARIANT_JSON``: one clean case, Outcome as JSON.

    Used to run a spliced copy of ``model/`` (put first on PYTHONPATH) with no injection machinery.
    """
    import json
    import sys

    torch.set_num_threads(1)
    scenario, steps, seed, variant = (argv or sys.argv[1:])[:4]
    outcome = run_scenario(scenario, json.loads(variant), int(steps), int(seed))
    print("faultbench-outcome: " + json.dumps(outcome.to_dict(), default=str))  # practice_runs.OUTCOME_LINE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
