"""The spliced copy of model/: no trace of the machinery, tracebacks that name the seam, undone injection."""

import dis
import inspect
import linecache
import re
import types
from pathlib import Path

import pytest

from faultbench.faults.inject import fault_function_source, injected, render_tree, splice_module
from faultbench.faults.registry import all_faults
from faultbench.harness.scenario import run_scenario
from faultbench.model.seams import SEAMS, resolve

ROOT = Path(__file__).resolve().parents[2]
FAULTS = all_faults()
# That the spliced copy runs exactly as the injected reference is asserted for every fault by
# tests/test_practice.py::test_exercise_round_trip (the copy is an exercise there).


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_spliced_tree_has_the_fault_and_no_trace_of_the_machinery(tmp_path, fault_id):
    spec = FAULTS[fault_id]
    tree = render_tree(tmp_path / "copy", [fault_id])
    for path in (tree / "model").rglob("*.py"):
        text = path.read_text()
        assert fault_id not in text
        assert not re.search(r"\bfaults?\b|inject", text, re.IGNORECASE), path
    # the fault's body stands in each seam's module; every other module is the clean one
    spliced = {_source_file(seam) for seam in spec.seams}
    for seam, fn in spec.replacements.items():
        assert fault_function_source(seam, fn) in (tree / _source_file(seam)).read_text(), seam
    for path in (ROOT / "model").rglob("*.py"):
        rel = path.relative_to(ROOT)
        assert ((tree / rel).read_text() == path.read_text()) == (rel not in spliced), rel


def test_traceback_names_the_seam_not_the_fault_module():
    crashing = [f for f, spec in FAULTS.items()
                if spec.manifest.check.startswith("crash") and not spec.manifest.scenario.startswith("ddp")]
    assert crashing, "no crash fault registered"
    # the splice is one mechanism for every fault: the three shortest crash scenarios of distinct seam modules
    # show it (each run lasts to its crash; all of them cost a minute)
    by_module = {}
    for fault_id in sorted(crashing, key=lambda f: (FAULTS[f].manifest.steps, f)):
        by_module.setdefault(FAULTS[fault_id].seams[0].rsplit(".", 1)[0], fault_id)
    for fault_id in list(by_module.values())[:3]:
        m = FAULTS[fault_id].manifest
        out = run_scenario(m.scenario, m.variant, m.steps, m.seeds[0], (fault_id,))
        assert out.crash, fault_id
        assert "faults/" not in out.crash["traceback"] and 'File "' + str(ROOT / "model") in out.crash["traceback"]


def _source_file(seam: str) -> Path:
    return Path(inspect.getsourcefile(inspect.unwrap(resolve(seam)))).relative_to(ROOT)


def _instructions(code: types.CodeType) -> tuple:
    """What a code object runs, line numbers aside: its (opname, argument) pairs, nested code included."""
    return tuple((i.opname, _instructions(i.argval) if isinstance(i.argval, types.CodeType) else i.argval)
                 for i in dis.get_instructions(code))


def _seam_code() -> dict[str, types.CodeType]:
    """The code object each seam of the table runs now."""
    return {seam: inspect.unwrap(resolve(seam)).__code__ for seam in SEAMS}


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_injection_runs_the_fault_in_its_seams_only_and_is_undone_on_exit(fault_id):
    spec = FAULTS[fault_id]
    before = _seam_code()
    with injected(fault_id):
        inside = _seam_code()
    for seam, fn in spec.replacements.items():
        assert _instructions(inside[seam]) == _instructions(inspect.unwrap(fn).__code__), f"{seam} runs no fault"
        assert inside[seam].co_filename == before[seam].co_filename  # tracebacks name the seam's file
    changed = [s for s in SEAMS if s not in spec.seams and _instructions(inside[s]) != _instructions(before[s])]
    assert changed == [], "seams the fault does not replace ran other code"
    assert {s for s, code in _seam_code().items() if code is not before[s]} == set()


def test_injection_is_undone_when_the_run_raises():
    """A corpus built under a tokenizer fault and a data fault, then an error: on exit the seams, the spliced
    source lines and the tokenizer's disk cache are the clean ones again, and the corpus is rebuilt clean."""
    import faultbench.model.tokenizer as model_tokenizer
    from faultbench.model.config import DataConfig
    from faultbench.model.data import load_corpus

    cfg = DataConfig(num_docs=300)  # small: the faulty tokenizer trains from scratch in a private cache
    clean_corpus = load_corpus(cfg)
    files = {str(ROOT / _source_file(s)) for s in SEAMS}
    before, lines, shared_cache = _seam_code(), {f: linecache.cache.get(f) for f in files}, model_tokenizer.cache_dir()
    with pytest.raises(RuntimeError, match="mid-run"), injected("missing_bos", "truncation_drops_eos"):
        assert model_tokenizer.cache_dir() != shared_cache
        assert load_corpus(cfg).train != clean_corpus.train
        raise RuntimeError("mid-run")
    assert {s for s, code in _seam_code().items() if code is not before[s]} == set()
    assert {f for f in files if linecache.cache.get(f) != lines[f]} == set()
    assert model_tokenizer.cache_dir() == shared_cache
    assert load_corpus(cfg).train == clean_corpus.train


def test_several_faults_compose_and_two_on_one_seam_are_refused():
    import faultbench.model.attention as model_attention
    import faultbench.model.loss as model_loss
    from faultbench.faults.registry import FaultError

    loss_fault = "label_shift_off_by_one"
    mask_fault = next(f for f, s in FAULTS.items() if s.seams == ("model.attention.build_attention_mask",))
    before = (model_loss.lm_loss.__code__, model_attention.build_attention_mask.__code__)
    with injected(loss_fault, mask_fault):
        after = (model_loss.lm_loss.__code__, model_attention.build_attention_mask.__code__)
        assert all(a is not b for a, b in zip(after, before, strict=True))
    assert (model_loss.lm_loss.__code__, model_attention.build_attention_mask.__code__) == before
    twins = [f for f, s in FAULTS.items() if "model.loss.lm_loss" in s.seams][:2]
    with pytest.raises(FaultError, match="both replace model.loss.lm_loss"):
        with injected(*twins):
            pass


def test_a_name_defined_twice_is_spliced_where_python_binds_it():
    # the later def is the live one: a fault spliced into the earlier would change dead code and never run
    source = "def f():\n    return 1\n\n\ndef f():\n    return 2\n\n\nclass C:\n    def g(self):\n        return 3\n"
    spliced = splice_module(source, {"f": "def f():\n    return 20\n", "C.g": "    def g(self):\n        return 30\n"})
    namespace: dict = {}
    exec(compile(spliced, "<spliced>", "exec"), namespace)
    assert namespace["f"]() == 20 and namespace["C"]().g() == 30
    assert "return 1\n" in spliced  # the dead definition is left as it was
