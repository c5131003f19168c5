"""The behavioural probes of the black-box track: silent on the clean HF tiny Llama and the clean nanoGPT
model (2 seeds each); each broken property found, with its subsystem and the module where it is born, on the
nanoGPT bugs and on HF faults injected into transformers; the probe detectors through faultbench.watch."""

from __future__ import annotations

import time

import pytest
import torch

from detectors.api import NotApplicable
from detectors.blackbox import probes
from detectors.blackbox.lm import CausalLM
from faults.inject import injected
from tests.watch import nanogpt
from tests.watch.test_lm import ids, llama

torch.set_num_threads(1)

MODEL_PROBES = ("causality", "padding_invariance", "cache_consistency", "position_shift")


def run_probes(lm: CausalLM, batch: torch.Tensor) -> dict:
    """{probe: ProbeResult | None | "n/a"} of every model probe on ``batch``, in no-grad eval mode."""
    out = {}
    with torch.no_grad():
        for name in MODEL_PROBES:
            try:
                out[name] = getattr(probes, name)(lm, batch)
            except NotApplicable:
                out[name] = "n/a"
    return out


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


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_clean_gpt2_whose_learned_positions_make_the_shift_probe_not_applicable(seed):
    assert run_probes(gpt2(seed), ids(64, (4, 16), seed)) == {"causality": None, "padding_invariance": None,
                                                              "cache_consistency": None, "position_shift": "n/a"}


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
    assert run_probes(nano(seed), x) == {"causality": None, "padding_invariance": "n/a",
                                         "cache_consistency": "n/a", "position_shift": "n/a"}


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
    ("hf_kv_cache_prepends_new_states", "cache_consistency", "model"),
    ("hf_rope_past_len_drift", "cache_consistency", "position"),  # only generate's decode steps show it
    ("hf_gen_position_ids_left_pad", "cache_consistency", "position"),
    ("hf_rope_q_only", "position_shift", "position"),
]


@pytest.mark.parametrize(("fault", "probe", "subsystem"), HF_FAULTS)
def test_hf_fault_is_found_by_its_probe_in_the_first_attention(fault, probe, subsystem):
    with injected(fault):
        lm = CausalLM.wrap(llama(0))
        with torch.no_grad():
            result = getattr(probes, probe)(lm, ids(64, (4, 16)))
    assert result.subsystem == subsystem
    assert result.where == "model.layers.0.self_attn"


def test_a_probe_round_costs_a_few_forwards():
    """Wall time of one round of the four model probes (printed for the report; bounded loosely)."""
    timings = {}
    for name, lm, batch in (("hf", CausalLM.wrap(llama(0)), ids(64, (4, 16))), ("nanogpt", nano(0), nano_batch(0)[0])):
        start = time.perf_counter()
        run_probes(lm, batch)
        timings[name] = time.perf_counter() - start
    print("probe round seconds:", timings)
    assert max(timings.values()) < 5.0


@pytest.mark.parametrize("seed", [0, 1])
def test_probe_detectors_through_watch_on_the_nanogpt_loop(seed):
    """not_causal and no_shift found by the probe detectors in the real loop; the clean loop gives none of theirs."""
    import faultbench

    cfg = nanogpt.TrainConfig(max_iters=3)
    outcomes = {}
    for bugs in ((), ("not_causal",), ("no_shift",)):
        out = nanogpt.train(cfg, bugs=bugs, seed=seed, watch=lambda m, o, s: faultbench.watch(
            m, o, scaler=s, detectors=PROBE_DETECTORS, report=False))
        outcomes[bugs] = {(f.detector, f.subsystem, f.where) for f in out["watch"].findings}
    assert outcomes[()] == set()
    assert outcomes[("not_causal",)] == {("bb_causality", "mask", "transformer.h.0.attn")}
    assert outcomes[("no_shift",)] == {("bb_label_alignment", "loss", "loss")}


@pytest.fixture(scope="module")
def hf_trainer_run(tmp_path_factory):
    """``findings(fault or None, recipe)``: (detector, subsystem, where) of the probe detectors on 3 steps of the
    HF target's Trainer run, attached through the HF callback."""
    import dataclasses

    from faultbench.hf import FaultbenchCallback
    from targets.hf.recipes import RECIPES
    from targets.hf.run import build_run

    def findings(fault: str | None, recipe: str = "fp32") -> set:
        with injected(*([fault] if fault else [])):
            run = build_run(dataclasses.replace(RECIPES[recipe], steps=3), 0, tmp_path_factory.mktemp("hf"))
            callback = FaultbenchCallback(detectors=PROBE_DETECTORS, report=False)
            run.trainer.add_callback(callback)
            run.trainer.train()
        assert callback.watch.errors == {}
        return {(f.detector, f.subsystem, f.where) for f in callback.watch.findings}

    return findings


PROBE_DETECTORS = ["bb_causality", "bb_padding_invariance", "bb_cache_consistency", "bb_position_shift",
                   "bb_label_alignment"]


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
