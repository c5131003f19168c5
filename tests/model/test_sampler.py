"""The resumable sampler: deterministic, resumable mid-epoch, a permutation per epoch, sharded ranks."""

from __future__ import annotations

import pytest

from faultbench.model.sampler import ResumableSampler

NUM_ITEMS, BATCH = 103, 10  # 10 full batches per epoch; 3 items dropped each epoch


def draw(sampler: ResumableSampler, n: int) -> list[list[int]]:
    return [sampler.next_indices() for _ in range(n)]


def test_deterministic_in_seed():
    a = draw(ResumableSampler(NUM_ITEMS, BATCH, seed=5), 25)
    b = draw(ResumableSampler(NUM_ITEMS, BATCH, seed=5), 25)
    c = draw(ResumableSampler(NUM_ITEMS, BATCH, seed=6), 25)
    assert a == b
    assert a != c


@pytest.mark.parametrize("consumed", [0, 3, 9, 10, 17], ids=lambda k: f"after{k}")
def test_resume_from_state_dict(consumed):
    original = ResumableSampler(NUM_ITEMS, BATCH, seed=5)
    draw(original, consumed)
    state = original.state_dict()
    expected = draw(original, 15)  # crosses at least one epoch boundary
    resumed = ResumableSampler(NUM_ITEMS, BATCH, seed=5)
    resumed.load_state_dict(state)
    assert draw(resumed, 15) == expected


def test_refuses_state_of_another_sampler():
    state = ResumableSampler(NUM_ITEMS, BATCH, seed=5).state_dict()
    with pytest.raises(ValueError, match="seed=5"):
        ResumableSampler(NUM_ITEMS, BATCH, seed=6).load_state_dict(state)


def test_each_epoch_is_a_permutation_without_repeats():
    sampler = ResumableSampler(NUM_ITEMS, BATCH, seed=5)
    assert sampler.batches_per_epoch == NUM_ITEMS // BATCH
    for epoch in range(3):
        batches = draw(sampler, sampler.batches_per_epoch)
        assert sampler.epoch == epoch
        assert all(len(b) == BATCH for b in batches)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat) == BATCH * sampler.batches_per_epoch
        assert all(0 <= i < NUM_ITEMS for i in flat)


def test_reshuffles_every_epoch():
    sampler = ResumableSampler(NUM_ITEMS, BATCH, seed=5)
    epochs = [draw(sampler, sampler.batches_per_epoch) for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert sampler.epoch == 2


@pytest.mark.parametrize("world_size", [2, 5])
def test_ranks_get_disjoint_shards_of_the_global_batch(world_size):
    global_batches = draw(ResumableSampler(NUM_ITEMS, BATCH, seed=5), 13)
    shards = [draw(ResumableSampler(NUM_ITEMS, BATCH, seed=5, rank=r, world_size=world_size), 13)
              for r in range(world_size)]
    for step, global_batch in enumerate(global_batches):
        parts = [shards[r][step] for r in range(world_size)]
        assert all(len(p) == BATCH // world_size for p in parts)
        flat = [i for p in parts for i in p]
        assert len(set(flat)) == len(flat)  # disjoint
        assert flat == global_batch  # union (in rank order) is exactly the global batch


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_items": 100, "global_batch": 10, "world_size": 3}, "not divisible by world_size"),
        ({"num_items": 100, "global_batch": 10, "rank": 2, "world_size": 2}, "outside world_size"),
        ({"num_items": 5, "global_batch": 10}, "smaller than one global batch"),
    ],
    ids=["batch-not-divisible", "rank-out-of-range", "dataset-too-small"],
)
def test_invalid_sampler_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResumableSampler(seed=0, **kwargs)
