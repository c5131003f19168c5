"""Baselines: crash triage and the anomaly traceback map frames to seams; the loss watcher on made-up curves."""

import inspect
from types import SimpleNamespace

from faultbench.detectors.api import RunContext
from faultbench.detectors.baselines import CrashTriage, LossCurve, innermost_seam
from faultbench.model.config import get_preset
from faultbench.model.seams import SEAMS, resolve
from tests.detectors.helpers import REF_ROLES


def context(golden=None):
    run = SimpleNamespace(config=get_preset("tiny"), step=0)
    return RunContext(run=run, seam_resolver=resolve, seams=dict(SEAMS), golden=golden, roles=REF_ROLES)


def test_crash_triage_names_the_innermost_seam_frame():
    det = CrashTriage()
    det.on_crash(context(), {"type": "IndexError", "message": "index out of range", "step": 3,
                             "frames": ["model.train.train_step", "model.gpt.GPT.forward", "model.rope.rope_at",
                                        "model.rope.rope_at.<locals>.helper"]})
    assert [(f.subsystem, f.seam, f.step) for f in det.findings] == [("position", "model.rope.rope_at", 3)]


def test_a_forward_traceback_maps_to_the_innermost_seam():
    attend = resolve("model.attention.attend")
    lines, first = inspect.getsourcelines(attend)
    forward = resolve("model.gpt.GPT.forward")
    _, fwd_first = inspect.getsourcelines(forward)
    frames = [(inspect.getsourcefile(forward), fwd_first + 2), (inspect.getsourcefile(attend), first + len(lines) - 1),
              ("/usr/lib/python3/torch/functional.py", 10)]
    assert innermost_seam(context(), frames) == "model.attention.attend"


def record(step, loss):
    return SimpleNamespace(step=step, loss=loss)


def test_loss_curve_is_silent_on_a_decreasing_loss_and_flags_nan():
    golden = {"runs": [{"loss": [5.5 - 0.08 * s for s in range(24)]}]}
    ctx = context(golden)
    det = LossCurve()
    for s in range(24):
        det.on_after_step(ctx, record(s, 5.5 - 0.08 * s + 0.02))
    det.on_end(ctx, {"val_loss": 3.7})
    assert det.findings == []
    det.on_after_step(ctx, record(24, float("nan")))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("model", None)]


def test_loss_curve_flags_a_run_that_does_not_learn():
    ctx = context()
    det = LossCurve()
    for s in range(24):
        det.on_after_step(ctx, record(s, 5.5))
    det.on_end(ctx, {"val_loss": 5.5})
    assert [(f.subsystem, f.seam) for f in det.findings] == [("optimizer", None)]
