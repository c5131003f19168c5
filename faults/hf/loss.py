"""HF faults in the `loss` subsystem: the label shift, the reduction, and the gradient-accumulation normalization
(``num_items_in_batch``) of transformers' causal-LM loss and Trainer."""

import functools
import inspect

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin
from torch import nn
from transformers.loss.loss_utils import fixed_cross_entropy
from transformers.trainer import logger, propagate_args_to_deepspeed

from faultbench.faults.registry import Manifest, fault

_ACCUM = {"recipe": "accum"}  # 4 micro-batches per step: what the accumulation normalization is about


@fault(
    "hf_label_shift_off_by_one", target="hf", seam="transformers.loss.loss_utils.ForCausalLMLoss",
    title="Labels not shifted in ForCausalLMLoss: each position is trained to predict its own input token",
    subsystem="loss", also_acceptable=("collate",), trigger="always", symptoms=("silent-quality",),
    explanation="ForCausalLMLoss scores logits[:, t] against labels[:, t] instead of labels[:, t + 1]: the "
    "collator's labels are a copy of input_ids and the model is expected to shift them, but the shift is gone. "
    "The model learns to copy its input, which is trivial: the train and val loss fall below the corpus floor "
    "while the model predicts nothing about the next token.",
    fix="Pad the labels with ignore_index on the right and use labels[..., 1:] as the targets (or the caller's "
    "shift_labels).",
    references=(
        "huggingface/transformers#46204: Fix `num_items_in_batch` over-counting for causal LM losses (the loss "
        "shifts the labels; position 0 is never a target)",
        "HF transformers docs, LlamaForCausalLM.forward: labels are shifted inside the model; do not shift them "
        "in the collator",
    ),
    manifest=Manifest(check="loss_below", steps=16, params={"min_gap": 0.3, "metric": "val"}),
)
def forcausallmloss_unshifted(logits, labels, vocab_size: int, num_items_in_batch: torch.Tensor | None = None,
                              ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs):
    """The labels are never shifted: position t is scored against its own input token."""
    logits = logits.float()

    if shift_labels is None:
        shift_labels = labels.contiguous()

    # Flatten the tokens
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    loss = fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index, **kwargs)
    return loss


@fault(
    "hf_loss_sum_reduction", target="hf", seam="transformers.loss.loss_utils.fixed_cross_entropy",
    title="fixed_cross_entropy sums over tokens and never divides by num_items_in_batch",
    subsystem="loss", also_acceptable=("optimizer",), trigger="always", symptoms=("silent-quality", "eval-metric"),
    explanation="fixed_cross_entropy switches to reduction='sum' when Trainer passes num_items_in_batch, but "
    "the division by it is lost (evaluation passes a count too, so it sums as well). The logged train loss, every "
    "gradient and the eval loss are as many times too large as the batch has targets (about 140 here), and the "
    "scale moves with the number of real tokens in the batch: clipping fires on every step, so each update is "
    "the gradient's direction only, and evaluate() reports a loss far above log(vocab).",
    fix="Divide the summed loss by num_items_in_batch; use reduction='mean' when no count is given.",
    references=(
        "huggingface/transformers#34191: Fix Gradient Accumulation issue (reduction='sum' divided by "
        "num_items_in_batch)",
        "PyTorch docs, torch.nn.CrossEntropyLoss: reduction='sum' vs 'mean' (the sum scales with the number of "
        "elements)",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 30.0, "max_ratio": 5000.0}),
)
def fixed_cross_entropy_summed(source: torch.Tensor, target: torch.Tensor,
                               num_items_in_batch: torch.Tensor | None = None, ignore_index: int = -100,
                               **kwargs) -> torch.Tensor:
    """The loss is summed over the targets when a count is given, and returned undivided."""
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index, reduction=reduction)
    return loss


@fault(
    "hf_ga_loss_mean_per_microbatch", target="hf", seam="transformers.loss.loss_utils.fixed_cross_entropy",
    title="Gradient accumulation: each micro-batch's loss is its own token mean, summed over the window",
    subsystem="loss", also_acceptable=("optimizer",), trigger="always", symptoms=("silent-quality", "eval-metric"),
    explanation="fixed_cross_entropy ignores num_items_in_batch (Trainer's count of targets over the whole "
    "accumulation window) and returns each micro-batch's own token mean, as before transformers#34191. Trainer "
    "still believes the model normalized over the window (the model accepts loss kwargs and a count was given), "
    "so it does not divide by the accumulation steps: the micro-batch means are summed. With accumulation k the "
    "gradient and the logged loss are about k times too large, and micro-batches with few tokens weigh as much "
    "as long ones: accumulation no longer equals one big batch.",
    fix="Use reduction='sum' and divide by num_items_in_batch when it is given (the token count of the whole "
    "window); a per-micro-batch mean only when no count is passed, and then Trainer divides by the steps.",
    references=(
        "huggingface/transformers#34191: Fix Gradient Accumulation issue",
        "huggingface/transformers#34283: Enable Gradient Accumulation fix across all models + trainer fully in "
        "forward()",
        "huggingface/blog#2414: Gradient accumulation (per-micro-batch means are not the batch's token mean)",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, variant=_ACCUM, params={"min_ratio": 3.0, "max_ratio": 6.0}),
)
def fixed_cross_entropy_microbatch_mean(source: torch.Tensor, target: torch.Tensor,
                                        num_items_in_batch: torch.Tensor | None = None, ignore_index: int = -100,
                                        **kwargs) -> torch.Tensor:
    """Every micro-batch is averaged over its own targets; Trainer's window count is ignored."""
    loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index, reduction="mean")
    return loss


@fault(
    "hf_num_items_overcount", target="hf", seam="transformers.trainer.Trainer._get_num_items_in_batch",
    title="num_items_in_batch counts the unshifted labels: one target too many per row",
    subsystem="loss", trigger="always", symptoms=("silent-quality", "eval-metric"),
    explanation="Trainer counts labels != -100 over every position, but ForCausalLMLoss shifts the labels, so "
    "position 0 of each row is never a target. The denominator is too large by one per row and every causal-LM "
    "loss and gradient is scaled down by (targets - rows) / targets: here about 10% (documents of ~9 targets), "
    "more with shorter rows, and padded and packed batches of the same text disagree.",
    fix="Count labels[..., 1:] when the loss shifts the labels (or the collator's shift_labels as they are).",
    references=(
        "huggingface/transformers#46204: Fix `num_items_in_batch` over-counting for causal LM losses",
    ),
    manifest=Manifest(check="loss_below", steps=4, params={"min_gap": 0.3}),
)
def get_num_items_unshifted(self, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
    """Counts labels over every position, although the loss never targets position 0."""
    num_items_in_batch = None
    count_num_items_in_batch = (
        len(batch_samples) > 0
        and "labels" in batch_samples[0]
        and (
            # num_items_in_batch is passed to model forward
            # https://github.com/huggingface/transformers/blob/v4.49.0/src/transformers/trainer.py#L3757
            self.model_accepts_loss_kwargs
            # num_items_in_batch is passed to compute_loss_func
            # https://github.com/huggingface/transformers/blob/v4.49.0/src/transformers/trainer.py#L3773
            or self.compute_loss_func is not None
            # num_items_in_batch is also verified if (self.model_accepts_loss_kwargs or self.compute_loss_func)
            # https://github.com/huggingface/transformers/blob/v4.49.0/src/transformers/trainer.py#L3790
        )
    )
    if count_num_items_in_batch:
        # For now we don't support object detection
        try:
            num_items_in_batch = sum((batch["labels"].ne(-100)).sum() for batch in batch_samples)
        except (TypeError, AttributeError):
            pass

    if num_items_in_batch is not None:
        if self.args.average_tokens_across_devices:
            if self.args.world_size > 1:
                num_items_in_batch = self.accelerator.gather(num_items_in_batch.to(device)).sum()
        elif self.args.n_gpu > 1:
            # In DP case, if we don't average, we need to divide by the number of gpu. This is the simplest approximation.
            # Otherwise, we would have to scatter labels and calculate num_items_in_batch for each gpu.
            num_items_in_batch = num_items_in_batch // self.args.n_gpu

        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(device)

            if self.args.n_gpu > 1 and num_items_in_batch.dim() == 0:
                # In the DataParallel case, convert the scalar tensor into a 2-dim tensor with the same value repeated
                num_items_in_batch = num_items_in_batch.unsqueeze(0).expand(self.args.n_gpu, -1)
            # Divide by number of devices with the same batch
            num_items_in_batch = num_items_in_batch / (
                self.get_tp_size() * self.get_cp_size() * self.get_sp_size()
            )

    return num_items_in_batch


@fault(
    "hf_ga_loss_divided_twice", target="hf",
    seam="transformers.trainer.Trainer.create_accelerator_and_postprocess",
    title="Loss divided by the accumulation steps twice: by Trainer and again by Accelerator.backward",
    subsystem="loss", also_acceptable=("optimizer", "precision"), trigger="always", symptoms=("silent-quality",),
    explanation="Trainer builds its Accelerator with the run's gradient_accumulation_steps instead of 1. Trainer "
    "already normalizes the loss over the accumulation window (num_items_in_batch, or / steps), and "
    "Accelerator.backward now divides it by the steps again: with accumulation k every gradient is k times too "
    "small (the logged loss is not, it is returned before backward). Under clipping and Adam the direction "
    "survives, but the pre-clip gradient norm, weight decay's balance against the gradient and any "
    "norm-dependent logic are off by k, and without accumulation nothing shows.",
    fix="Create the Accelerator with GradientAccumulationPlugin(num_steps=1): Trainer handles the accumulation "
    "itself, so Accelerate must not divide.",
    references=(
        "huggingface/accelerate#3533: double divide gradient_accumulation_steps",
        "huggingface/transformers#35207: Scale loss before backward",
        "huggingface/transformers#40709: Divide gradient_accumulation_steps repeatedly in Trainer",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, variant=_ACCUM, params={"min_ratio": 0.2, "max_ratio": 0.3}),
)
def create_accelerator_double_division(self) -> None:
    """Accelerate is configured with the accumulation steps, so its backward divides the loss a second time."""
    # We explicitly don't rely on the `Accelerator` to do gradient accumulation
    grad_acc_kwargs = {}
    if self.args.accelerator_config.gradient_accumulation_kwargs is not None:
        grad_acc_kwargs = self.args.accelerator_config.gradient_accumulation_kwargs

    # check if num_steps is attempted to be passed in gradient_accumulation_kwargs
    if "num_steps" in grad_acc_kwargs:
        if self.args.gradient_accumulation_steps > 1:
            # raise because we do not know which setting is intended.
            raise ValueError(
                "The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is greater than 1 in the passed `TrainingArguments`"
                "If using the passed `AcceleratorConfig` is desired, do not set the `TrainingArguments` `gradient_accumulation_steps`."
            )
        else:
            self.args.gradient_accumulation_steps = grad_acc_kwargs["num_steps"]

    # Accelerate is told the accumulation steps too (it divides the loss by them in `backward`)
    grad_acc_kwargs["num_steps"] = self.args.gradient_accumulation_steps

    # Just making sure that gradient_state have the correct values passed.
    # We don't rely on `accumulate` from accelerate to set sync_gradients in gradient_state.
    # Rather, we do it ourselves by setting self.accelerator.gradient_state._set_sync_gradients.
    gradient_accumulation_plugin = GradientAccumulationPlugin(**grad_acc_kwargs)

    accelerator_config = self.args.accelerator_config.to_dict()

    # Extract dataloader config params from accelerator config
    dataloader_params = ["split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler"]
    dataloader_config = DataLoaderConfiguration(
        **{param: accelerator_config.pop(param) for param in dataloader_params}
    )
    dataloader_config.data_seed = self.args.data_seed

    non_blocking = accelerator_config.pop("non_blocking")

    if non_blocking and not self.args.dataloader_pin_memory:
        logger.warning(
            "`non_blocking` is enabled but `dataloader_pin_memory` is not. For the best performance, it's recommended to enable both."
        )
    dataloader_config.non_blocking = non_blocking
    # this would have been updated above, no need for it anymore
    accelerator_config.pop("gradient_accumulation_kwargs")

    fsdp_plugin = None
    if self.args.fsdp_plugin_args is not None:
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)

    args = self._build_accelerator_args(
        dataloader_config=dataloader_config,
        fsdp_plugin=fsdp_plugin,
        gradient_accumulation_plugin=gradient_accumulation_plugin,
    )

    # create accelerator object
    self.accelerator = Accelerator(**args)
    # some Trainer classes need to use `gather` instead of `gather_for_metrics`, thus we store a flag
    self.gather_function = self.accelerator.gather_for_metrics

    if "use_gather_object" in inspect.signature(self.gather_function).parameters:
        self.gather_function = functools.partial(
            self.gather_function, use_gather_object=self.args.eval_use_gather_object
        )

    # deepspeed and accelerate flags covering both trainer args and accelerate launcher
    self.is_deepspeed_enabled = getattr(self.accelerator.state, "deepspeed_plugin", None) is not None
    self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None

    # post accelerator creation setup
    if self.is_fsdp_enabled:
        if self.accelerator.state.fsdp_plugin.activation_checkpointing and self.args.activation_checkpointing:
            raise ValueError(
                "`fsdp_config['activation_checkpointing']` (FSDP's own activation checkpointing) and the "
                "`activation_checkpointing` training argument can't both be set to True. Use FSDP's activation "
                "checkpointing when using FSDP."
            )

    if self.is_deepspeed_enabled and getattr(self.args, "hf_deepspeed_config", None) is None:
        propagate_args_to_deepspeed(self.accelerator, self.args)

    # `save_only_model` can't be used with DeepSpeed/FSDP along with `load_best_model_at_end`
    if (
        self.args.save_only_model
        and (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        and self.args.load_best_model_at_end
    ):
        wrapper = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP"
        raise ValueError(f"{wrapper} can't be used with `save_only_model` along with `load_best_model_at_end`.")

    # `auto_find_batch_size` isn't supported yet with DeepSpeed Zero-3
    if (
        self.is_deepspeed_enabled
        and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        and self.args.auto_find_batch_size
    ):
        raise ValueError(
            "`auto_find_batch_size` isn't supported yet with DeepSpeed Zero-3. Please consider using Zero-2, Zero-1, or FSDP"
        )
    if (
        self.args.save_only_model
        and self.is_fsdp_enabled
        and "SHARDED_STATE_DICT" in str(self.accelerator.state.fsdp_plugin.state_dict_type)
    ):
        raise ValueError("save_only_model option is not compatible with FSDP state dict type 'SHARDED_STATE_DICT'")
