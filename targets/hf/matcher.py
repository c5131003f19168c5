"""Which HF recipe can show a fault: the essential keys of its manifest's variant, met by a recipe.

The principle is the reference's (``targets.ref.recipes``): a variant mixes essential keys, which switch a code path
on (the precision, the padding side, accumulation, attention dropout, the attention implementation, ranks, a
resume) and must be met by the recipe, and tuning keys, which only sharpen the proof (steps, the learning
rate and its warmup, sizes, the batch, weight decay, the clip value, the corpus) and are ignored: the
recipe's own values stand in, and the case's manifested flag says whether the fault still showed. A key in
neither list is essential and must match exactly. An HF variant holds ``Recipe`` fields at its top level
(section ""), ``model`` and ``data`` dicts, and ``"recipe": name`` to start from another recipe than fp32.
"""

from __future__ import annotations

from faultbench.targets.hf.recipes import RECIPES, Recipe, scenario_recipe

TUNING = {
    "": {"steps", "batch_size", "lr", "warmup_steps", "weight_decay", "max_grad_norm"},
    "model": {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings"},
    "data": {"seq_len", "vocab_size", "num_docs", "val_fraction", "num_words", "branching", "short_stop",
             "long_fraction", "long_stop", "max_words", "corpus_seed"},
}
# essential keys whose value matters only as on/off (accumulating 2 or 4 micro-batches is the same code path)
SWITCHES = {("", "accum"): lambda v: v > 1, ("model", "attention_dropout"): lambda v: v > 0,
            ("", "world_size"): lambda v: v > 1}
# what a run does beyond its fields, derived from a manifest's scenario, steps and corpus (as the reference's)
RESUME, EPOCH = ("run", "resume"), ("run", "crosses_epoch")
# what a recipe can switch on beyond the plain fp32 run: the keys ``features`` counts
PATHS = (("", "precision"), ("", "padding_side"), ("", "accum"), ("", "world_size"), ("model", "attention_dropout"),
         ("model", "attn_implementation"), RESUME, EPOCH)
_MISSING = object()


def _feature(section: str, key: str, value):
    switch = SWITCHES.get((section, key))
    return switch(value) if switch and value is not _MISSING else value


def has(recipe: Recipe, need: tuple[str, str]):
    """The recipe's value for one of ``needs``'s keys (None: the recipe has no such field)."""
    if need == RESUME:
        return recipe.resume_at is not None
    if need == EPOCH:
        return recipe.crosses_epoch
    section, key = need
    holder = recipe if section == "" else getattr(recipe, section, None)
    value = getattr(holder, key, _MISSING)
    return None if value is _MISSING else _feature(section, key, value)


def _flat(variant: dict) -> dict[tuple[str, str], object]:
    """A variant's keys as (section, key) -> value, the nested ``model``/``data`` dicts opened."""
    out = {}
    for key, value in variant.items():
        if key in ("model", "data") and isinstance(value, dict):
            out.update({(key, k): v for k, v in value.items()})
        else:
            out[("", key)] = value
    return out


def needs(manifest) -> dict[tuple[str, str], object]:
    """What a recipe must have for the fault to show: (section, key) -> value (on/off for a switch).

    ``"recipe": name`` needs what that recipe switches on beyond fp32; the ``resume`` and ``ddp`` scenarios
    need a resume and ranks, a run longer than an epoch of its corpus needs a recipe that crosses an epoch."""
    variant = dict(manifest.variant)
    out = {}
    base = variant.pop("recipe", None)
    if base is not None:
        start = RECIPES.get(base)
        if start is None:
            out[("", "recipe")] = base  # an unknown starting recipe: no recipe can meet it
        else:
            out.update({p: has(start, p) for p in PATHS if has(start, p) != has(RECIPES["fp32"], p)})
    out.update({(s, k): _feature(s, k, v) for (s, k), v in _flat(variant).items() if k not in TUNING.get(s, ())})
    if manifest.scenario in ("resume", "ddp_resume"):
        out[RESUME] = True
    if manifest.scenario in ("ddp", "ddp_resume"):
        out[("", "world_size")] = True
    if _crosses_epoch(manifest):
        out[EPOCH] = True
    return out


def _crosses_epoch(manifest) -> bool:
    """Whether the manifest's run is longer than an epoch of its corpus; False for a variant no recipe can be
    built from (an unknown recipe, field or value: needs that no recipe meets already)."""
    try:
        return scenario_recipe(manifest.variant, manifest.steps).crosses_epoch
    except (KeyError, TypeError, ValueError):
        return False


def features(recipe: Recipe) -> int:
    """How many code paths the recipe switches on beyond the plain fp32 run."""
    plain = RECIPES["fp32"]
    return sum(has(recipe, p) != has(plain, p) for p in PATHS)
