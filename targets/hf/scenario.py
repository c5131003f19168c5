"""Proof scenarios of the HF target: what a fault's manifest runs, clean and faulty, to show its symptom.

A manifest of an HF fault names a scenario and a variant of the ``fp32`` recipe (``Recipe`` fields, with
``model``/``data`` as nested dicts; ``{"recipe": "left_pad"}`` starts from another recipe):
- ``train``: train ``steps``, evaluate; losses, grad norms, LRs, the crash (seams on its traceback), val loss,
  and in ``extra`` the share of label positions that are targets (and of
  documents whose EOS is one, ``eos_target_fraction``), the decayed-parameter count, the share of
  training forwards that replay an earlier forward's exact batch (``repeated_batches``: clean 0, batches are
  drawn without replacement and reshuffled every epoch), the share of evaluated documents that are also
  training documents (``val_train_overlap``: clean 0, the split is by document hash), the share of parameter
  tensors training left unchanged (``frozen_param_fraction``: clean 0) and how far a second
  evaluation of the same model lands from the first (``eval_repeat_gap``: clean 0, evaluation is deterministic);
- ``generate``: ``train``, then two probes of the trained model: greedy ``generate`` (DynamicCache) on
  left-padded prompts against a full forward of the same sequences (``cached_logit_gap``), each prompt
  alone against the left-padded batch (``pad_logit_gap``), and every position shifted by the same amount
  (``rope_shift_gap``: RoPE is relative, so zero up to rounding; ``rope_far_shift_gap`` shifts them to a long-context
  position, where RoPE tables computed in reduced precision lose the relative property), and the same forward
  under the other attention implementation, eager vs sdpa (``impl_logit_gap``: the same weights, so zero up to
  rounding);
- ``resume``: ``train`` uninterrupted and again saved at ``steps // 2`` and resumed by a fresh Trainer;
  ``resume_loss_gap`` and ``resume_param_gap`` say how far the resumed run strays (clean: not at all);
- ``ddp``: ``train`` on 2 ranks of a ``harness.launch.RankPool`` (faults injected on every rank by the
  caller's entry point); ``rank_param_gap`` is the largest parameter difference between the ranks and
  ``rank_batches_identical`` the share of training forwards where every rank got the same batch (clean 0).
The outcome is a dict of ``harness.scenario.Outcome``'s fields; a crash is an outcome, never raised.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from faultbench.targets.hf.case import crash_record
from faultbench.targets.hf.hooks import checkpoint_dir, train
from faultbench.targets.hf.recipes import Recipe, scenario_recipe
from faultbench.targets.hf.run import EVAL_DOCS, HFRun, build_run, evaluate

SCENARIOS = ("train", "generate", "resume", "ddp")
PROMPT_LENGTHS = (3, 5, 4, 6)  # left-padded prompts of different lengths: padding and cache offsets matter
NEW_TOKENS = 8
FAR_SHIFT = 1024  # a long-context position offset: bf16's spacing there is 8, so a position rounded to bf16 moves
EOS_DOCS = 256  # documents of the EOS probe: enough that the rare over-long ones (~1%) are among them


def _outcome() -> dict:
    return {"losses": [], "grad_norms": [], "lrs": [], "scales": [], "skipped": [], "tokens_per_s": [],
            "batch_shapes": [], "crash": None, "val_loss": None, "extra": {}}


def _record(run: HFRun, out: dict) -> None:
    for r in run.history[len(out["losses"]):]:
        out["losses"].append(float(r.loss))
        out["grad_norms"].append(float(r.grad_norm))
        out["lrs"].append(float(r.lr))
        out["scales"].append(float(r.scale))
        out["skipped"].append(bool(r.skipped))


def _crash(exc: BaseException, run: HFRun | None) -> dict:
    record = crash_record(exc, run.step if run is not None else None)
    record["seams"] = record.pop("frames")  # the scenarios' name for the seams on the traceback
    return record


def _train_phase(recipe: Recipe, seed: int, workdir: Path, out: dict, rank: int = 0,
                 batches: list | None = None) -> HFRun | None:
    """Build and train a run into ``out``; None (with ``out["crash"]``) if it raised. ``batches`` (if given)
    receives the bytes of every training forward's input_ids, in order."""
    run, seen = None, [] if batches is None else batches

    def on_forward(module, args, kwargs) -> None:
        if module.training:
            out["batch_shapes"].append(tuple(kwargs["input_ids"].shape))
            seen.append(kwargs["input_ids"].numpy().tobytes())

    try:
        run = build_run(recipe, seed, workdir, rank)
        initial = [p.detach().clone() for p in run.model.parameters()]
        run.model.register_forward_pre_hook(on_forward, with_kwargs=True)
        try:
            train(run)
        finally:
            _record(run, out)
        out["extra"]["target_fraction"] = _target_fraction(run)
        out["extra"]["eos_target_fraction"] = _eos_target_fraction(run)
        out["extra"]["decayed_params"] = _decayed_params(run)
        out["extra"]["frozen_param_fraction"] = _frozen_param_fraction(run, initial)
        out["extra"]["repeated_batches"] = sum(b in seen[:i] for i, b in enumerate(seen)) / max(len(seen), 1)
        out["extra"]["val_train_overlap"] = _val_train_overlap(run)
        out["val_loss"] = evaluate(run)
        out["extra"]["eval_repeat_gap"] = abs(evaluate(run) - out["val_loss"])
        return run
    except Exception as exc:  # the crash is the outcome
        out["crash"] = _crash(exc, run)
        return None


def _target_fraction(run: HFRun) -> float:
    """Labels that are targets (not -100) over real tokens, on a collated batch of 8 training documents."""
    batch = run.trainer.data_collator([run.trainer.train_dataset[i] for i in range(8)])
    return float((batch["labels"] != -100).sum() / batch["attention_mask"].sum())


def _frozen_param_fraction(run: HFRun, initial: list[torch.Tensor]) -> float:
    """Share of parameter tensors whose every value is what it was before training: clean 0 (AdamW moves every
    tensor that gets a gradient or a decay; an update lost to rounding leaves a tensor where it started)."""
    frozen = [torch.equal(p.detach(), p0) for p, p0 in zip(run.model.parameters(), initial, strict=True)]
    return sum(frozen) / max(len(frozen), 1)


def _val_train_overlap(run: HFRun) -> float:
    """Share of the evaluated validation documents whose text is also a training document."""
    train_texts, evaluated = set(run.texts.train), run.texts.val[:EVAL_DOCS]
    return sum(t in train_texts for t in evaluated) / max(len(evaluated), 1)


def _eos_target_fraction(run: HFRun) -> float:
    """Share of the first ``EOS_DOCS`` training documents, collated as for training, whose labels hold the EOS id:
    clean 1 (every document ends with a supervised EOS, truncation keeps it)."""
    docs = [run.trainer.train_dataset[i] for i in range(min(EOS_DOCS, len(run.trainer.train_dataset)))]
    labels = run.trainer.data_collator(docs)["labels"]  # (EOS_DOCS, T)
    return float((labels == run.tokenizer.eos_token_id).any(-1).float().mean())


def _decayed_params(run: HFRun) -> int:
    """Parameters (tensors) in optimizer groups with a non-zero weight decay."""
    return sum(len(g["params"]) for g in run.optimizer.param_groups if g["weight_decay"] > 0)


def generation_gaps(run: HFRun) -> dict[str, float]:
    """``cached_logit_gap``: max |logits of cached greedy decoding - a full forward of the same sequences|;
    ``pad_logit_gap``: max |a prompt's last logits in the left-padded batch - the prompt alone|;
    ``rope_shift_gap``: max |logits of the real tokens with every position + 8 - with their own positions|;
    ``rope_far_shift_gap``: the same with every position + ``FAR_SHIFT``."""
    tok, model = run.tokenizer, run.model.eval()
    side, tok.padding_side = tok.padding_side, "left"
    try:
        prompts = [tok(t)["input_ids"][:n] for t, n in zip(run.texts.val, PROMPT_LENGTHS)]  # noqa: B905
        batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    finally:
        tok.padding_side = side
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        cached = torch.stack(out.logits, 1).float()  # (B, NEW_TOKENS, V)
        prompt_len = batch["input_ids"].shape[1]
        mask = torch.cat([batch["attention_mask"], torch.ones_like(out.sequences[:, prompt_len:])], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T): left padding does not move a token
        full = model(input_ids=out.sequences, attention_mask=mask, position_ids=positions).logits.float()
        last = full[:, prompt_len - 1]  # (B, V): each prompt's next-token logits in the batch
        alone = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in prompts])
        shifted = model(input_ids=out.sequences, attention_mask=mask, position_ids=positions + 8).logits.float()
        far = model(input_ids=out.sequences, attention_mask=mask, position_ids=positions + FAR_SHIFT).logits.float()
        other = _other_attention(model, lambda: model(input_ids=out.sequences, attention_mask=mask,
                                                      position_ids=positions).logits.float())
    real = mask.bool()
    return {"cached_logit_gap": float((cached - full[:, prompt_len - 1:-1]).abs().max()),
            "pad_logit_gap": float((last - alone).abs().max()),
            "rope_shift_gap": float((shifted - full)[real].abs().max()),
            "rope_far_shift_gap": float((far - full)[real].abs().max()),
            "impl_logit_gap": float((other - full)[real].abs().max())}


def _other_attention(model, forward):
    """``forward()`` run with the model switched to the other attention implementation (eager <-> sdpa)."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa" if impl == "eager" else "eager")
    try:
        return forward()
    finally:
        model.set_attn_implementation(impl)


def _max_param_gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def run_scenario(scenario: str, variant: dict, steps: int, seed: int, rank: int = 0,
                 workdir: str | None = None) -> dict:
    """One scenario in this process (faults already injected by the caller); see the module doc.

    ``ddp`` is run by calling this on every rank of a pool with ``rank`` set and one shared ``workdir``.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown HF scenario {scenario!r}; expected one of {SCENARIOS}")
    torch.set_num_threads(1)
    out = _outcome()
    with tempfile.TemporaryDirectory(prefix="faultbench-hf-scenario-") as tmp:
        root = Path(workdir or tmp)
        recipe = scenario_recipe(variant, steps, world_size=2 if scenario == "ddp" else 1)
        batches: list[bytes] = []
        run = _train_phase(recipe, seed, root / "run", out, rank, batches)
        if run is None:
            return out
        if scenario == "generate":
            _probe(out, lambda: out["extra"].update(generation_gaps(run)))
        elif scenario == "resume":
            _probe(out, lambda: out["extra"].update(_resume_gaps(recipe, seed, root, run)))
        elif scenario == "ddp":
            _probe(out, lambda: out["extra"].update(rank_param_gap=_rank_param_gap(run),
                                                    rank_batches_identical=_rank_batches_identical(batches)))
    return out


def _probe(out: dict, measure) -> None:
    """Run a scenario's probe; a crash there is the outcome too (e.g. a broken cache crashes ``generate``)."""
    try:
        measure()
    except Exception as exc:
        out["crash"] = _crash(exc, None)


def _resume_gaps(recipe: Recipe, seed: int, root: Path, uninterrupted: HFRun) -> dict[str, float]:
    """Train again, saved at half-way and resumed by a fresh run: how far it strays from ``uninterrupted``."""
    half = max(1, recipe.steps // 2)
    first = build_run(recipe, seed, root / "resumed")
    train(first, stop_at=half)
    resumed = build_run(recipe, seed, root / "resumed")
    train(resumed, resume=checkpoint_dir(str(root / "resumed"), half))
    losses = [r.loss for r in resumed.history]
    expected = [r.loss for r in uninterrupted.history[half:]]
    loss_gap = max((abs(a - b) for a, b in zip(losses, expected)), default=math.inf)  # noqa: B905
    if len(losses) != len(expected):
        loss_gap = math.inf  # a resume that trains another number of steps strays by definition
    return {"resume_loss_gap": loss_gap, "resume_param_gap": _max_param_gap(resumed.model, uninterrupted.model)}


def _rank_param_gap(run: HFRun) -> float:
    """Largest |parameter on this rank - on rank 0| after training (clean DDP: 0, the replicas are one model)."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().flatten() for p in run.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max(float((g - gathered[0]).abs().max()) for g in gathered)


def _rank_batches_identical(batches: list[bytes]) -> float:
    """Share of training forwards where every rank fed the same input_ids (clean DDP: 0, the shards are disjoint)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, batches)
    return sum(len(set(step)) == 1 for step in zip(*gathered)) / max(len(batches), 1)  # noqa: B905
