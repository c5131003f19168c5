"""Each rank trains on its own disjoint shard of every global batch; shards change every epoch."""

from faultbench.model.config import get_preset
from faultbench.model.run import build_run
from tests.distributed.cases import shard_indices


def test_ranks_see_disjoint_shards_that_reshuffle_every_epoch(pool):
    # a small corpus so a few epochs are cheap: ~380 train documents, 23 global batches per epoch
    cfg = get_preset("tiny").replace(data={"num_docs": 400}, train={"world_size": 2})
    single = build_run(cfg.replace(train={"world_size": 1}))
    per_epoch = single.sampler.batches_per_epoch
    steps = 3 * per_epoch
    global_batches = [single.sampler.next_indices() for _ in range(steps)]
    rank0, rank1 = pool.run(shard_indices, cfg.to_dict(), steps)
    for step, (a, b, whole) in enumerate(zip(rank0, rank1, global_batches, strict=True)):
        assert len(a) == len(b) == cfg.train.batch_size // 2
        assert not set(a) & set(b), f"step {step}: ranks share documents"
        assert sorted(a + b) == sorted(whole), f"step {step}: shards are not the global batch"
    # the same step of consecutive epochs draws other documents (a fresh shuffle per epoch)
    for step in range(per_epoch):
        assert len({tuple(rank0[step + epoch * per_epoch]) for epoch in range(3)}) == 3, f"step {step}"
