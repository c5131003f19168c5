"""The behavioural probes of the black-box track: silent on the clean HF tiny Llama, the clean reference GPT, GPT-2
and the clean nanoGPT model (2 seeds each); each broken property found, with its subsystem and the module where
it is born, on the nanoGPT bugs and on faults injected into transformers and into the reference; one round costs a
fixed handful of forwards; the probe detectors through faultbench.watch (findings at step 0, before the first
optimizer step)."""

from __future__ import annotations

import time

import pytest
import torch

import faultbench
from faultbench.detectors.api import NotApplicable
from faultbench.detectors.blackbox import probes
from faultbench.detectors.blackbox.lm import CausalLM
from faultbench.faults.inject import injected
from tests.watch import nanogpt
from tests.watch.test_lm import ids, llama

torch.set_num_threads(1)

MODEL_PROBES = probes.PROBES


def run_probes(lm: CausalLM, batch: torch.Tensor, mask: torch.Tensor | None = None,
               positions: str | None = "relative") -> dict:
    """{probe: ProbeResult | None | "n/a"} of every model probe of one round on ``batch``, in no-grad eval mode;
    ``positions``: what the loop declares (the Llama and the reference use RoPE: relative)."""
    out = {}
    with torch.no_grad():
        round_ = probes.ProbeRound(lm, batch, mask, positions=positions)
        for name in MODEL_PROBES:
            try:
                out[name] = round_.result(name)
            except NotApplicable:
                out[name] = "n/a"
    return out


def broken(results: dict) -> dict:
    """{probe: (subsystem, where)} of the probes that broke."""
    return {k: (v.subsystem, v.where) for k, v in results.items() if isinstance(v, probes.ProbeResult)}


def ref_gpt(seed: int):
    """The reference GPT (RoPE, its own cache and generate) on a 64-token vocabulary."""
    from faultbench.model.config import ModelConfig
    from faultbench.model.gpt import GPT

    torch.manual_seed(seed)
    return CausalLM.wrap(GPT(ModelConfig(vocab_size=64)).eval())


def nano(seed: int, bugs=()) -> CausalLM:
    model, _, _ = nanogpt.build(bugs=bugs, seed=seed)
    return CausalLM.wrap(model.eval())


def nano_batch(seed: int, shift: bool = True):
    torch.manual_seed(seed)
    return nanogpt.get_batch("train", 8, 32, shift)


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_the_clean_hf_llama(seed):
    assert run_probes(CausalLM.wrap(llama(seed)), ids(64, (4, 16), seed)) == dict.fromkeys(MODEL_PROBES)


def gpt2(seed: int) -> CausalLM:
    """HF's GPT-2 (learned absolute positions counted from the first column, even under left padding)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return CausalLM.wrap(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2,
                                                    n_head=2)).eval())


def test_the_probes_give_a_library_no_cause_to_warn_about_a_missing_attention_mask():
    # GPT-2 configured as users often do (pad = EOS), a loop of short right-padded rows "BOS ... EOS": transformers
    # warns when an unmasked input starts or ends with its pad id (a probe row ending in EOS) and when generate gets a
    # batched prompt without a mask. Its warnings come once per process (an lru_cache): cleared first, so an earlier
    # test cannot have used them up.
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logging.Logger.warning_once.cache_clear()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        with faultbench.watch(model, optimizer, report=False):
            for _ in range(2):
                ids, mask = torch.full((4, 14), 2), torch.zeros(4, 14, dtype=torch.long)
                for row, n in enumerate((11, 11, 10, 9)):
                    ids[row, :n] = torch.cat([torch.tensor([1]), torch.randint(3, 64, (n - 2,)), torch.tensor([2])])
                    mask[row, :n] = 1
                model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in seen if "attention_mask" in m or "attention mask" in m], seen


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_clean_gpt2_whose_learned_positions_make_the_shift_probes_not_applicable(seed):
    results = run_probes(gpt2(seed), ids(64, (4, 16), seed), positions="absolute")
    assert results == {**dict.fromkeys(MODEL_PROBES), "position_shift": "n/a", "attention_distribution": "n/a"}


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_the_clean_reference_gpt_through_its_own_generate(seed):
    """Its forward takes no labels (the loop computes the loss): the label probe has nothing to hand them to."""
    assert run_probes(ref_gpt(seed), ids(64, (4, 16), seed)) == {**dict.fromkeys(MODEL_PROBES),
                                                                 "label_isolation": "n/a"}


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_a_left_padded_loop_batch(seed):
    """The round takes the longest real row of a left-padded batch (pads dropped) and still holds."""
    x = ids(64, (4, 16), seed)
    mask = torch.ones_like(x)
    mask[1:, :5] = 0
    assert run_probes(CausalLM.wrap(llama(seed)), x, mask) == dict.fromkeys(MODEL_PROBES)


def test_gpt2_left_padded_by_the_loop_without_position_ids_is_a_position_finding():
    x = ids(64, (4, 16))
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # the loop's batch: row 0 left-padded
    with torch.no_grad():
        result = probes.padding_invariance(gpt2(0), x, mask)
        assert probes.padding_invariance(gpt2(0), x, mask, position_ids=probes.positions_from_mask(mask)) is None
    assert result.subsystem == "position"


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_clean_nanogpt_and_not_applicable_where_it_takes_no_such_call(seed):
    x, _ = nano_batch(seed)
    assert run_probes(nano(seed), x) == {"determinism": None, "row_isolation": None, "layers_once": None,
                                         "output_contract": None, "causality": None,
                                         "padding_invariance": "n/a", "position_shift": "n/a",
                                         "positions_used": "n/a", "attention_distribution": "n/a",
                                         "cache_consistency": "n/a", "generation": "n/a",
                                         "label_isolation": None}


@pytest.mark.parametrize("seed", [0, 1])
def test_nanogpt_not_causal_is_a_mask_leak_born_in_the_first_attention(seed):
    x, _ = nano_batch(seed)
    with torch.no_grad():
        result = probes.causality(nano(seed, ("not_causal",)), x)
    assert result.subsystem == "mask" and result.where == "transformer.h.0.attn"
    assert result.gap > 10 * result.evidence["tolerance"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("accum", [1, 2])
def test_label_alignment_on_nanogpt_fires_on_unshifted_targets_only(seed, accum):
    """The loop divides the loss by the accumulation steps: a constant integer factor must not hide the bug
    nor fire on the correct loop."""
    model, _, _ = nanogpt.build(seed=seed)
    for shift in (True, False):
        x, y = nano_batch(seed, shift)
        logits, loss = model(x, y)
        result = probes.label_alignment({"input_ids": x, "labels": y}, logits, loss / accum)
        if shift:
            assert result is None
        else:
            assert (result.subsystem, result.where) == ("loss", "loss")
            assert result.gap == pytest.approx(1 / accum, rel=1e-5)  # loop loss / own-token NLL


def test_label_alignment_says_nothing_on_a_non_finite_loss():
    x = ids(64, (2, 8))
    logits = torch.randn(2, 8, 64)
    assert probes.label_alignment({"input_ids": x}, logits, torch.tensor(float("nan"))) is None


@pytest.mark.parametrize("seed", [0, 1])
def test_label_alignment_on_hf_ignores_masked_labels_and_window_token_counts(seed):
    model = llama(seed)
    x = ids(64, (4, 16), seed)
    labels = x.clone()
    labels[0, :3] = -100  # padding ignored by the loss
    for num_items in (None, torch.tensor(150)):  # Trainer's count over an accumulation window
        out = model(input_ids=x, labels=labels, num_items_in_batch=num_items)
        assert probes.label_alignment({"input_ids": x, "labels": labels}, out.logits, out.loss) is None
    shifted_count = torch.tensor(int((labels[:, 1:] != -100).sum()))  # what Trainer counts as num_items
    for num_items in (None, shifted_count):
        with injected("hf_label_shift_off_by_one"):
            out = model(input_ids=x, labels=labels, num_items_in_batch=num_items)
        result = probes.label_alignment({"input_ids": x, "labels": labels}, out.logits, out.loss)
        assert (result.subsystem, result.where) == ("loss", "loss")


HF_FAULTS = [  # fault, the probe that must see it, its subsystem
    ("hf_causal_mask_off_by_one", "causality", "mask"),
    ("hf_padding_mask_wrong_axis", "padding_invariance", "mask"),
    ("hf_kv_cache_prepends_new_states", "cache_consistency", "model"),  # forwards through the cache disagree too
    ("hf_rope_past_len_drift", "cache_consistency", "position"),  # only generate's decode steps show it
    ("hf_gen_position_ids_left_pad", "cache_consistency", "position"),
    ("hf_cache_positions_ignore_past", "cache_consistency", "position"),
    ("hf_rope_q_only", "position_shift", "position"),
    ("hf_rotate_half_interleaved", "position_shift", "position"),
]


@pytest.mark.parametrize(("fault", "probe", "subsystem"), HF_FAULTS)
def test_hf_fault_is_found_by_its_probe_in_the_first_attention(fault, probe, subsystem):
    with injected(fault):
        results = run_probes(CausalLM.wrap(llama(0)), ids(64, (4, 16)))
    assert broken(results) == {probe: (subsystem, "model.layers.0.self_attn")}


def test_hf_attention_dropout_left_on_in_eval_is_nondeterminism_and_nothing_else():
    """Dropout acting in eval mode makes every other comparison noise: only the determinism probe speaks."""
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.3)
    with injected("hf_attention_dropout_in_eval"):
        results = run_probes(CausalLM.wrap(LlamaForCausalLM(config).eval()), ids(64, (4, 16)))
    assert broken(results) == {"determinism": ("model", "model.layers.0.self_attn")}


def test_hf_init_std_passed_as_mean_breaks_the_output_scale():
    with injected("hf_init_std_passed_as_mean"):
        results = run_probes(CausalLM.wrap(llama(0)), ids(64, (4, 16)))
    assert broken(results) == {"output_contract": ("model", "")}
    assert results["output_contract"].gap > probes.SCALE_FACTOR  # loss / ln V


class IgnoresPositions(torch.nn.Module):
    """The tiny Llama behind a forward that takes position ids and drops them (Llama then counts from 0)."""

    def __init__(self, seed: int):
        super().__init__()
        self.inner = llama(seed)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_model_that_ignores_the_position_ids_it_is_given_is_a_position_finding(seed):
    results = run_probes(CausalLM.wrap(IgnoresPositions(seed).eval()), ids(64, (4, 16), seed))
    assert broken(results)["positions_used"] == ("position", "")
    assert results["positions_used"].gap <= results["positions_used"].evidence["noise"]


def test_a_model_that_returns_probabilities_breaks_the_output_contract():
    class Probabilities(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = llama(0)

        def forward(self, input_ids, attention_mask=None):
            return torch.softmax(self.inner(input_ids=input_ids, attention_mask=attention_mask).logits, -1)

    results = run_probes(CausalLM.wrap(Probabilities().eval()), ids(64, (4, 16)))
    assert results["output_contract"].subsystem == "model"
    assert "probabilities" in results["output_contract"].message


REF_FAULTS = [  # reference faults: the probes that must see them, with subsystem and module
    ("softmax_wrong_axis", {"attention_distribution": ("model", "blocks.0.attn"),
                            "causality": ("model", "blocks.0.attn")}),  # the leak is the normalization's
    ("no_causal_mask", {"causality": ("mask", "blocks.0.attn")}),
    ("padding_mask_dropped", {"padding_invariance": ("mask", "blocks.0.attn")}),  # generate's pads: not said again
    ("rope_rotation_sign", {"position_shift": ("position", "blocks.0.attn")}),
    ("probs_then_log_softmax", {"output_contract": ("model", "")}),
    ("init_std_too_large", {"output_contract": ("model", "")}),
    ("kv_cache_wrong_index", {"cache_consistency": ("model", "blocks.0.attn")}),
    ("rope_past_len_drift", {"cache_consistency": ("position", "blocks.0.attn")}),
]


@pytest.mark.parametrize(("fault", "expected"), REF_FAULTS)
def test_reference_fault_is_found_by_the_general_probes(fault, expected):
    with injected(fault):
        results = run_probes(ref_gpt(0), ids(64, (4, 16)))
    assert broken(results) == expected


def forwards_of_a_round(lm: CausalLM, batch: torch.Tensor) -> int:
    calls = []
    handle = lm.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        run_probes(lm, batch)
    finally:
        handle.remove()
    return len(calls)


def test_a_clean_round_costs_a_fixed_handful_of_forwards():
    """HF: the plain, the mixed and the padded forward, generate's NEW_TOKENS calls, one forward over what it
    generated, and the generation probe's two generations of GEN_TOKENS calls (the reference: and one forward over
    them, its own decode loop judged), and two forwards handed labels where the model takes them;
    nanoGPT (no mask, positions or generate): the plain and the mixed forward only. Wall time printed."""
    hf, nanogpt_lm = CausalLM.wrap(llama(0)), nano(0)
    assert forwards_of_a_round(hf, ids(64, (4, 16))) == 6 + probes.NEW_TOKENS + 2 * probes.GEN_TOKENS
    assert forwards_of_a_round(ref_gpt(0), ids(64, (4, 16))) == 5 + probes.NEW_TOKENS + 2 * probes.GEN_TOKENS
    assert forwards_of_a_round(nanogpt_lm, nano_batch(0)[0]) == 4
    timings = {}
    for name, lm, batch in (("hf", hf, ids(64, (4, 16))), ("nanogpt", nanogpt_lm, nano_batch(0)[0])):
        start = time.perf_counter()
        run_probes(lm, batch)
        timings[name] = time.perf_counter() - start
    print("probe round seconds:", timings)


@pytest.mark.parametrize("seed", [0, 1])
def test_probe_detectors_through_watch_on_the_nanogpt_loop(seed):
    """not_causal and no_shift found by the probe detectors in the real loop; the clean loop gives none of theirs."""
    import faultbench

    cfg = nanogpt.TrainConfig(max_iters=3)
    outcomes, steps = {}, {}
    for bugs in ((), ("not_causal",), ("no_shift",)):
        out = nanogpt.train(cfg, bugs=bugs, seed=seed, watch=lambda m, o, s: faultbench.watch(
            m, o, scaler=s, detectors=PROBE_DETECTORS, report=False))
        outcomes[bugs] = {(f.detector, f.subsystem, f.where) for f in out["watch"].findings}
        steps[bugs] = {f.step for f in out["watch"].findings if f.detector != "bb_label_alignment"}
    assert outcomes[()] == set()
    assert outcomes[("not_causal",)] == {("bb_causality", "mask", "transformer.h.0.attn")}
    assert steps[("not_causal",)] == {0}  # before the first optimizer step
    assert outcomes[("no_shift",)] == {("bb_label_alignment", "loss", "loss")}


@pytest.fixture(scope="module")
def hf_trainer_run(tmp_path_factory):
    """``findings(fault or None, recipe)``: (detector, subsystem, where) of the probe detectors on 3 steps of the
    HF target's Trainer run, attached through the HF callback."""
    import dataclasses

    from faultbench.hf import FaultbenchCallback
    from faultbench.targets.hf.recipes import RECIPES
    from faultbench.targets.hf.run import build_run

    def findings(fault: str | None, recipe: str = "fp32") -> set:
        with injected(*([fault] if fault else [])):
            run = build_run(dataclasses.replace(RECIPES[recipe], steps=3), 0, tmp_path_factory.mktemp("hf"))
            callback = FaultbenchCallback(detectors=PROBE_DETECTORS, report=False, declare={"positions": "relative"})
            run.trainer.add_callback(callback)
            run.trainer.train()
        assert callback.watch.errors == {}
        return {(f.detector, f.subsystem, f.where) for f in callback.watch.findings}

    return findings


PROBE_DETECTORS = ["bb_eval_determinism", "bb_output_contract", "bb_causality", "bb_padding_invariance",
                   "bb_cache_consistency", "bb_position_shift", "bb_positions_used", "bb_attention_distribution",
                   "bb_label_alignment", "bb_generation", "bb_label_isolation"]


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "left_pad"])
def test_probe_detectors_are_silent_on_clean_hf_trainer_runs(hf_trainer_run, recipe):
    """bf16: accelerate wraps the forward in autocast, so the probes' own forwards run in bf16 too."""
    assert hf_trainer_run(None, recipe) == set()


@pytest.mark.parametrize(("fault", "expected"), [
    ("hf_label_shift_off_by_one", ("bb_label_alignment", "loss", "loss")),
    ("hf_causal_mask_off_by_one", ("bb_causality", "mask", "model.layers.0.self_attn")),
    ("hf_padding_mask_wrong_axis", ("bb_padding_invariance", "mask", "model.layers.0.self_attn")),
    ("hf_cache_positions_ignore_past", ("bb_cache_consistency", "position", "model.layers.0.self_attn")),
])
def test_probe_detectors_find_hf_faults_through_the_trainer_callback(hf_trainer_run, fault, expected):
    assert expected in hf_trainer_run(fault)


def test_a_model_that_raises_without_its_optional_mask_is_a_mask_finding_in_the_raising_module():
    """The reference's hand-written attention reading the additive mask as keep/drop: on an unpadded batch (no
    mask needed: None) it raises; on a padded batch it runs (NaN aside). Said by causality, naming the attention."""
    with injected("mask_keep_convention_in_attention"):
        results = run_probes(ref_gpt(0), ids(64, (4, 16)))
    assert broken(results)["causality"] == ("mask", "blocks.0.attn")
    assert "runs on a padded one" in results["causality"].message
    assert {k for k, v in results.items() if v == "n/a"} >= {"determinism", "position_shift"}  # nothing else to say


class Autocast(torch.nn.Module):
    """The HF tiny Llama with its forward under CPU autocast (as accelerate wraps it for bf16 training)."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        with torch.autocast("cpu", self.dtype, enabled=self.dtype != torch.float32):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_probe_silent_in_a_bf16_round_runs_again_at_the_end_an_fp32_one_does_not(dtype):
    """Causality holds at step 0 and breaks later (the fault injected for the end only): a bf16 round, whose
    rounding may hide an untrained model's faint leak, is checked again at the end; an fp32 round is not."""
    from faultbench.detectors.blackbox.api import WatchContext

    model = Autocast(llama(0), dtype)
    ctx = WatchContext(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.last_batch = {"input_ids": ids(64, (2, 16))}
    detector = probes.BlackBoxCausality()
    detector.on_before_step(ctx)
    assert detector.findings == [] and detector.done
    ctx.step = 16
    with injected("hf_causal_mask_off_by_one"):
        detector.on_end(ctx)
    assert [(f.step, f.subsystem) for f in detector.findings] == ([(16, "mask")] if dtype == torch.bfloat16 else [])


def test_a_probe_row_of_one_repeated_token_is_changed_to_the_batchs_other_tokens():
    x, _ = nano_batch(0)
    x[0] = x[0, 0]  # the row a round probes (the first of the longest) holds a single distinct token
    with torch.no_grad():
        result = probes.causality(nano(0, ("not_causal",)), x)
    assert result is not None and result.subsystem == "mask"  # not "not applicable"
    assert run_probes(nano(0), x)["causality"] is None  # the clean model stays silent on it
