"""The not-applicable mechanism: a detector whose assumptions do not hold for a run says so once, with its
reason, and is neither a finding nor a detector error; ``RunContext.fact`` reads a run's general facts.

The suite runs on a stand-in run (a namespace) with a one-seam table: no training is needed to exercise
the dispatcher, and the detectors here are registered only for the duration of a test.
"""

from __future__ import annotations

import types

import pytest

from faultbench.detectors.api import DETECTORS, Detector, NotApplicable, RunContext, all_detectors
from faultbench.harness.suite import Suite


def seam_fn():
    return 1


def make_ctx(**run_fields) -> RunContext:
    run = types.SimpleNamespace(step=0, **run_fields)
    return RunContext(run=run, seam_resolver=lambda name: seam_fn, seams={"here.seam_fn": "model"})


class Counting(Detector):
    """Reports on every hook it is called for: a call after it was declared not applicable would show."""

    def on_start(self, ctx):
        self.report(ctx, "model", None, "on_start ran")

    def on_batch(self, ctx, micro_batches):
        self.report(ctx, "model", None, "on_batch ran")


class NeedsAbsentSeam(Counting):
    id = "t_needs_absent_seam"
    needs_seams = ("here.seam_fn", "elsewhere.missing")


class NeedsConfigPath(Counting):
    id = "t_needs_config_path"
    needs_run = ("tokenizer.pad_id",)
    needs_config = ("train.precision",)


class SaysSoAtBatch(Counting):
    id = "t_says_so_at_batch"

    def on_batch(self, ctx, micro_batches):
        raise NotApplicable("the batches are not token ids")


class Applicable(Counting):
    id = "t_applicable"
    needs_run = ("tokenizer.pad_id",)
    needs_config = ("train.precision",)
    needs_seams = ("here.seam_fn",)


@pytest.fixture
def suite_of(monkeypatch):
    all_detectors()  # the builtin modules first: the test's detectors are added to a loaded registry
    for cls in (NeedsAbsentSeam, NeedsConfigPath, SaysSoAtBatch, Applicable):
        monkeypatch.setitem(DETECTORS, cls.id, cls)

    def make(ids, ctx):
        suite = Suite(ids, ctx)
        suite.fire("on_start")
        for _ in range(3):
            suite.fire("on_batch", [{}])
        return suite

    return make


def test_declared_needs_that_the_run_lacks_are_recorded_once_never_as_finding_or_error(suite_of):
    ctx = make_ctx(config=types.SimpleNamespace(precision="fp32"))  # a config without the "train" section
    suite = suite_of([NeedsAbsentSeam.id, NeedsConfigPath.id], ctx)
    assert suite.findings() == [] and suite.errors == {}
    assert suite.not_applicable == {
        NeedsAbsentSeam.id: "on_start: this run has no seam elsewhere.missing",
        NeedsConfigPath.id: "on_start: this run has no run.tokenizer.pad_id, config.train.precision",
    }
    assert suite.summaries()[NeedsConfigPath.id] == {"not_applicable": suite.not_applicable[NeedsConfigPath.id]}


def test_a_hook_that_raises_not_applicable_is_recorded_and_called_no_more(suite_of):
    ctx = make_ctx(config=types.SimpleNamespace())
    suite = suite_of([SaysSoAtBatch.id], ctx)
    assert suite.not_applicable == {SaysSoAtBatch.id: "on_batch: the batches are not token ids"}
    assert suite.errors == {}
    # what it saw before it said so stays: on_start ran once, on_batch was not called after the first raise
    assert [f.message for f in suite.findings()] == ["on_start ran"]


def test_a_detector_whose_needs_hold_runs_every_hook(suite_of):
    ctx = make_ctx(tokenizer=types.SimpleNamespace(pad_id=0),
                   config=types.SimpleNamespace(train=types.SimpleNamespace(precision="fp32")))
    suite = suite_of([Applicable.id], ctx)
    assert suite.not_applicable == {} and suite.errors == {}
    assert [f.message for f in suite.findings()] == ["on_start ran"] + ["on_batch ran"] * 3


def test_a_detector_that_raises_otherwise_is_still_a_detector_error(suite_of, monkeypatch):
    def broken(self, ctx):
        raise AttributeError("no such thing")

    monkeypatch.setattr(Applicable, "on_start", broken)
    ctx = make_ctx(tokenizer=types.SimpleNamespace(pad_id=0),
                   config=types.SimpleNamespace(train=types.SimpleNamespace(precision="fp32")))
    suite = suite_of([Applicable.id], ctx)
    assert suite.errors == {Applicable.id: "on_start: AttributeError: no such thing"}
    assert suite.not_applicable == {}


def test_fact_reads_the_run_attribute_then_the_reference_layout_else_not_applicable():
    own = make_ctx(loss_floor=1.5, corpus=types.SimpleNamespace(loss_floor=9.0))
    assert own.fact("loss_floor") == 1.5  # the run's own attribute wins
    reference = make_ctx(corpus=types.SimpleNamespace(loss_floor=1.25),
                         config=types.SimpleNamespace(data=types.SimpleNamespace(pad_side="left")))
    assert reference.fact("loss_floor") == 1.25
    assert reference.fact("pad_side") == "left"
    with pytest.raises(NotApplicable, match="does not offer its vocab_size"):
        reference.fact("vocab_size")


def test_known_seam_names_only_seams_of_the_run():
    ctx = make_ctx()
    assert ctx.known_seam("here.seam_fn") == "here.seam_fn"
    assert ctx.known_seam("model.train.train_step") is None
