"""Faults in the `distributed` subsystem: DDP, ZeRO, per-rank seeding, gradient sync."""

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from faultbench.faults.registry import Manifest, fault
from faultbench.model.checkpoint import FORMAT, CheckpointError, _config_mismatch, _sha256, read_meta, restore_rng_state
from faultbench.model.train import StepRecord


@fault(
    "ddp_double_reduction",
    seam="model.distributed.average_gradients_hook",
    title="Gradients all-reduced again after DDP already averaged them",
    subsystem="distributed",
    also_acceptable=("optimizer",),
    trigger="multi-rank",
    symptoms=("divergence",),
    explanation="The hook averages each bucket and then all-reduces it once more (the manual "
    "average_gradients() of the classic tutorial, kept after switching to DDP). Every gradient is "
    "world_size times too large: the pre-clip norm doubles on 2 ranks, clipping fires where it should "
    "not, and anything not scale-invariant (SGD, eps, clipping, logging) is off by the world size.",
    fix="Reduce once: either DDP (its hook) or a manual all-reduce divided by the world size, never both.",
    references=(
        "PyTorch forums: 'Gradients are doubled when using DDP' (manual all_reduce kept next to DDP)",
        "PyTorch distributed tutorial 'Writing Distributed Applications': average_gradients()",
    ),
    manifest=Manifest(check="grad_norm_ratio", scenario="ddp", steps=4, params={"min_ratio": 1.9, "max_ratio": 2.1}),
)
def average_gradients_hook_twice(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket, then all-reduces (sums) it a second time."""
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(tensor, group=group)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@fault(
    "sampler_ignores_rank",
    seam="model.sampler.ResumableSampler.next_indices",
    title="Every rank takes the same slice of the global batch: identical shards on all ranks",
    subsystem="distributed",
    also_acceptable=("data",),
    trigger="multi-rank",
    symptoms=("silent-quality",),
    explanation="next_indices starts each rank's slice at the global batch's start, forgetting the rank "
    "offset, so every rank trains on the same per-rank documents and the other half of every global "
    "batch is never seen. DDP averages identical gradients: the effective batch is global_batch / "
    "world_size, the gradient is noisier, and adding ranks buys no statistical progress. Nothing "
    "crashes and the ranks stay in sync; the telltale is that every rank's batch is the same.",
    fix="Offset each rank's slice by rank * per_rank inside the global batch (as DistributedSampler does), "
    "so the ranks' shards are disjoint and together make the whole global batch.",
    references=(
        "Lightning docs, Trainer(use_distributed_sampler=True) (formerly replace_sampler_ddp): the sampler is "
        "wrapped in a DistributedSampler so that ranks do not train on the same data",
        "PyTorch docs, DistributedSampler: 'each process can pass a DistributedSampler instance as a "
        "DataLoader sampler, and load a subset of the original dataset that is exclusive to it'",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp", steps=4,
                      params={"key": "rank_batches_identical", "faulty_min": 1.0, "clean_max": 0.0}),
)
def next_indices_same_for_every_rank(self) -> list[int]:
    """Each rank's slice starts at the global batch's start: the rank offset is missing."""
    if self.position == self.batches_per_epoch:
        self.set_epoch(self.epoch + 1)
    per_rank = self.global_batch // self.world_size
    start = self.position * self.global_batch
    self.position += 1
    return self._order[start : start + per_rank].tolist()


@fault(
    "zero_clip_local_norm",
    seam="model.train.clip_gradients",
    title="Under ZeRO each rank clips with the norm of its own parameter shard",
    subsystem="distributed",
    also_acceptable=("optimizer",),
    trigger="multi-rank",
    symptoms=("desync", "silent-quality"),
    explanation="clip_gradients takes the parameters from the optimizer's local param groups, which under "
    "ZeroRedundancyOptimizer are only the shard this rank updates. Each rank computes the norm of its "
    "shard (smaller than the global norm, and different on every rank), clips its shard by its own "
    "factor and logs that norm: the update is no longer the globally clipped gradient, the logged "
    "grad norm differs between ranks and from a single-process run.",
    fix="Clip over all of the model's parameters (the gradients are complete on every rank after DDP's "
    "all-reduce), or, where gradients are sharded, all-reduce the squared shard norms before clipping "
    "(what FSDP's clip_grad_norm_ and fairscale's OSS.clip_grad_norm do).",
    references=(
        "fairscale docs, FullyShardedDataParallel 'Gradient Clipping': torch.nn.utils.clip_grad_norm_ is "
        "incorrect on a sharded module, use the module's clip_grad_norm_",
        "PyTorch FSDP.clip_grad_norm_ and fairscale OSS.clip_grad_norm: the norm is reduced over every rank's "
        "shard before clipping",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp", steps=4, variant={"train": {"zero": True,
                                                                                          "grad_clip": 0.5}},
                      params={"key": "rank_grad_norm_diff", "faulty_min": 0.1, "clean_max": 0.0}),
)
def clip_gradients_local_shard(model, optimizer, scaler, max_norm: float) -> float:
    """Clips (and reports) the norm of the optimizer's local parameters only: one shard under ZeRO."""
    scaler.unscale_(optimizer)
    # clip what this rank's optimizer actually updates (ZeRO keeps a shard per rank)
    local = getattr(optimizer, "optim", optimizer)
    owned = {id(p) for group in local.param_groups for p in group["params"]}
    params = [p for p in model.parameters() if id(p) in owned]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    return float(norm)


@fault(
    "only_rank0_loads_checkpoint",
    seam="model.checkpoint.load_checkpoint",
    title="On a DDP resume only rank 0 loads the weights: the other replicas keep their initial weights",
    subsystem="distributed",
    also_acceptable=("checkpoint",),
    trigger="on-resume",
    symptoms=("desync", "divergence"),
    explanation="load_checkpoint loads the model's weights on rank 0 only, trusting DDP to broadcast them; "
    "but DDP broadcasts parameters once, when the model is wrapped, which build_run did before the load. "
    "The other ranks resume from their freshly initialized weights with the restored optimizer state; "
    "DDP keeps averaging their gradients, so every rank applies the same update to different weights: "
    "the replicas never agree again and the averaged loss jumps at the resume.",
    fix="Load the checkpoint's model state on every rank (each with its own map_location), or broadcast "
    "rank 0's parameters explicitly after loading.",
    references=(
        "PyTorch tutorial 'Getting Started with Distributed Data Parallel', section 'Save and Load "
        "Checkpoints': save on one rank, then load on every rank with a proper map_location",
        "PyTorch notes 'Distributed Data Parallel' (design): the DDP constructor broadcasts rank 0's "
        "state_dict once; nothing re-syncs parameters later",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp_resume", steps=8,
                      params={"key": "rank_param_diff", "faulty_min": 1e-3, "clean_max": 0.0}),
)
def load_checkpoint_rank0_weights(run, directory) -> None:
    """Only rank 0 loads the model weights; DDP does not broadcast them after wrapping."""
    directory = Path(directory)
    meta = read_meta(directory)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not supported (expected {FORMAT})")
    state_path = directory / "state.pt"
    if not state_path.exists():
        raise CheckpointError(f"checkpoint {directory} has no state.pt")
    if _sha256(state_path) != meta["sha256"]:
        raise CheckpointError(f"{state_path} is corrupted: its sha256 does not match meta.json")
    diffs = _config_mismatch(meta["config"], run.config.to_dict())
    if diffs:
        raise CheckpointError(f"checkpoint {directory} belongs to another config: " + "; ".join(diffs))
    if meta["tokenizer_sha256"] != run.tokenizer.sha256:
        raise CheckpointError(
            f"checkpoint {directory} was trained with another tokenizer (sha256 {meta['tokenizer_sha256'][:12]} "
            f"vs {run.tokenizer.sha256[:12]}); token ids would mean different things"
        )
    state = torch.load(state_path, map_location=run.config.train.device, weights_only=True)
    if run.rank == 0:  # DDP broadcasts rank 0's parameters to the other replicas
        run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])


@fault(
    "no_sync_on_last_micro_batch",
    seam="model.distributed.grad_sync_context",
    title="no_sync wraps the window's last micro-batch instead of the inner ones: gradients never fully reduced",
    subsystem="distributed",
    trigger="multi-rank",
    symptoms=("desync", "divergence"),
    explanation="grad_sync_context tests the flag the wrong way round: the inner micro-batches reduce and "
    "the window's last one runs under no_sync. The last micro-batch's gradient stays local, so after the "
    "window each rank holds the averaged inner gradients plus its own last micro-batch's: the ranks step "
    "with different gradients and their replicas drift apart from the first step (without accumulation "
    "nothing is ever reduced). It also pays for an all-reduce per inner micro-batch.",
    fix="Return model.no_sync() for the inner micro-batches (sync=False) and a null context for the last "
    "one (sync=True), so exactly one reduction per window happens, after the full accumulation.",
    references=(
        "PyTorch docs, DistributedDataParallel.no_sync: gradients accumulate locally inside the context and "
        "are synchronized in the first forward-backward pass exiting it",
        "HF accelerate docs 'Gradient accumulation': no_sync on every micro-batch but the last",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp", steps=4, variant={"train": {"accum": 2}},
                      params={"key": "rank_param_diff", "faulty_min": 1e-3, "clean_max": 0.0}),
)
def grad_sync_context_inverted(model: torch.nn.Module, sync: bool):
    """Skips the reduction on the window's last micro-batch and reduces the inner ones."""
    if not sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()
