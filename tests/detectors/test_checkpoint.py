"""Checkpoint detector: resume_continuity on hand-broken loaders and RNG seams; silent on the reference."""

import random

import numpy as np
import pytest
import torch

import faultbench.model.checkpoint as ckpt
from faultbench.detectors.checkpoint import LOAD, RESTORE_RNG, ResumeContinuity, _differences
from faultbench.model.run import build_run
from faultbench.model.train import train
from tests.detectors.helpers import context


@pytest.fixture(scope="module")
def saved(tiny_cfg, tmp_path_factory):
    """A run trained 2 steps and saved, with the detector's snapshot of it."""
    cfg = tiny_cfg.replace(model={"dropout": 0.1}, train={"steps": 8, "warmup_steps": 4})
    run = build_run(cfg)
    train(run, until=2)
    path = ckpt.save_checkpoint(run, tmp_path_factory.mktemp("ckpt") / "ckpt")
    det = ResumeContinuity()
    det.on_checkpoint_save(context(run), path)
    return cfg, path, det._snap


def resume(saved, loader=ckpt.load_checkpoint, **replaced):
    """Build a fresh run, load it with ``loader``, and return the detector's findings."""
    cfg, path, snap = saved
    run = build_run(cfg)
    loader(run, path)
    det = ResumeContinuity()
    det._snap = snap
    det.on_checkpoint_load(context(run, **replaced), path)
    assert not det._errors, det._errors
    return det.findings


def test_reference_resume_is_silent(saved):
    assert resume(saved) == []


@pytest.mark.parametrize("broken, component", [
    (lambda run: run.sampler.set_epoch(0), "sampler"),
    (lambda run: setattr(run, "step", run.step + 1), "step"),
    (lambda run: run.scheduler.load_state_dict({**run.scheduler.state_dict(), "last_epoch": 0}), "scheduler"),
    (lambda run: run.optimizer.state.clear(), "optimizer"),
])
def test_a_component_left_unrestored_is_localized_to_the_loader(saved, broken, component):
    def loader(run, path):
        ckpt.load_checkpoint(run, path)
        broken(run)

    findings = resume(saved, loader)
    assert [(f.subsystem, f.seam) for f in findings] == [("checkpoint", LOAD)]
    assert component in findings[0].evidence
    assert findings[0].step == 2


def test_rng_seam_that_skips_torch_is_named(saved, monkeypatch):
    def restore_without_torch(state):
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np_state = state["numpy"]
        np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                             np_state["has_gauss"], np_state["cached_gaussian"]))

    monkeypatch.setattr(ckpt, "restore_rng_state", restore_without_torch)
    findings = resume(saved, **{RESTORE_RNG: restore_without_torch})
    assert [(f.subsystem, f.seam) for f in findings] == [("checkpoint", RESTORE_RNG)]


def test_a_loader_that_never_restores_rng_is_named_not_the_rng_seam(saved, monkeypatch):
    reference = ckpt.restore_rng_state
    monkeypatch.setattr(ckpt, "restore_rng_state", lambda state: None)  # the loader's call does nothing
    findings = resume(saved, **{RESTORE_RNG: reference})  # the seam itself works when called
    assert [(f.subsystem, f.seam) for f in findings] == [("checkpoint", LOAD)]
    assert "rng" in findings[0].evidence


def test_differences_names_the_paths_that_differ():
    a = {"x": torch.ones(2), "y": [1, 2], "z": {"w": 1.0}}
    b = {"x": torch.tensor([1.0, 2.0]), "y": [1, 2], "z": {}}
    found = _differences(a, b)
    assert any(f.startswith("x:") for f in found) and any(f.startswith("z.w") for f in found)
    assert _differences(a, a) == []
