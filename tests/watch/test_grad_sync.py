"""Gradients across ranks. bb_loss_normalization: the mean-loss contract holds for the GLOBAL batch, however its
targets are split over the ranks, and whatever the loop's convention (each rank's share of the global count with
DDP's mean, each rank's own mean, the global count with summed gradients, a mean taken by hand after the backward);
a sync that sums what is already normalized for a mean (gradients reduced twice) is named at the ranks.
bb_reported_grad_norm: the norm the loop clips and reports is the one its backward left; gradients reduced once more
after DDP's sync (before the clipping) are named at the ranks. Two gloo processes over the nanoGPT-style model,
every scenario in one spawn (spawning ranks costs seconds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import faultbench
from tests.watch.nanogpt import TrainConfig, build, get_batch

WORLD, STEPS, ACCUM = 2, 3, 2
pytestmark = pytest.mark.xdist_group("watch_grad_sync")  # one worker: the two ranks' run (a module fixture) once
DETECTORS = ["bb_loss_normalization", "bb_reported_grad_norm"]
# scenario -> (loss normalization, sync: a DDP communication hook, "ddp" (its own mean), "by_hand" (no DDP: all-reduce
# / world after the backward), "ddp+sum" (DDP, then the gradients all-reduced again before the clipping))
SCENARIOS = {
    "global_share": ("global_share", "ddp"),  # sum / (global targets / world), DDP's mean (the reference's)
    "own_mean": ("own_mean", "ddp"),  # each rank's mean over its own targets, DDP's mean
    "global_sum": ("global", "sum"),  # sum / global targets, gradients summed across ranks
    "by_hand": ("global_share", "by_hand"),
    "reduced_twice": ("global_share", "twice"),  # DDP's mean all-reduced once more in its hook
    "reduced_before_clip": ("global_share", "ddp+sum"),
}


def _sum_hook(state, bucket):
    return torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _twice_hook(state, bucket):
    tensor = bucket.buffer().div_(WORLD)
    torch.distributed.all_reduce(tensor)
    return torch.distributed.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def _scenario(rank: int, loss_kind: str, sync: str) -> list[tuple]:
    """A data-parallel loop of STEPS steps of ACCUM micro-batches that reports its clipped norm; rank 1 ignores 3/4 of
    its targets (uneven counts)."""
    from torch.nn.parallel import DistributedDataParallel

    cfg = TrainConfig(amp=False)
    model, optimizer, _ = build(cfg, seed=0)
    ddp = model if sync == "by_hand" else DistributedDataParallel(model)
    if sync in ("sum", "twice"):
        ddp.register_comm_hook(None, {"sum": _sum_hook, "twice": _twice_hook}[sync])
    torch.manual_seed(rank)
    w = faultbench.watch(model, optimizer, report=False, detectors=DETECTORS)
    with w:
        for _ in range(STEPS):
            window = [get_batch("train", 4, 16) for _ in range(ACCUM)]
            for _, y in window if rank == 1 else ():
                y[:, : 3 * y.shape[1] // 4] = -1
            local = torch.tensor(float(sum(int((y >= 0).sum()) for _, y in window)))
            total = local.clone()
            torch.distributed.all_reduce(total)
            count = {"global_share": total / WORLD, "own_mean": local, "global": total}[loss_kind]
            for i, (x, y) in enumerate(window):
                with ddp.no_sync() if i < ACCUM - 1 and ddp is not model else torch.enable_grad():
                    logits, _ = ddp(x)
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
                    (loss / count).backward()
            for p in model.parameters() if sync in ("by_hand", "ddp+sum") else ():
                torch.distributed.all_reduce(p.grad)
                p.grad /= WORLD if sync == "by_hand" else 1
            # clipping acts at every step: the optimizer's gradient is the same with or without the bugs
            w.observe(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert not w.errors and not w.not_applicable
    return [(f.detector, f.subsystem, f.where, f.step, f.message) for f in w.findings]


def _rank(rank: int, init: str, out) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        out.put((rank, {name: _scenario(rank, *spec) for name, spec in SCENARIOS.items()}))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")  # not module: other files' tests run between these and would tear it down
def findings(tmp_path_factory) -> dict:
    """{rank: {scenario: findings}} of both ranks."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('ranks')}/rendezvous"
    procs = [ctx.Process(target=_rank, args=(r, init, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    return results


@pytest.mark.parametrize("scenario", ["global_share", "own_mean", "global_sum", "by_hand"])
def test_a_correct_loop_with_uneven_ranks_yields_no_finding(findings, scenario):
    assert findings[0][scenario] == findings[1][scenario] == []


def test_gradients_reduced_twice_are_named_at_the_ranks(findings):
    for rank in range(WORLD):
        [(detector, subsystem, where, step, message)] = findings[rank]["reduced_twice"]
        assert (detector, subsystem, where, step) == ("bb_loss_normalization", "distributed", "ranks", 0)
        assert "sum to 2 instead of 1" in message and "their SUM" in message


def test_gradients_reduced_again_before_the_clipping_are_named_at_the_ranks(findings):
    for rank in range(WORLD):
        [(detector, subsystem, where, step, message)] = findings[rank]["reduced_before_clip"]
        assert (detector, subsystem, where, step) == ("bb_reported_grad_norm", "distributed", "ranks", 0), message
        assert "(2 x, 2 steps)" in message


def _one_process(factor: float, report_after_step: bool) -> list[tuple]:
    """The loop on one process; ``factor`` multiplies the gradients between the backward and the clipping. The clipped
    norm is reported before the optimizer step (where the loop has it) or after it (where Trainer logs it)."""
    model, optimizer, _ = build(TrainConfig(amp=False), seed=0)
    torch.manual_seed(0)
    w = faultbench.watch(model, optimizer, report=False, detectors=["bb_reported_grad_norm"])
    with w:
        for _ in range(STEPS):
            x, y = get_batch("train", 4, 16)
            model(x, y)[1].backward()
            for p in model.parameters():
                p.grad *= factor
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            if not report_after_step:
                w.observe(grad_norm=norm)
            optimizer.step()
            if report_after_step:
                w.observe(grad_norm=norm)
            optimizer.zero_grad(set_to_none=True)
    assert not w.errors and not w.not_applicable
    return [(f.subsystem, f.where, f.step) for f in w.findings]


@pytest.mark.parametrize("report_after_step", [False, True], ids=["before_step", "after_step"])
def test_gradients_scaled_between_the_backward_and_the_clipping_are_an_optimizer_finding(report_after_step):
    assert _one_process(1.0, report_after_step) == []
    assert _one_process(4.0, report_after_step) == [("optimizer", "optimizer", 0)]
