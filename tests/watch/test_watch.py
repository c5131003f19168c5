"""``faultbench.watch`` as a context manager: what it hands detectors, what it leaves behind, how it reports.

Spy detectors are registered for a test only (``monkeypatch.setitem`` on the registry) and selected by id.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import faultbench
from faultbench.detectors.api import DETECTORS, Finding, NotApplicable, all_detectors
from faultbench.detectors.blackbox.api import BlackBoxDetector
from tests.watch.nanogpt import TrainConfig, build, get_batch

CFG = TrainConfig(amp=True, gradient_accumulation_steps=2)


class Spy(BlackBoxDetector):
    """Records every hook call; reports one finding at the end."""

    id = "test_spy"
    family = "model"
    description = "test spy"

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def on_start(self, ctx):
        self.calls.append(("start",))

    def on_forward(self, ctx, batch, logits, loss):
        self.calls.append(("forward", batch, logits, loss))

    def on_eval_forward(self, ctx, batch, logits):
        self.calls.append(("eval", batch, logits))

    def on_after_step(self, ctx, record):
        self.calls.append(("step", record))

    def on_end(self, ctx):
        self.calls.append(("end",))
        self.report(ctx, "model", "transformer.h.0", "spy", {"tensor": torch.ones(2)}, confidence=0.4)

    def on_crash(self, ctx, crash):
        self.calls.append(("crash", crash))


class Excused(BlackBoxDetector):
    id = "test_excused"
    family = "model"
    description = "test: not applicable at every forward"
    calls = 0

    def on_forward(self, ctx, batch, logits, loss):
        type(self).calls += 1
        raise NotApplicable("the loop is not what I assume")


class Broken(BlackBoxDetector):
    id = "test_broken"
    family = "model"
    description = "test: a detector with a bug"

    def on_after_step(self, ctx, record):
        raise RuntimeError("detector bug")


@pytest.fixture
def spies(monkeypatch):
    all_detectors()
    for cls in (Spy, Excused, Broken):
        monkeypatch.setitem(DETECTORS, cls.id, cls)
    Excused.calls = 0


def loop(w_kwargs: dict, steps: int = 2):
    """A short nanoGPT-style loop (accumulation 2, GradScaler) under watch; returns (watch, model, optimizer)."""
    torch.manual_seed(0)
    model, optimizer, scaler = build(CFG)
    with faultbench.watch(model, optimizer, scaler=scaler, **{"report": False, **w_kwargs}) as w:
        for _ in range(steps):
            for _ in range(CFG.gradient_accumulation_steps):
                x, y = get_batch("train", 4, 16)
                _, loss = model(x, targets=y)  # keyword: the watch binds it by the forward's signature
                scaler.scale(loss / CFG.gradient_accumulation_steps).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            model(get_batch("val", 2, 16)[0])
        model.train()
    return w, model, optimizer


def hook_counts(model, optimizer) -> tuple:
    params = list(model.parameters())
    return (len(model._forward_pre_hooks), len(model._forward_hooks), len(optimizer._optimizer_step_pre_hooks),
            len(optimizer._optimizer_step_post_hooks), sum(len(p._backward_hooks or {}) for p in params),
            sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params))


def test_hooks_hand_detectors_the_loops_batches_logits_losses_and_steps(spies):
    w, model, _ = loop({"detectors": ["test_spy"]})
    spy = w.detectors[0]
    kinds = [c[0] for c in spy.calls]
    assert kinds == ["start"] + (["forward"] * 2 + ["step"]) * 2 + ["eval", "end"]
    forward = spy.calls[1]
    assert set(forward[1]) == {"input_ids", "labels"} and forward[1]["input_ids"].shape == (4, 16)
    assert forward[2].shape == (4, 16, model.config.vocab_size) and forward[3].dim() == 0
    assert set(spy.calls[-2][1]) == {"input_ids"}  # the eval call: positional ids, no targets
    record = spy.calls[3][1]
    assert (record.step, record.micro_batches, record.skipped) == (1, 2, 0)
    assert record.scale == 65536.0 and record.grad_norm > 0 and record.backward_norm > record.grad_norm
    assert w.ctx.last_batch is spy.calls[-4][1]  # the last training forward's batch, not the eval call's


def test_hooks_are_removed_on_exit_and_on_a_crash(spies):
    model, optimizer, _ = build(CFG)
    before = hook_counts(model, optimizer)
    assert before == (0, 0, 0, 0, 0, 0)
    w, model, optimizer = loop({"detectors": ["test_spy"]})
    assert hook_counts(model, optimizer) == before and not w.attached
    model, optimizer, scaler = build(CFG)
    with pytest.raises(KeyError), faultbench.watch(model, optimizer, scaler=scaler, report=False) as w:
        assert hook_counts(model, optimizer) != before
        raise KeyError("x")
    assert hook_counts(model, optimizer) == before


def test_the_users_exception_is_passed_to_on_crash_then_reraised_unchanged(spies):
    model, optimizer, scaler = build(CFG)
    error = ValueError("the user's own error")
    with pytest.raises(ValueError) as caught:
        with faultbench.watch(model, optimizer, scaler=scaler, detectors=["test_spy"], report=False) as w:
            raise error
    assert caught.value is error
    crash = w.detectors[0].calls[-1]
    assert crash[0] == "crash" and crash[1]["type"] == "ValueError" and crash[1]["message"] == "the user's own error"
    assert crash[1]["frames"][-1][2] == "test_the_users_exception_is_passed_to_on_crash_then_reraised_unchanged"
    assert ("end",) not in w.detectors[0].calls


def test_findings_round_trip_through_json(spies, tmp_path):
    out = tmp_path / "watch.json"
    w, _, _ = loop({"detectors": ["test_spy"], "out": out}, steps=1)
    data = json.loads(out.read_text())
    assert data == json.loads(w.to_json())
    assert data["steps"] == 1 and len(data["findings"]) == 1
    finding = Finding(**data["findings"][0])
    assert finding == w.findings[0] and finding.where == "transformer.h.0" and finding.evidence["tensor"] == [1, 1]
    # the watch names the module's code: its class's forward, file and line (the user's code: no library)
    code = finding.evidence["code"]
    assert code["qualname"] == "tests.watch.nanogpt.Block.forward"
    assert code["file"].endswith("tests/watch/nanogpt.py") and not code["library"]


def test_not_applicable_is_said_once_and_a_detector_error_never_breaks_the_loop(spies, capsys):
    w, _, _ = loop({"detectors": ["test_excused", "test_broken", "test_spy"], "report": True}, steps=2)
    assert w.ctx.step == 2  # the loop ran to its end
    assert Excused.calls == 1 and w.not_applicable == {"test_excused": "the loop is not what I assume"}
    assert w.errors == {"test_broken": "on_after_step: RuntimeError: detector bug"}
    assert [f.detector for f in w.findings] == ["test_spy"]  # neither is a finding
    printed = capsys.readouterr().err
    assert printed.strip() == w.report()
    assert printed.count("test_excused: the loop is not what I assume") == 1
    assert "detector error: test_broken" in printed and "1 finding over 2 optimizer steps" in printed


def test_observe_gives_the_loss_of_a_model_that_returns_only_logits(spies):
    model, optimizer, _ = build(TrainConfig())
    with faultbench.watch(model, optimizer, detectors=["test_spy"], report=False) as w:
        losses = []
        for _ in range(2):
            x, y = get_batch("train", 4, 16)
            logits, _ = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            w.observe(loss=loss)
            losses.append(loss.item())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert w.ctx.history[0].loss == pytest.approx(sum(losses) / 2)
    assert w.ctx.history[0].scale is None  # no scaler given


def test_watch_is_callable_however_faultbench_was_imported():
    """``faultbench.watch`` is a function and, once imported, a submodule too: both must call ``watch``."""
    from faultbench.watch import Watch

    model, optimizer, _ = build(TrainConfig())
    for call in (faultbench.watch, sys.modules["faultbench.watch"]):
        with call(model, optimizer, detectors=[], report=False) as w:
            pass
        assert isinstance(w, Watch) and w.findings == []


def test_only_black_box_detectors_are_accepted():
    model, optimizer, _ = build(TrainConfig())
    white = next(d for d, cls in all_detectors().items() if cls.track == "white-box")
    with pytest.raises(ValueError, match="not black-box detectors"):
        faultbench.watch(model, optimizer, detectors=[white])


class SampledSpy(Spy):
    """The spy, declared sampled: its training-forward checks run on sampled steps only."""

    id = "test_sampled_spy"
    sampled = True


def test_a_sampled_detector_sees_the_first_steps_then_every_fourth_and_the_others_every_step(spies, monkeypatch):
    monkeypatch.setitem(DETECTORS, SampledSpy.id, SampledSpy)
    w, _, _ = loop({"detectors": ["test_spy", "test_sampled_spy"]}, steps=10)
    every, sampled = w.detectors

    def steps_seen(spy):  # the optimizer steps done before each training forward the spy saw
        seen, done = [], 0
        for call in spy.calls:
            done += call[0] == "step"
            if call[0] == "forward":
                seen.append(done)
        return sorted(set(seen))

    assert steps_seen(every) == list(range(10))
    assert steps_seen(sampled) == [0, 1, 2, 3, 4, 8]
    assert [c[0] for c in sampled.calls].count("step") == 10  # step records and evaluations are never sampled
    assert [c[0] for c in sampled.calls].count("eval") == 1


def test_a_forgotten_zero_grad_is_still_found_with_the_stale_check_on_sampled_steps_only():
    torch.manual_seed(0)
    model, optimizer, _ = build(TrainConfig())
    with faultbench.watch(model, optimizer, detectors=["bb_grads_cleared"], report=False) as w:
        for _ in range(10):
            x, y = get_batch("train", 4, 16)
            model(x, targets=y)[1].backward()
            optimizer.step()  # zero_grad forgotten
    (finding,) = w.findings
    assert finding.subsystem == "optimizer" and finding.step == 3  # stale at steps 2 and 3, as with every step
    assert [s["step"] for s in finding.evidence["steps"]] == [2, 3]


@pytest.mark.parametrize(("model", "optimizer", "words"), [
    (None, "adamw", "model must be a torch.nn.Module, not NoneType"),
    ("linear", None, "optimizer must be a torch.optim.Optimizer"),
    ("linear", "a string", "not str"),
])
def test_a_watch_of_something_else_than_a_model_and_optimizer_is_refused_in_one_line(model, optimizer, words):
    linear = torch.nn.Linear(2, 2)
    model = linear if model == "linear" else model
    optimizer = torch.optim.AdamW(linear.parameters()) if optimizer == "adamw" else optimizer
    with pytest.raises(TypeError, match=words) as info:
        faultbench.watch(model, optimizer)
    assert "\n" not in str(info.value)


def test_a_watch_entered_twice_is_refused_and_keeps_watching_once():
    model, optimizer, _ = build(TrainConfig(), seed=0)
    w = faultbench.watch(model, optimizer, report=False, detectors=[])
    with w:
        with pytest.raises(RuntimeError, match="already watching"), w:
            pass
        x, y = get_batch("train", 4, 16)
        model(x, y)[1].backward()
        optimizer.step()
    assert [r.step for r in w.ctx.history] == [1] and not w.attached  # one step counted once, hooks gone


def test_a_finding_against_the_users_golden_is_theirs_even_where_the_code_is_a_librarys():
    """transformers' linear warmup built from the user's arguments: against known-good runs with 2 warmup steps, a
    run told 400 is found by the LR check at the library's schedule function. A comparison with the user's own
    known-good runs reports a change the user made: it keeps its rank (first, by confidence) instead of coming after
    the consequence it explains (the smaller updates), as a library's finding would."""
    from transformers import get_linear_schedule_with_warmup

    def run(warmup: int, seed: int, golden=None):
        torch.manual_seed(seed)
        model, optimizer, _ = build(TrainConfig(), seed=seed)
        schedule = get_linear_schedule_with_warmup(optimizer, warmup, 100)
        with faultbench.watch(model, optimizer, scheduler=schedule, golden=golden, report=False) as w:
            for _ in range(10):
                x, y = get_batch("train", 4, 16)
                model(x, targets=y)[1].backward()
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        return w

    w = run(400, 0, faultbench.record_golden([run(2, 1), run(2, 2)]))
    top = w.findings[0]
    assert (top.detector, top.where) == ("bb_golden_lr", "scheduler")
    assert top.evidence["code"]["library"].startswith("transformers ")  # the place is the library's code
    assert "bb_golden_update" in [f.detector for f in w.findings[1:]]  # the consequence, ranked after its cause


def test_junit_gives_a_ci_gate_a_failure_per_finding_and_skips_what_does_not_apply(tmp_path):
    """JUnit XML at exit (``junit=``): the forgotten zero_grad is a failure of bb_grads_cleared, a check whose
    assumption the loop does not meet is skipped, every other detector passes."""
    import xml.etree.ElementTree as ET

    torch.manual_seed(0)
    model, optimizer, _ = build(TrainConfig())
    with faultbench.watch(model, optimizer, report=False, junit=tmp_path / "watch.xml") as w:
        for _ in range(6):
            x, y = get_batch("train", 4, 16)
            model(x, targets=y)[1].backward()
            optimizer.step()  # zero_grad forgotten
    suite = ET.parse(tmp_path / "watch.xml").getroot()
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert set(cases) == {d.id for d in w.detectors}
    failed = {name for name, c in cases.items() if c.find("failure") is not None}
    assert failed == {f.detector for f in w.findings} and "bb_grads_cleared" in failed
    skipped = {name for name, c in cases.items() if c.find("skipped") is not None}
    assert skipped == set(w.not_applicable) - failed and skipped
    assert int(suite.get("failures")) == len(failed) and int(suite.get("tests")) == len(cases)
    failure = cases["bb_grads_cleared"].find("failure")
    assert failure.get("type") == "optimizer" and "at step" in failure.text


def test_out_in_a_missing_folder_is_refused_before_the_loop(tmp_path):
    model, optimizer, _ = build(TrainConfig(), seed=0)
    with pytest.raises(ValueError, match="its folder does not exist"):
        faultbench.watch(model, optimizer, out=tmp_path / "missing" / "w.json")
    with pytest.raises(ValueError, match="junit=.* its folder does not exist"):
        faultbench.watch(model, optimizer, junit=tmp_path / "missing" / "w.xml")


def test_a_failing_out_write_never_replaces_the_loops_exception(tmp_path, capsys):
    model, optimizer, _ = build(TrainConfig(), seed=0)
    folder = tmp_path / "gone"
    folder.mkdir()
    w = faultbench.watch(model, optimizer, report=False, detectors=[], out=folder / "w.json")
    folder.rmdir()  # the folder vanished during the loop
    with pytest.raises(KeyError, match="the loop's own"), w:
        raise KeyError("the loop's own")
    assert "could not write out=" in capsys.readouterr().err


def test_not_applicable_checks_are_summed_up_one_line_per_reason(spies, monkeypatch):
    class AlsoExcused(Excused):
        id = "test_also_excused"

    class ExcusedLongly(Excused):
        id = "test_excused_longly"

        def on_forward(self, ctx, batch, logits, loss):
            raise NotApplicable("a reason of many words " * 20)

    for cls in (AlsoExcused, ExcusedLongly):
        monkeypatch.setitem(DETECTORS, cls.id, cls)
    w, _, _ = loop({"detectors": ["test_excused", "test_also_excused", "test_excused_longly"]}, steps=1)
    lines = w.report().splitlines()[1:]
    assert lines[0] == "not applicable: 3 checks (w.not_applicable says each why)"
    assert lines[1] == "  test_excused, test_also_excused: the loop is not what I assume"
    assert lines[2].startswith("  test_excused_longly: a reason of many words") and lines[2].endswith("...")
    assert len(lines) == 3 and len(w.not_applicable["test_excused_longly"]) > 400  # kept whole


def test_start_and_stop_watch_a_loop_that_is_not_one_block_as_the_with_block_does():
    def run(form):
        torch.manual_seed(0)
        model, optimizer, _ = build(TrainConfig())
        w = faultbench.watch(model, optimizer, report=False)
        if form == "with":
            with w:
                _steps_without_zero_grad(model, optimizer)
        else:
            w.start()
            assert w.attached
            try:
                _steps_without_zero_grad(model, optimizer)
            finally:
                w.stop()
        assert not w.attached and hook_counts(model, optimizer) == (0, 0, 0, 0, 0, 0)
        return [(f.detector, f.subsystem, f.step) for f in w.findings]

    found = run("start/stop")
    assert found == run("with") and ("bb_grads_cleared", "optimizer", 3) in found  # found at the 3rd step


def test_stop_with_the_loops_exception_locates_it_and_does_not_raise():
    model, optimizer, _ = build(TrainConfig())
    w = faultbench.watch(model, optimizer, report=False).start()
    try:
        raise IndexError("index 70 is out of bounds")
    except IndexError as e:
        w.stop(e)
    assert not w.attached and [f.detector for f in w.findings] == ["bb_crash_site"]


def _steps_without_zero_grad(model, optimizer, steps: int = 3):
    for _ in range(steps):
        x, y = get_batch("train", 4, 16)
        _, loss = model(x, targets=y)
        loss.backward()
        optimizer.step()


def _warmup(step):
    return min(1.0, (step + 1) / 10)


def test_a_finding_on_the_scheduler_names_its_schedule_function(spies, monkeypatch):
    class SchedulerSpy(Spy):
        id = "test_scheduler_spy"

        def on_end(self, ctx):
            self.report(ctx, "optimizer", "scheduler", "spy")

    monkeypatch.setitem(DETECTORS, SchedulerSpy.id, SchedulerSpy)
    model, optimizer, _ = build(TrainConfig())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup)
    with faultbench.watch(model, optimizer, scheduler=schedule, detectors=["test_scheduler_spy"], report=False) as w:
        _steps_without_zero_grad(model, optimizer, steps=1)
    code = w.findings[0].evidence["code"]
    assert code["qualname"] == f"{__name__}._warmup" and code["line"] == _warmup.__code__.co_firstlineno


def test_the_report_says_when_a_findings_place_is_a_librarys_code(spies, monkeypatch):
    """A place in an installed library's code is labelled with the package and version. A module of the model is the
    user's whatever its class (torch's Linear keeps its rank); other library code (here transformers' schedule
    function) is ranked after the user's findings, and a golden whose known-good runs made the same finding
    acknowledges it: listed apart, no longer among the findings."""
    from transformers import get_constant_schedule

    class ModuleSpy(Spy):
        id = "test_module_spy"

        def on_end(self, ctx):
            self.report(ctx, "model", "1", "spy on an installed library's module")  # torch's Linear
            self.report(ctx, "model", "0", "spy on the user's module", confidence=0.4)
            self.report(ctx, "optimizer", "scheduler", "spy on a library's schedule", confidence=0.9)

    class Users(torch.nn.Module):
        def forward(self, x):
            return x

    monkeypatch.setitem(DETECTORS, ModuleSpy.id, ModuleSpy)
    model = torch.nn.Sequential(Users(), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def one_step(golden=None):
        with faultbench.watch(model, optimizer, scheduler=get_constant_schedule(optimizer), golden=golden,
                              detectors=["test_module_spy"], report=False) as w:
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        return w

    w = one_step()
    assert [f.where for f in w.findings] == ["1", "0", "scheduler"]  # the schedule's 0.9 ranked last: a library's
    linear, users, schedule = (f.evidence["code"] for f in w.findings)
    assert linear["library"] == f"torch {torch.__version__}" and linear["method_of_module"]
    assert users["library"] is None and users["qualname"].endswith("Users.forward")
    assert schedule["library"].startswith("transformers ") and not schedule["method_of_module"]
    lines = w.report().splitlines()
    assert f"] 1 (torch {torch.__version__}'s code) (found at step 1" in lines[1] and "'s code" not in lines[2]
    assert "] scheduler (transformers " in lines[3]
    assert w.acknowledged == [] and not any(line.startswith("acknowledged") for line in lines)

    golden = faultbench.record_golden([w, w.to_dict()])  # known-good runs, live and saved
    assert golden["acknowledged"] == [["test_module_spy", schedule["qualname"]]]
    again = one_step(golden)
    assert [f.where for f in again.findings] == ["1", "0"] and [f.where for f in again.acknowledged] == ["scheduler"]
    assert "acknowledged: 1 finding about library code" in again.report()
    assert [f["where"] for f in again.to_dict()["acknowledged"]] == ["scheduler"]
