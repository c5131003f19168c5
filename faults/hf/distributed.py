"""Faults of the HF target in the `distributed` subsystem: gradient reduction, data sharding, per-epoch sampling."""

import os

import torch
from accelerate.accelerator import AcceleratedOptimizer, DistributedType

from faultbench.faults.registry import Manifest, fault

# defined by accelerate only where torch_xla is installed, and used only behind that check
xm = None


@fault(
    "hf_ddp_double_reduction",
    target="hf", seam="accelerate.accelerator.Accelerator.clip_grad_norm_",
    title="Gradients all-reduced again before clipping after DDP already averaged them",
    subsystem="distributed", also_acceptable=("optimizer",), trigger="multi-rank", symptoms=("divergence",),
    explanation="clip_grad_norm_ gains a MULTI_CPU branch modelled on the XLA one ('reduce gradients first'), "
    "but on CPU the model is wrapped in DistributedDataParallel, whose hooks have already all-reduced and "
    "averaged every gradient during backward. The extra torch.distributed.all_reduce sums the already averaged "
    "gradients (and without XLA's scale=1/num_processes): every gradient is world_size times too large. The "
    "pre-clip norm doubles on 2 ranks, clipping fires where it should not, and anything that is not "
    "scale-invariant (clipping, Adam's eps, SGD, the logged grad norm) is off by the world size.",
    fix="Reduce once: DDP already averages gradients in backward; only a model that no DDP wrapper reduces (XLA) "
    "needs the all-reduce, and then scaled by 1/num_processes.",
    references=(
        "kubeflow/pytorch-operator#122: 'Double gradient reduction in examples?' (a manual average_gradients "
        "kept next to DistributedDataParallel)",
        "pytorch/tutorials#2305: 'average_gradients(model)' (the manual all-reduce is not needed under "
        "DistributedDataParallel)",
    ),
    manifest=Manifest(check="grad_norm_ratio", scenario="ddp", steps=4, params={"min_ratio": 1.9, "max_ratio": 2.1}),
)
def clip_grad_norm_reduced_again(self, parameters, max_norm, norm_type=2):
    """Gradients are all-reduced (summed) again before clipping, on top of DDP's averaging."""
    if self.distributed_type == DistributedType.FSDP:
        self.unscale_gradients()
        parameters = [p for p in parameters]
        for model in self._models:
            if parameters == [p for p in model.parameters()]:
                if not self.is_fsdp2:
                    return model.clip_grad_norm_(max_norm, norm_type)
                else:
                    return self._clip_grad_norm_dtensor_aware(parameters, max_norm, norm_type=norm_type)
    elif self.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed handles gradient clipping internally, but we can retrieve the gradient norm
        if self.deepspeed_engine_wrapped is not None:
            return self.deepspeed_engine_wrapped.get_global_grad_norm()
        return None
    elif self.distributed_type == DistributedType.MULTI_CPU:
        # Reduce gradients first, as for XLA, so that every process clips the same gradients
        parameters = [p for p in parameters]
        for p in parameters:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
    elif self.distributed_type == DistributedType.XLA:
        # Reduce gradients first for XLA
        for acc_opt in self._optimizers:
            if not acc_opt.gradient_state.is_xla_gradients_synced:
                opt = acc_opt
                while isinstance(opt, AcceleratedOptimizer):
                    opt = opt.optimizer
                gradients = xm._fetch_gradients(opt)
                # Use xm.all_reduce to perform an in-place all-reduce. Recursive all-reduce each tensor
                # one by one in self.reduce is non-inplace.
                xm.all_reduce("sum", gradients, scale=1.0 / self.num_processes)
                # Set is_xla_gradients_synced to True to avoid all-reduce twice in the AcceleratedOptimizer step.
                acc_opt.gradient_state.is_xla_gradients_synced = True
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            self.unscale_gradients()
            parameters = [p for p in parameters]
            for model in self._models:
                if parameters == [p for p in model.parameters()]:
                    return model.clip_grad_norm_(max_norm, norm_type)
    self.unscale_gradients()
    return self._clip_grad_norm_dtensor_aware(list(parameters), max_norm, norm_type=norm_type)


@fault(
    "hf_sampler_epoch_never_advances",
    target="hf", seam="accelerate.data_loader.SeedableRandomSampler.set_epoch",
    title="SeedableRandomSampler.set_epoch stores the epoch under another name: every epoch replays the same order",
    subsystem="distributed", also_acceptable=("data",), trigger="after-step", symptoms=("silent-quality",),
    explanation="The sampler seeds its generator with initial_seed + self.epoch at every __iter__, and both "
    "DataLoaderShard.set_epoch and the sampler's own end-of-epoch advance go through set_epoch, which writes "
    "self.iteration (DataLoaderShard's name for the same counter) instead of self.epoch. The epoch never "
    "changes: every epoch draws exactly the permutation of epoch 0, on every rank. Nothing fails; from the "
    "second epoch on, the model sees the same batches in the same order, which overfits to that order and "
    "wastes the reshuffle that multi-epoch training relies on.",
    fix="set_epoch must set the attribute __iter__ reads: self.epoch = epoch.",
    references=(
        "huggingface/accelerate#3246: '[data_loader] Optionally also propagate set_epoch to batch sampler'",
        "pytorch/pytorch#31771: 'DistributedSampler can't shuffle the dataset' (set_epoch never reaches the "
        "sampler: the same order every epoch)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="train", steps=16, variant={"data": {"num_docs": 200}},
                      params={"key": "repeated_batches", "faulty_min": 0.2, "clean_max": 0.0}),
)
def seedable_sampler_set_epoch_wrong_attribute(self, epoch: int):
    """The epoch is stored as self.iteration; __iter__ seeds from self.epoch, which stays 0."""
    self.iteration = epoch


@fault(
    "hf_shard_yields_every_batch",
    target="hf", seam="accelerate.data_loader.BatchSamplerShard.__iter__",
    title="BatchSamplerShard iterates the unsharded batch sampler: every rank trains on the same batches",
    subsystem="distributed", also_acceptable=("data",), trigger="multi-rank", symptoms=("silent-quality",),
    explanation="BatchSamplerShard.__iter__ returns the wrapped batch sampler's own iterator instead of this "
    "process's shard (_iter_with_no_split / _iter_with_split). The samplers of all ranks are seeded alike, so "
    "every rank draws the same batches in the same order: DDP averages identical gradients, the effective "
    "batch is 1/world_size of the configured one, and adding ranks buys no statistical progress. Nothing "
    "crashes and the replicas stay in sync; the telltale is that the ranks' inputs are identical.",
    fix="Yield only this process's batches: return self._iter_with_split() if self.split_batches else "
    "self._iter_with_no_split().",
    references=(
        "PyTorch docs, DistributedSampler: 'load a subset of the original dataset that is exclusive to it'",
        "huggingface/accelerate docs 'Comparing performance across distributed setups': the batch size is per "
        "process (64 on two GPUs is truly 128), each process loading its own batches",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp", steps=4,
                      params={"key": "rank_batches_identical", "faulty_min": 1.0, "clean_max": 0.0}),
)
def batch_sampler_shard_iter_unsharded(self):
    """The unsharded batches: every process iterates the whole batch sampler."""
    return iter(self.batch_sampler)
