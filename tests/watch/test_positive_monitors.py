"""Positive tests of monitors that had none (benchmarks/detector_mutation.py found them surviving as no-ops).

Each breaks one detector's contract in a small hand-written loop over the nanoGPT-style model (tests/watch/nanogpt.py)
and expects that detector's finding, with its subsystem and place; the correct twin of the same loop stays silent
for that detector. Each watch runs only the detector under test, so a finding can only be its own.
"""

from __future__ import annotations

import functools

import pytest
import torch

import faultbench
from tests.watch.nanogpt import SPLITS, TrainConfig, build

STEPS = 6


def _batches(seed: int, n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g, data, out = torch.Generator().manual_seed(seed), SPLITS["train"], []
    for _ in range(n):
        ix = torch.randint(len(data) - 33, (8,), generator=g)
        out.append((torch.stack([data[i:i + 32] for i in ix]), torch.stack([data[i + 1:i + 33] for i in ix])))
    return out


def _loop(model, optimizer, detector: str, *, scheduler=None, golden=None, clip: float | None = 1.0,
          zero_grad_before_step: bool = False, overwrite_lr: float | None = None, seed: int = 0, steps: int = STEPS,
          micro: int = 1, divide_twice: bool = False, schedule: str = "step"):
    """A plain loop (forward, backward, clip, step, scheduler step, zero_grad) under a watch of ``detector`` alone,
    ``micro`` micro-batches (each loss divided by ``micro``) per step. The bugs: ``zero_grad_before_step`` (the
    gradients cleared between the backward and the step), ``overwrite_lr`` (the loop sets every group's lr itself
    after the scheduler set it), ``clip=None`` (no clipping), ``divide_twice`` (each micro-batch's loss divided
    by ``micro`` twice), ``schedule`` "micro" or "twice" (the scheduler stepped after every micro-batch, or twice a
    step; "epoch": once every 3 steps, as a per-epoch schedule is: correct)."""
    torch.set_num_threads(1)
    w = faultbench.watch(model, optimizer, scheduler=scheduler, golden=golden, report=False, detectors=[detector])
    with w:
        batches = _batches(seed, steps * micro)
        for start in range(0, len(batches), micro):
            for x, y in batches[start:start + micro]:
                _, loss = model(x, y)
                (loss / micro / (micro if divide_twice else 1)).backward()
                if scheduler is not None and schedule == "micro":
                    scheduler.step()
            if zero_grad_before_step:
                optimizer.zero_grad(set_to_none=True)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if overwrite_lr is not None:
                for group in optimizer.param_groups:
                    group["lr"] = overwrite_lr
            optimizer.step()
            last_of_epoch = start // micro % 3 == 2
            for _ in range({"step": 1, "micro": 0, "twice": 2, "epoch": int(last_of_epoch)}[schedule]):
                scheduler is not None and scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    assert w.errors == {} and w.not_applicable == {}, (w.errors, w.not_applicable)
    return w


def _found(w, detector: str) -> list[tuple[str, str | None]]:
    return [(f.subsystem, f.where) for f in w.findings if f.detector == detector]


# ---- bb_params_in_optimizer: every trainable parameter is in a param group ----------------------------------------
@pytest.mark.parametrize("broken", [False, True], ids=["correct", "norms_and_biases_left_out"])
def test_parameters_left_out_of_the_optimizer(broken):
    model, optimizer, _ = build(TrainConfig(), seed=0)
    if broken:  # only the decayed group: the no-decay group (biases, LayerNorms) was forgotten
        optimizer = torch.optim.AdamW(optimizer.param_groups[0]["params"], lr=3e-3)
    w = _loop(model, optimizer, "bb_params_in_optimizer", steps=2)
    if not broken:
        assert _found(w, "bb_params_in_optimizer") == []
        return
    assert _found(w, "bb_params_in_optimizer") == [("optimizer", "transformer.h.0.ln_1")]  # the first one's module
    missing = w.findings[0].evidence["missing"]
    assert missing[:2] == ["transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"]
    assert all(name.endswith(("bias", "ln_1.weight", "ln_2.weight")) for name in missing)


# ---- bb_grads_present: every parameter of the optimizer receives a gradient -------------------------------------
class Detached(torch.nn.Module):
    """A user's wrapper that detaches its module's output (meant for a frozen feature, applied to a trained one)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).detach()


@pytest.mark.parametrize("broken", [False, True], ids=["correct", "mlp_output_detached"])
def test_parameters_cut_off_from_the_loss(broken):
    model, optimizer, _ = build(TrainConfig(), seed=0)
    if broken:
        model.transformer.h[1].mlp = Detached(model.transformer.h[1].mlp)
    w = _loop(model, optimizer, "bb_grads_present")
    if not broken:
        assert _found(w, "bb_grads_present") == []
        return
    assert _found(w, "bb_grads_present") == [("model", "transformer.h.1.mlp.inner.c_fc")]
    assert w.findings[0].evidence["params"] == 6  # the MLP's c_fc and c_proj, and the ln_2 only it reads
    assert w.findings[0].step == 2  # at the third step: MIN_STEPS (3) steps in a row without a gradient


# ---- bb_golden_grad_norm: the optimizer steps with the gradients a backward made, as clipped as known-good -------
@functools.cache
def _golden_clipped() -> dict:
    """Known-good runs (two seeds) clipping at 0.05: well below the raw gradient norm of this model."""
    runs = [_loop(*build(TrainConfig(), seed=s)[:2], "bb_golden_grad_norm", clip=0.05, seed=s, steps=STEPS)
            for s in (100, 101)]
    return faultbench.record_golden(runs)


@pytest.mark.parametrize("bug", [None, "zero_grad_before_step", "not_clipped"], ids=str)
def test_the_optimizer_steps_with_cleared_or_unclipped_gradients(bug):
    model, optimizer, _ = build(TrainConfig(), seed=0)
    golden = _golden_clipped()
    w = _loop(model, optimizer, "bb_golden_grad_norm", golden=golden, clip=None if bug == "not_clipped" else 0.05,
              zero_grad_before_step=bug == "zero_grad_before_step")
    found = _found(w, "bb_golden_grad_norm")
    if bug is None:
        assert found == []
        return
    assert found == [("optimizer", "optimizer")]
    finding = w.findings[0]
    assert finding.step == 3  # at the third sampled step in a row (MIN_STEPS)
    if bug == "zero_grad_before_step":
        assert finding.evidence["steps"] == [1, 2, 3]
    else:
        hits = finding.evidence["steps"]
        assert [h["step"] for h in hits] == [1, 2, 3]
        assert all(h["golden"][1] == pytest.approx(0.05, rel=1e-3) and h["grad_norm"] > 0.5 for h in hits)
        # what was measured first, then the causes as possibilities (larger gradients are not proof of bad clipping)
        measured, hypothesis = finding.message.split(". ", 1)
        assert "stepped with gradients of norm" in measured and "at most 0.05" in measured
        assert hypothesis.startswith("Larger gradients than the known-good runs' have many causes")


@functools.cache
def _golden_accumulated() -> dict:
    """Known-good runs (two seeds) accumulating 4 micro-batches, unclipped."""
    runs = [_loop(*build(TrainConfig(), seed=s)[:2], "bb_golden_grad_norm", clip=None, seed=s, micro=4)
            for s in (100, 101)]
    return faultbench.record_golden(runs)


@pytest.mark.parametrize("divide_twice", [False, True], ids=["correct", "loss_divided_twice"])
def test_gradients_smaller_than_known_good_are_a_loss_finding(divide_twice):
    model, optimizer, _ = build(TrainConfig(), seed=0)
    w = _loop(model, optimizer, "bb_golden_grad_norm", golden=_golden_accumulated(), clip=None, micro=4,
              divide_twice=divide_twice)
    found = _found(w, "bb_golden_grad_norm")
    if not divide_twice:
        assert found == []
        return
    assert found == [("loss", "loss")]
    hits = w.findings[0].evidence["steps"]
    assert [h["step"] for h in hits] == [1, 2, 3]
    assert all(h["grad_norm"] < h["golden"][0] / 3 for h in hits)  # 4 x smaller, where seeds differ far less


# ---- bb_lr_shape, its scheduler rule: the optimizer steps with the LR its scheduler reports ----------------------
def _warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step:UserWarning")  # the unused optimizer
@pytest.mark.parametrize("bug", [None, "scheduler_on_another_optimizer", "lr_overwritten_after_it"], ids=str)
def test_an_optimizer_that_ignores_its_scheduler(bug):
    model, optimizer, _ = build(TrainConfig(), seed=0)
    if bug == "scheduler_on_another_optimizer":  # a second optimizer built for the schedule, never stepped
        scheduler = _warmup(torch.optim.AdamW(model.parameters(), lr=3e-3))
    else:
        scheduler = _warmup(optimizer)
    w = _loop(model, optimizer, "bb_lr_shape", scheduler=scheduler,
              overwrite_lr=3e-3 if bug == "lr_overwritten_after_it" else None)
    found = _found(w, "bb_lr_shape")
    if bug is None:
        assert found == []
        return
    assert found == [("optimizer", "scheduler")]
    # from the first step: the optimizer uses 3e-3 while the warmup reports 3e-3 / 4, then 3e-3 / 2
    assert w.findings[0].step == 1
    assert w.findings[0].evidence["steps"] == [[1, 3e-3, pytest.approx(3e-3 / 4)], [2, 3e-3, pytest.approx(3e-3 / 2)]]


# ---- bb_schedule_steps: the scheduler advances at most once per optimizer step --------------------------------------
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step:UserWarning")  # stepped before the first step
@pytest.mark.parametrize(("schedule", "micro"), [("step", 4), ("epoch", 1), ("micro", 4), ("twice", 1)])
def test_a_scheduler_stepped_per_micro_batch_or_twice_a_step(schedule, micro):
    model, optimizer, _ = build(TrainConfig(), seed=0)
    w = _loop(model, optimizer, "bb_schedule_steps", scheduler=_warmup(optimizer), micro=micro, schedule=schedule)
    found = _found(w, "bb_schedule_steps")
    if schedule in ("step", "epoch"):
        assert found == []
        return
    assert found == [("optimizer", "scheduler")]
    # micro: the first optimizer step already sees 4 scheduler steps; twice: the second (the first is stepped after it)
    first = 1 if schedule == "micro" else 2
    moved = micro if schedule == "micro" else 2
    assert w.findings[0].evidence["steps"] == [[first, moved, 1], [first + 1, moved, 1]]


def test_a_scheduler_stepped_after_steps_the_scaler_skipped_is_fine():
    """fp16-style: the loop steps its scheduler after every iteration, the optimizer stepped only when the scaler
    did not skip (here: a scale so large the first steps overflow)."""
    model, optimizer, _ = build(TrainConfig(), seed=0)
    scheduler = _warmup(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    w = faultbench.watch(model, optimizer, scheduler=scheduler, scaler=scaler, report=False,
                         detectors=["bb_schedule_steps"])
    with w:
        for x, y in _batches(0, 8):
            _, loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    assert sum(r.skipped for r in w.ctx.history) >= 1 and len(w.ctx.history) >= 2  # the premise: skipped steps
    assert w.errors == {} and w.findings == []
