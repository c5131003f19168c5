"""faultbench.guard: a program's crash located when no watch saw it, by what the program had built and by the place
in code to act on (whose code it is); silent on a program that runs, and on a crash a watch located."""

from __future__ import annotations

import pytest
import torch

import faultbench
from faultbench.guard import crash_of


def crashed(program) -> tuple[Exception, faultbench.guard]:
    """``program()`` run inside a guard; the exception it raised (which must propagate unchanged) and the guard."""
    g = faultbench.guard(report=False)
    with pytest.raises(Exception) as info:  # noqa: B017 - each program raises its own
        with g:
            program()
    return info.value, g


def load_corpus(path):
    return {"docs": []}[path]  # a KeyError in the user's own data code


class Model(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(8, width)
        self.init_tables(width)

    def init_tables(self, width):
        return torch.arange(width).view(3, -1)  # a shape error while the model is built


def build_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=-1.0)  # torch refuses it


def configure(model, settings):
    return settings.weight_decay  # an AttributeError in the user's setup code after the model


def test_a_crash_before_any_model_is_the_data_and_names_the_users_function_file_and_line():
    exc, g = crashed(lambda: load_corpus("train.txt"))
    assert isinstance(exc, KeyError) and exc.args == ("train.txt",)  # unchanged
    [finding] = g.findings
    assert (finding.detector, finding.subsystem, finding.step) == ("bb_crash_site", "data", 0)
    code = finding.evidence["code"]
    assert code["qualname"] == f"{__name__}.load_corpus" and code["file"] == __file__ and code["library"] is None
    assert code["line"] == load_corpus.__code__.co_firstlineno + 1
    assert finding.where == code["qualname"] and "test_guard.py:" in finding.message
    assert finding.evidence["parameters"] == 0


def test_a_crash_inside_a_module_being_built_is_the_model():
    exc, g = crashed(lambda: Model(10))
    assert isinstance(exc, RuntimeError)
    [finding] = g.findings
    assert finding.subsystem == "model" and finding.evidence["code"]["qualname"] == f"{__name__}.Model.init_tables"
    assert finding.evidence["code"]["method_of_module"] and finding.evidence["parameters"] == 1


def test_a_crash_inside_torch_names_torchs_component_and_the_users_call_into_it():
    exc, g = crashed(lambda: build_optimizer(Model(9)))
    assert isinstance(exc, ValueError)
    [finding] = g.findings
    assert finding.subsystem == "optimizer" and finding.where == "optimizer"
    assert finding.evidence["code"]["qualname"] == f"{__name__}.build_optimizer"  # torch's frames are not the place


def test_a_crash_after_the_model_outside_any_library_is_what_surrounds_the_model():
    exc, g = crashed(lambda: configure(Model(9), object()))
    assert isinstance(exc, AttributeError)
    [finding] = g.findings
    assert finding.subsystem == "optimizer" and finding.confidence < 0.4  # a guess, and ranked as one
    assert finding.evidence["code"]["qualname"] == f"{__name__}.configure"


def test_a_crash_in_an_installed_library_says_whose_code_it_is():
    from packaging.version import Version

    exc, g = crashed(lambda: Version("not a version"))
    [finding] = g.findings
    code = finding.evidence["code"]
    assert code["qualname"].startswith("packaging.version.") and code["library"].startswith("packaging ")
    assert "not your code" in finding.message


def test_a_program_that_runs_and_a_crash_a_watch_located_draw_nothing_from_the_guard():
    model = torch.nn.Linear(4, 4)
    with faultbench.guard(report=False) as g:
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    assert g.findings == []

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ZeroDivisionError), faultbench.guard(report=False) as g:
        with faultbench.watch(model, opt, report=False) as w:
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            raise ZeroDivisionError("the loop raised")
    assert g.findings == [] and [f.detector for f in w.findings] == ["bb_crash_site"]
    assert w.findings[0].evidence["code"]["qualname"].endswith(
        "test_a_program_that_runs_and_a_crash_a_watch_located_draw_nothing_from_the_guard")


def test_the_guard_leaves_nothing_behind_and_cannot_be_entered_twice():
    g = faultbench.guard(report=False)
    with g:
        torch.nn.Linear(2, 2)
        with pytest.raises(RuntimeError, match="already on"), g:
            pass
    seen = g.parameters
    torch.nn.Linear(2, 2)  # after exit: the registration hook is gone
    assert seen == 2 and g.parameters == 2


def test_the_code_place_skips_python_and_torch_and_is_none_when_only_they_ran():
    try:
        torch.ones(2) @ torch.ones(3)
    except RuntimeError as e:
        assert crash_of(e)["code"]["qualname"].endswith("test_the_code_place_skips_python_and_torch_and_is_none_"
                                                        "when_only_they_ran")
    try:
        int("x")
    except ValueError as e:
        e.__traceback__ = None
        assert crash_of(e)["code"] is None and crash_of(e)["frames"] == []
