"""The reference's clean recipes, and what each offers a fault's manifest (the matcher's needs/has/features).

A recipe is a clean-matrix variant of the ``tiny`` preset: config overrides per section, steps, world size and a
resume point. A fault's manifest names the variant it shows in; ``needs`` keeps its essential keys (those that
switch a code path on), ``has`` reads a recipe's value for one, ``features`` counts what a recipe switches on.
"""

from __future__ import annotations

from dataclasses import dataclass

from faultbench.model.config import RunConfig, get_preset
from faultbench.model.corpus import SMALL_EPOCH, train_doc_count

# The combined recipes' small corpus: 143 training documents, 8 global batches of 16 an epoch, so their
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


def scenario_config(variant: dict, steps: int, seed: int, preset: str = "tiny") -> RunConfig:
    """The config of a manifest's scenario: ``preset`` with the variant's overrides, run for ``steps``."""
    base = get_preset(preset)
    train = {"steps": steps, "warmup_steps": min(base.train.warmup_steps, steps), **variant.get("train", {})}
    return base.replace(**{k: v for k, v in variant.items() if k != "train"}, train=train, seed=seed)


def crosses_epoch(cfg: RunConfig) -> bool:
    """Whether ``cfg``'s run consumes more global batches than one epoch holds."""
    return cfg.train.steps > train_doc_count(cfg.data) // cfg.train.batch_size


def _feature(section: str, key: str, value):
    switch = SWITCHES.get((section, key))
    return switch(value) if switch else value


def needs(manifest) -> dict[tuple[str, str], object]:
    """What a recipe must have for the fault to show: (section, key) -> value (on/off for a switch)."""
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
