"""Distributed detectors: the sampler probe on a hand-broken next_indices, the rescaling test, and a 2-rank
clean run that the detectors leave exactly as it is."""

import copy
from types import SimpleNamespace

import pytest
import torch

from faultbench.detectors.api import RunContext
from faultbench.detectors.distributed import NEXT_INDICES, RankDataDistinct, disagreeing, rescale_factors
from faultbench.harness.case import execute
from faultbench.harness.record import Case
from faultbench.model.sampler import ResumableSampler
from faultbench.model.seams import SEAMS, resolve
from tests.detectors.helpers import REF_ROLES

DETECTORS = ("reduction_probe", "rank_collectives", "rank_agreement", "rank_data_distinct",
             "rank_grad_norm_agreement", "resume_continuity")


def sampler_context(next_indices=None, world_size=2):
    run = SimpleNamespace(sampler=ResumableSampler(100, 8, 0, 1, world_size), world_size=world_size, step=0, rank=1)
    return RunContext(run=run, seam_resolver=lambda name: (next_indices if name == NEXT_INDICES and next_indices
                                                           else resolve(name)), seams=dict(SEAMS), roles=REF_ROLES)


def test_reference_sampler_shards_are_disjoint():
    ctx = sampler_context()
    before = copy.deepcopy(ctx.run.sampler.__dict__)
    det = RankDataDistinct()
    det.on_start(ctx)
    assert det.findings == [] and not det._errors
    assert ctx.run.sampler.position == before["position"]  # the probe draws on copies only


def test_a_sampler_that_ignores_the_rank_is_flagged():
    def same_slice(self):
        per_rank = self.global_batch // self.world_size
        start = self.position * self.global_batch
        self.position += 1
        return self._order[start:start + per_rank].tolist()

    det = RankDataDistinct()
    det.on_start(sampler_context(same_slice))
    assert [(f.subsystem, f.seam, f.confidence) for f in det.findings] == [("distributed", NEXT_INDICES, 0.9)]


def test_a_sampler_with_a_wrong_offset_is_flagged():
    def half_offset(self):
        per_rank = self.global_batch // self.world_size
        start = self.position * self.global_batch + self.rank * per_rank // 2
        self.position += 1
        return self._order[start:start + per_rank].tolist()

    det = RankDataDistinct()
    det.on_start(sampler_context(half_offset))
    assert [f.seam for f in det.findings] == [NEXT_INDICES]


def test_rescale_factors_tell_local_rescaling_from_unsynced_gradients():
    g = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    scaled = g * torch.tensor([0.5, 0.5, 0.25, 0.25], dtype=torch.float64)  # two groups, one factor each
    mx, mn = torch.maximum(g, scaled), torch.minimum(g, scaled)
    assert rescale_factors(mx, mn, disagreeing(mx, mn)) == [2.0, 4.0]
    noisy = g * torch.tensor([0.9, 0.7, 0.5, 0.3], dtype=torch.float64)
    mx, mn = torch.maximum(g, noisy), torch.minimum(g, noisy)
    assert len(rescale_factors(mx, mn, disagreeing(mx, mn))) == 4
    assert not disagreeing(g, g.clone()).any()


@pytest.mark.xdist_group("rank_pool")
def test_distributed_detectors_are_silent_and_leave_a_clean_ddp_run_unchanged(rank_pool):
    watched = execute(Case("ddp", 0, (), DETECTORS), None, rank_pool)
    bare = execute(Case("ddp", 0, (), ()), None, rank_pool)
    assert watched["crash"] is None and watched["findings"] == [] and watched["detector_errors"] == {}
    assert [h["loss"] for h in watched["history"]] == [h["loss"] for h in bare["history"]]
    assert [h["grad_norm"] for h in watched["history"]] == [h["grad_norm"] for h in bare["history"]]
