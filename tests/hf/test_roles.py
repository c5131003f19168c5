"""The HF target's roles (``targets/hf/roles.py``): each keeps its role's normalized contract on the clean stack, and
the white-box detectors that probe roles find a fault of the component a role stands for and name its seam."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from faultbench import targets
from faultbench.detectors.api import ROLES, RunContext, all_detectors
from faultbench.detectors.collate import collate_violations, crafted_batches
from faultbench.detectors.loss import lm_loss_problems
from faultbench.detectors.mask import broken_mask_part, check_build_mask
from faultbench.detectors.optimizer import scheduler_lrs
from faultbench.faults.inject import injected
from faultbench.targets.hf.recipes import RECIPES
from faultbench.targets.hf.roles import ROLES as HF_ROLES
from faultbench.targets.hf.run import build_run
from faultbench.targets.hf.seams import SEAMS, resolve


def context(run) -> RunContext:
    return RunContext(run=run, seam_resolver=resolve, seams=dict(SEAMS), roles=dict(HF_ROLES))


def started(recipe: str, workdir, **overrides):
    """A run as a detector's ``on_start`` finds it: Trainer's optimizer and scheduler created, nothing trained."""
    run = build_run(dataclasses.replace(RECIPES[recipe], **overrides), 0, workdir)
    run.trainer.create_optimizer_and_scheduler(num_training_steps=run.steps)
    return run


@pytest.mark.parametrize("target", ["ref", "hf"])
def test_every_role_a_target_offers_is_a_known_role_standing_for_one_of_its_seams(target):
    roles, seams = targets.get(target).roles(), targets.get(target).seams()
    assert roles and set(roles) <= set(ROLES)
    assert {name: spec.seam for name, spec in roles.items() if spec.seam not in seams} == {}


@pytest.mark.parametrize("recipe", ["fp32", "eager"])
def test_the_clean_hf_roles_keep_their_contracts(recipe, tmp_path):
    run = started(recipe, tmp_path)
    ctx = context(run)
    tok, vocab = run.tokenizer, run.vocab_size
    specials = {run.pad_id, run.bos_id, run.eos_id, run.unk_id}
    words = [i for i in range(4, vocab) if i not in specials][:40]
    for side in ("right", "left"):
        for docs in crafted_batches(run.bos_id, run.eos_id, words).values():
            assert collate_violations(ctx.role("collate"), docs, run.pad_id, side, vocab) == {}
    assert check_build_mask(ctx.role("mask_builder"), torch.device("cpu")) == {}
    assert broken_mask_part(ctx) is None
    assert lm_loss_problems(ctx)["problems"] == {}
    labels = ctx.role("collate")([[run.bos_id, 7, 8, run.eos_id], [run.bos_id, 9, run.eos_id]], run.pad_id,
                                 "right")["labels"]
    assert ctx.role("count_targets")(labels) == 3 + 2  # the targets after the shift: 7, 8, EOS and 9, EOS
    declared = [run.lr_schedule(s) for s in range(run.steps + 2)]
    assert [ctx.role("lr_at")(s) for s in range(run.steps + 2)] == pytest.approx(declared, abs=1e-12)
    assert scheduler_lrs(ctx.role("make_scheduler"), run.lr, run.steps + 2) == pytest.approx(declared, abs=1e-12)
    ids = torch.tensor([[run.bos_id, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(ctx.role("forward")(ids), run.model(input_ids=ids).logits)
    encoded = ctx.role("encode")("a document")
    assert encoded[0] == run.bos_id and encoded[-1] == run.eos_id
    decayed = set(ctx.role("decay_names")(run.model))
    assert decayed and all(p.dim() >= 2 for n, p in run.model.named_parameters() if n in decayed)
    assert tok.padding_side == RECIPES[recipe].padding_side  # the collate role sets the side for its call only


def test_the_evaluate_role_is_a_probe_no_callback_takes_for_an_evaluation_of_the_run(tmp_path):
    """Trainer.evaluate logs its metrics and calls on_evaluate: a watch attached through the callback would take a
    probe's loss (other documents, possibly a train-mode model) for the run's (it did: 3 clean 2-rank cases)."""
    from transformers import TrainerCallback

    seen = []

    class Recorder(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            seen.append("on_evaluate")

        def on_log(self, args, state, control, **kwargs):
            seen.append("on_log")

    run = started("fp32", tmp_path)
    run.trainer.add_callback(Recorder())
    loss = context(run).role("evaluate")([[run.bos_id, 7, 8, 9, run.eos_id], [run.bos_id, 10, run.eos_id]])
    assert loss > 0 and seen == []


HF = "transformers.trainer.Trainer"
MASKS = "transformers.masking_utils"
# fault -> (recipe, the white-box detector that probes the role it breaks, the seam its finding must name)
FOUND_BY_ROLE = {
    "hf_pad_labels_not_ignored": ("fp32", "collate_contract",
                                  "transformers.data.data_collator.DataCollatorForLanguageModeling.torch_call"),
    "hf_label_shift_off_by_one": ("fp32", "loss_contract", "transformers.loss.loss_utils.ForCausalLMLoss"),
    "hf_num_items_overcount": ("fp32", "loss_contract", f"{HF}._get_num_items_in_batch"),
    "hf_causal_mask_off_by_one": ("fp32", "mask_contract", f"{MASKS}.causal_mask_function"),
    "hf_padding_mask_wrong_axis": ("fp32", "mask_contract", f"{MASKS}.padding_mask_function"),
    "hf_and_masks_union": ("fp32", "mask_contract", f"{MASKS}.and_masks"),
    "hf_sdpa_mask_dropped_with_padding": ("fp32", "mask_contract", f"{MASKS}._ignore_causal_mask_sdpa"),
    "hf_tokenizer_no_eos": ("fp32", "corpus_invariants", "targets.hf.data.wrap_tokenizer"),
    "hf_double_bos": ("fp32", "corpus_invariants", "targets.hf.data.TextDataset.__getitem__"),
    "hf_wd_on_norm_weights": ("fp32", "optimizer_config", f"{HF}.get_decay_parameter_names"),
    "hf_huge_lr": ("fp32", "optimizer_config", f"{HF}.create_optimizer"),
    "hf_sched_wrong_num_steps": ("accum", "lr_schedule", f"{HF}.create_scheduler"),
    "hf_loss_sum_reduction": ("fp32", "loss_contract", "transformers.loss.loss_utils.fixed_cross_entropy"),
    "hf_pad_side_mismatch": ("fp32", "collate_contract",
                             "transformers.tokenization_utils_base.PreTrainedTokenizerBase._pad"),
    "hf_eos_masked_pad_eq_eos": ("fp32", "collate_contract", "targets.hf.data.wrap_tokenizer"),
    "hf_repeat_kv_tiled": ("eager", "attend_contract", "transformers.models.llama.modeling_llama.repeat_kv"),
    "hf_rope_q_only": ("fp32", "shift_invariance", "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"),
    "hf_kv_cache_prepends_new_states": ("fp32", "kv_cache_consistency", "transformers.cache_utils.DynamicLayer.update"),
    "hf_eval_in_train_mode": ("resume", "eval_contract", f"{HF}.evaluation_loop"),
    "hf_attention_dropout_in_eval": ("resume", "eval_contract",
                                     "transformers.models.llama.modeling_llama.LlamaForCausalLM.forward"),
    "hf_bf16_weights_no_master_copy": ("bf16", "optimizer_config", f"{HF}._move_model_to_device"),
    "hf_cache_positions_ignore_past": (
        "fp32", "kv_cache_consistency",
        "transformers.generation.utils.GenerationMixin._update_model_kwargs_for_generation"),
}


@pytest.mark.parametrize("fault", list(FOUND_BY_ROLE))
def test_a_role_probe_finds_the_fault_of_the_component_and_names_its_seam(fault, tmp_path):
    recipe, detector_id, seam = FOUND_BY_ROLE[fault]
    detector = all_detectors()[detector_id]()
    with injected(fault):
        ctx = context(started(recipe, tmp_path))
        detector.check_applicable(ctx)
        detector.on_start(ctx)
    assert [f.seam for f in detector.findings][:1] == [seam], [f.message for f in detector.findings]


def test_the_gradient_a_window_sends_into_the_logits_is_that_of_its_token_mean_loss_on_hf():
    """logit_grad_scale's exact check through Trainer's hooks: clean accumulation is silent; a loss divided by the
    accumulation steps twice (Trainer, then Accelerator.backward) is found and traced to the accumulation setup."""
    from faultbench.targets.hf.case import run_case

    assert run_case("accum", 0, ("logit_grad_scale",))["findings"] == []
    with injected("hf_ga_loss_divided_twice"):
        findings = run_case("accum", 0, ("logit_grad_scale",))["findings"]
    assert [f["seam"] for f in findings] == [f"{HF}.create_accelerator_and_postprocess"], findings
    assert findings[0]["evidence"]["exact_ratio"] == pytest.approx(0.25, rel=0.05)  # accum = 4


@pytest.mark.parametrize("fault, seam", [
    (None, None),
    ("hf_resume_skip_ignores_accumulation", f"{HF}._init_training_state"),
    ("hf_sampler_epoch_never_advances", "accelerate.data_loader.SeedableRandomSampler.set_epoch"),
])
def test_batch_order_on_hf_tells_a_resume_that_replays_batches_from_an_epoch_that_replays_its_order(fault, seam):
    """The combined recipe resumes at step 6 and starts its second epoch at step 9 (143 documents, 16 a step)."""
    from faultbench.targets.hf.case import run_case

    with injected(*([fault] if fault else [])):
        findings = run_case("combined", 0, ("batch_order",))["findings"]
    assert [f["seam"] for f in findings] == ([seam] if seam else []), findings


@pytest.mark.parametrize("recipe", ["accum", "eager", "bf16"])
def test_a_probe_finds_nothing_on_the_clean_components_the_faults_above_break(recipe, tmp_path):
    ctx = context(started(recipe, tmp_path))
    for detector_id in sorted({d for _, d, _ in FOUND_BY_ROLE.values()}):
        detector = all_detectors()[detector_id]()
        detector.check_applicable(ctx)
        detector.on_start(ctx)
        assert detector.findings == [], detector_id
