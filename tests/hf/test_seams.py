"""The HF seam table: every name is a real, plain Python function of the installed stack (so a fault can
replace its code and ``faultbench show`` can diff it), each subsystem has at least 3 seams, and the
target cannot reach the hub."""

from __future__ import annotations

import inspect

import pytest

from faultbench import targets
from faultbench.targets.hf.seams import SEAMS, resolve, seams

SUBSYSTEMS = ("data", "collate", "mask", "position", "model", "loss",
              "optimizer", "precision", "checkpoint", "distributed", "eval")


@pytest.mark.parametrize("name", list(SEAMS))
def test_seam_is_a_plain_function_with_source(name):
    fn = inspect.unwrap(resolve(name))
    assert inspect.isfunction(fn), f"{name} resolves to {type(fn).__name__}, not a Python function"
    assert f"def {fn.__name__}(" in inspect.getsource(fn)
    assert SEAMS[name] in SUBSYSTEMS


def test_every_subsystem_has_three_seams():
    counts = {s: sum(v == s for v in SEAMS.values()) for s in SUBSYSTEMS}
    assert min(counts.values()) >= 3, counts


def test_seam_locations_name_the_installed_files():
    table = {s.name: s for s in seams()}
    assert table["transformers.models.llama.modeling_llama.apply_rotary_pos_emb"].file == \
        "transformers/models/llama/modeling_llama.py"
    assert table["targets.hf.data.wrap_tokenizer"].file == "targets/hf/data.py"
    assert all(s.line > 0 for s in table.values())


def test_unknown_seam_is_a_clear_error():
    with pytest.raises(ValueError, match="HF target"):
        resolve("transformers.models.llama.modeling_llama.no_such_function")


def test_target_interface():
    hf = targets.get("hf")
    assert hf.seams() == SEAMS and hf.resolve is resolve
    assert {"fp32", "bf16", "left_pad", "accum", "resume", "ddp"} <= set(hf.recipes())
    assert targets.get("ref").seams()["model.loss.lm_loss"] == "loss"
    with pytest.raises(ValueError, match="did you mean 'hf'"):
        targets.get("hff")


def test_hub_access_fails_loudly():
    """HF_HUB_OFFLINE is set by importing the target: a from_pretrained of a hub id raises, never downloads."""
    from transformers import AutoConfig

    with pytest.raises(OSError, match="offline|cannot find|connect"):
        AutoConfig.from_pretrained("hf-internal-testing/tiny-random-LlamaForCausalLM")
