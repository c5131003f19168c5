"""The reference target (``model/``) behind the ``Target`` interface, over ``harness.case`` unchanged."""

from __future__ import annotations

import functools

from faultbench.detectors.api import Role
from faultbench.model import seams as _seams
from faultbench.targets import Target

# the reference's seams already have the roles' normalized calls (they are where the conventions come from)
ROLES = {
    "documents": Role("model.data.load_corpus"),
    "batches": Role("model.train.next_micro_batches"),
    "encode": Role("model.tokenizer.Tokenizer.encode", lambda run, encode: functools.partial(encode, run.tokenizer)),
    "truncate": Role("model.data.truncate"),
    "collate": Role("model.data.collate"),
    "forward": Role("model.gpt.GPT.forward", lambda run, forward: run.model),  # the module: its hooks run too
    "loss": Role("model.loss.lm_loss"),
    "count_targets": Role("model.loss.count_targets"),
    "position_ids": Role("model.rope.position_ids_from_mask"),
    "mask_builder": Role("model.attention.build_attention_mask"),
    "attend": Role("model.attention.attend"),
    "apply_rope": Role("model.rope.apply_rope", lambda run, apply: lambda q, k, cos, sin: (apply(q, cos, sin),
                                                                                           apply(k, cos, sin))),
    "init_weights": Role("model.gpt.GPT.init_weights"),
    "restore_optimizer": Role("model.checkpoint.load_checkpoint"),
    "restore_position": Role("model.checkpoint.load_checkpoint"),
    "epoch_order": Role("model.sampler.ResumableSampler.next_indices"),
    "optimizer_groups": Role("model.optim.configure_optimizer"),
    "lr_at": Role("model.optim.lr_at", lambda run, lr_at: lambda step: lr_at(step, run.config.train)),
    "make_scheduler": Role("model.optim.make_scheduler", lambda run, make: lambda opt: make(opt, run.config.train)),
    "train_step": Role("model.train.train_step"),
    "accumulation": Role("model.train.train_step"),  # it divides by the window's target count
    "optimizer_step": Role("model.train.optimizer_step"),
    "clip_gradients": Role("model.train.clip_gradients"),
    "split_of": Role("model.corpus.split_of"),
}


def _recipes() -> dict:
    from faultbench.harness.case import RECIPES

    return RECIPES


def _run_case(recipe: str, seed: int, detectors=(), golden: dict | None = None, rank: int = 0,
              workdir: str | None = None, capture_dir: str | None = None) -> dict:
    """``harness.case.run_case`` of a case without faults (the caller injects them around this call)."""
    from faultbench.harness.case import Case, run_case

    record = run_case(Case(recipe, seed, (), tuple(detectors)), golden, rank, workdir, capture_dir)
    record["case"]["target"] = "ref"
    return record


def _warm_up(recipe: str) -> None:
    """One optimizer step of the recipe (the first optimizer imports torch._dynamo: 1.4 s per process)."""
    from faultbench.harness.case import RECIPES
    from faultbench.model.run import build_run
    from faultbench.model.train import next_micro_batches, train_step

    run = build_run(RECIPES[recipe].config(0))
    train_step(run, next_micro_batches(run))


def _matcher(name: str):
    """``harness.case``'s function ``name`` (the reference's recipe matcher), imported on first call."""
    def call(*args):
        from faultbench.harness import case

        return getattr(case, name)(*args)

    return call


TARGET = Target(
    name="ref",
    seams=lambda: dict(_seams.SEAMS),
    resolve=_seams.resolve,
    recipes=_recipes,
    run_case=_run_case,
    clean_guarantees=tuple(f"tests.model.{m}" for m in (
        "test_accumulation", "test_amp", "test_causality", "test_convergence", "test_eval", "test_kv_cache",
        "test_label_alignment", "test_mask_precision", "test_optim", "test_padding", "test_resume", "test_rope",
        "test_sampler", "test_tokenizer")) + ("tests.distributed.test_ddp", "tests.distributed.test_resume"),
    needs=_matcher("needs"),
    has=_matcher("has"),
    features=_matcher("features"),
    preload=("faultbench.model.run", "faultbench.model.train", "faultbench.model.checkpoint"),
    roles=lambda: dict(ROLES),
    captures=True,
    warm_up=_warm_up,
)
