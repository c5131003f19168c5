"""Faults of the HF target in the `eval` subsystem: the evaluation loop, its loss, and the split it evaluates."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.trainer import (
    DataLoader,
    EvalLoopContainer,
    EvalLoopOutput,
    EvalPrediction,
    IterableDatasetShard,
    deepspeed_init,
    denumpify_detensorize,
    find_batch_size,
    has_length,
    is_sagemaker_mp_enabled,
    is_torch_xla_available,
    logger,
    nested_detach,
)

from faultbench.faults.registry import Manifest, fault
from faultbench.model.corpus import split_of

_TRAINER = "transformers.trainer.Trainer"
# defined by transformers only where torch_xla / SageMaker are installed, and used only behind those checks
xm = smp = smp_forward_only = smp_nested_concat = None


@fault(
    "hf_eval_in_train_mode",
    target="hf", seam=f"{_TRAINER}.evaluation_loop",
    title="evaluation_loop never calls model.eval(): dropout stays on while the eval loss is measured",
    subsystem="eval", trigger="eval-only", symptoms=("eval-metric",),
    explanation="evaluation_loop prepares the model and the dataloader but the model.eval() call is gone, so "
    "a model evaluated right after training is still in train mode: attention dropout (0.1 here) is applied "
    "to every evaluation forward. Training is untouched; the reported eval loss is a random draw, a bit "
    "worse than the model's, and two evaluations of the same weights disagree, so early stopping and model "
    "selection compare noise.",
    fix="Call model.eval() at the start of evaluation_loop (Trainer.training_step puts the model back in "
    "train mode itself).",
    references=(
        "meta-pytorch/torchtune#1049: 'Put model in eval mode for evaluation'",
        "PyTorch docs, Module.eval(): dropout and batch-norm layers behave differently in training and "
        "evaluation mode",
    ),
    manifest=Manifest(check="extra_at_least", scenario="train", steps=16, variant={"recipe": "resume"},
                      params={"key": "eval_repeat_gap", "faulty_min": 1e-6, "clean_max": 0.0}),
)
def evaluation_loop_train_mode(
    self,
    dataloader: DataLoader,
    description: str,
    prediction_loss_only: bool | None = None,
    ignore_keys: list[str] | None = None,
    metric_key_prefix: str = "eval",
) -> EvalLoopOutput:
    """The model is never switched to eval mode: dropout stays active during evaluation."""
    args = self.args

    prediction_loss_only = prediction_loss_only if prediction_loss_only is not None else args.prediction_loss_only

    # if eval is called w/o train, handle model prep here
    if self.is_deepspeed_enabled and self.deepspeed is None:
        _, _ = deepspeed_init(self, num_training_steps=0, inference=True)

    model = self._wrap_model(self.model, training=False)

    if len(self.accelerator._models) == 0 and model is self.model:
        start_time = time.time()
        model = (
            self.accelerator.prepare(model)
            if self.is_deepspeed_enabled or (self.is_fsdp_enabled and not self.args.torch_compile)
            else self.accelerator.prepare_model(model, evaluation_mode=True)
        )
        self.model_preparation_time = round(time.time() - start_time, 4)

        if self.is_fsdp_enabled:
            self.model = model

        # for the rest of this function `model` is the outside model, whether it was wrapped or not
        if model is not self.model:
            self.model_wrapped = model

        # backward compatibility
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped

    # if full fp16 or bf16 eval is wanted and this ``evaluation`` or ``predict`` isn't called
    # while ``train`` is running, cast it to the right dtype first and then put on device
    if not self.is_in_train:
        if args.fp16_full_eval:
            model = model.to(dtype=torch.float16, device=args.device)
        elif args.bf16_full_eval:
            model = model.to(dtype=torch.bfloat16, device=args.device)

    batch_size = self.args.eval_batch_size

    logger.info(f"\n***** Running {description} *****")
    if has_length(dataloader):
        logger.info(f"  Num examples = {self.num_examples(dataloader)}")
    else:
        logger.info("  Num examples: Unknown")
    logger.info(f"  Batch size = {batch_size}")

    if hasattr(self.optimizer, "eval") and callable(self.optimizer.eval):
        self.optimizer.eval()

    self.callback_handler.eval_dataloader = dataloader
    # Do this before wrapping.
    eval_dataset = getattr(dataloader, "dataset", None)

    # Initialize containers
    all_losses = EvalLoopContainer(self.args.eval_do_concat_batches, padding_index=-100)
    all_preds = EvalLoopContainer(self.args.eval_do_concat_batches, padding_index=-100)
    all_labels = EvalLoopContainer(self.args.eval_do_concat_batches, padding_index=-100)
    all_inputs = EvalLoopContainer(self.args.eval_do_concat_batches, padding_index=-100)

    metrics = None
    eval_set_kwargs = {}

    # Will be useful when we have an iterable dataset so don't know its length.
    observed_num_examples = 0

    # Main evaluation loop
    for step, inputs in enumerate(dataloader):
        # Update the observed num examples
        observed_batch_size = find_batch_size(inputs)
        if observed_batch_size is not None:
            observed_num_examples += observed_batch_size
            # For batch samplers, batch_size is not known by the dataloader in advance.
            if batch_size is None:
                batch_size = observed_batch_size

        # Prediction step
        losses, logits, labels = self.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        main_input_name = getattr(self.model, "main_input_name", "input_ids")
        inputs_decode = (
            self._prepare_input(inputs[main_input_name]) if "inputs" in args.include_for_metrics else None
        )

        if is_torch_xla_available():
            xm.mark_step()

        # Update containers
        if losses is not None:
            losses = self.gather_function(losses.repeat(batch_size))
            all_losses.add(losses)
        if inputs_decode is not None:
            inputs_decode = self.accelerator.pad_across_processes(inputs_decode, dim=1, pad_index=-100)
            inputs_decode = self.gather_function(inputs_decode)
            if not self.args.batch_eval_metrics or description == "Prediction":
                all_inputs.add(inputs_decode)
        if labels is not None:
            # Pad labels here, preparing for preprocess_logits_for_metrics in next logits block.
            labels = self.accelerator.pad_across_processes(labels, dim=1, pad_index=-100)
        if logits is not None:
            logits = self.accelerator.pad_across_processes(logits, dim=1, pad_index=-100)
            if self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, labels)
            logits = self.gather_function(logits)
            if not self.args.batch_eval_metrics or description == "Prediction":
                all_preds.add(logits)
        if labels is not None:
            labels = self.gather_function(labels)
            if not self.args.batch_eval_metrics or description == "Prediction":
                all_labels.add(labels)

        self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)

        if self.args.batch_eval_metrics:
            if self.compute_metrics is not None and logits is not None and labels is not None:
                is_last_step = self.accelerator.gradient_state.end_of_dataloader
                batch_kwargs = {}
                batch_kwargs["losses"] = losses if "loss" in args.include_for_metrics else None
                batch_kwargs["inputs"] = inputs if "inputs" in args.include_for_metrics else None
                metrics = self.compute_metrics(
                    EvalPrediction(predictions=logits, label_ids=labels, **batch_kwargs),
                    compute_result=is_last_step,
                )

            del losses, logits, labels, inputs
            torch.cuda.empty_cache()

        # Gather all tensors and put them back on the CPU if we have done enough accumulation steps.
        elif args.eval_accumulation_steps is not None and (step + 1) % args.eval_accumulation_steps == 0:
            all_losses.to_cpu_and_numpy()
            all_preds.to_cpu_and_numpy()
            all_labels.to_cpu_and_numpy()
            all_inputs.to_cpu_and_numpy()

            del losses, logits, labels, inputs
            torch.cuda.empty_cache()

    # After all calls to `.gather_function`, reset to `gather_for_metrics`:
    self.gather_function = self.accelerator.gather_for_metrics

    # Gather all remaining tensors and put them back on the CPU
    all_losses = all_losses.get_arrays()
    all_preds = all_preds.get_arrays()
    all_labels = all_labels.get_arrays()
    all_inputs = all_inputs.get_arrays()

    # Number of samples
    if has_length(eval_dataset):
        num_samples = len(eval_dataset)
    # The instance check is weird and does not actually check for the type, but whether the dataset has the right
    # methods. Therefore we need to make sure it also has the attribute.
    elif isinstance(eval_dataset, IterableDatasetShard) and getattr(eval_dataset, "num_examples", 0) > 0:
        num_samples = eval_dataset.num_examples
    else:
        if has_length(dataloader):
            num_samples = self.num_examples(dataloader)
        else:  # both len(dataloader.dataset) and len(dataloader) fail
            num_samples = observed_num_examples
    if num_samples == 0 and observed_num_examples > 0:
        num_samples = observed_num_examples

    # Metrics!
    if (
        self.compute_metrics is not None
        and all_preds is not None
        and all_labels is not None
        and not self.args.batch_eval_metrics
    ):
        eval_set_kwargs["losses"] = all_losses if "loss" in args.include_for_metrics else None
        eval_set_kwargs["inputs"] = all_inputs if "inputs" in args.include_for_metrics else None
        metrics = self.compute_metrics(
            EvalPrediction(predictions=all_preds, label_ids=all_labels, **eval_set_kwargs)
        )
    elif metrics is None:
        metrics = {}

    # To be JSON-serializable, we need to remove numpy types or zero-d tensors
    metrics = denumpify_detensorize(metrics)

    losses = np.concatenate(all_losses) if isinstance(all_losses, list) and all_losses else all_losses
    if isinstance(losses, np.ndarray):
        finite = np.isfinite(losses)
        if self.args.logging_nan_inf_filter and finite.any():
            losses = losses[finite]
        metrics[f"{metric_key_prefix}_loss"] = losses.mean().item()
    if hasattr(self, "model_preparation_time"):
        metrics[f"{metric_key_prefix}_model_preparation_time"] = self.model_preparation_time

    # Prefix all keys with metric_key_prefix + '_'
    for key in list(metrics.keys()):
        if not key.startswith(f"{metric_key_prefix}_"):
            metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)

    return EvalLoopOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics, num_samples=num_samples)


@fault(
    "hf_eval_loss_scaled_by_nprocs",
    target="hf", seam=f"{_TRAINER}.prediction_step",
    title="Eval loss multiplied by the number of processes: the eval token count is per rank, the scaling global",
    subsystem="eval", also_acceptable=("distributed",), trigger="multi-rank", symptoms=("eval-metric",),
    explanation="prediction_step counts the batch's target tokens on this rank only, skipping "
    "_get_num_items_in_batch (which sums the count over ranks under average_tokens_across_devices). "
    "compute_loss still multiplies the loss by num_processes to undo a cross-rank mean that never happens "
    "in evaluation, so every rank's eval loss is its token mean times the world size: on 2 ranks the "
    "reported eval loss (and perplexity) doubles, while training and a 1-process evaluation are exact.",
    fix="Count eval items the way training does, with self._get_num_items_in_batch([inputs], device), or "
    "scale in compute_loss only when the count was gathered across ranks.",
    references=(
        "huggingface/transformers#35078: 'Bug of eval loss when enabling average_tokens_across_devices'",
        "huggingface/transformers#34373: 'enable average tokens across devices'",
    ),
    manifest=Manifest(check="loss_above", scenario="ddp", steps=4, params={"metric": "val", "min_gap": 2.0}),
)
def prediction_step_local_count(
    self,
    model: nn.Module,
    inputs: dict[str, torch.Tensor | Any],
    prediction_loss_only: bool,
    ignore_keys: list[str] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The eval token count is this rank's own, while compute_loss scales the loss by the number of processes as for a count summed over ranks."""
    has_labels = False if len(self.label_names) == 0 else all(inputs.get(k) is not None for k in self.label_names)
    # For CLIP-like models capable of returning loss values.
    # If `return_loss` is not specified or being `None` in `inputs`, we check if the default value of `return_loss`
    # is `True` in `model.forward`.
    return_loss = inputs.get("return_loss")
    if return_loss is None:
        return_loss = self.can_return_loss
    loss_without_labels = len(self.label_names) == 0 and return_loss

    inputs = self._prepare_inputs(inputs)
    if ignore_keys is None:
        if hasattr(self.model, "config"):
            ignore_keys = getattr(self.model.config, "keys_to_ignore_at_inference", ["past_key_values"])
        else:
            ignore_keys = []

    # labels may be popped when computing the loss (label smoothing for instance) so we grab them first.
    if has_labels or loss_without_labels:
        labels = nested_detach(tuple(inputs.get(name) for name in self.label_names))
        if len(labels) == 1:
            labels = labels[0]
    else:
        labels = None

    with torch.no_grad():
        if is_sagemaker_mp_enabled():
            raw_outputs = smp_forward_only(model, inputs)
            if has_labels or loss_without_labels:
                if isinstance(raw_outputs, dict):
                    loss_mb = raw_outputs["loss"]
                    logits_mb = tuple(v for k, v in raw_outputs.items() if k not in ignore_keys + ["loss"])
                else:
                    loss_mb = raw_outputs[0]
                    logits_mb = raw_outputs[1:]

                loss = loss_mb.reduce_mean().detach().cpu()
                logits = smp_nested_concat(logits_mb)
            else:
                loss = None
                if isinstance(raw_outputs, dict):
                    logits_mb = tuple(v for k, v in raw_outputs.items() if k not in ignore_keys)
                else:
                    logits_mb = raw_outputs
                logits = smp_nested_concat(logits_mb)
        else:
            if has_labels or loss_without_labels:
                # Count before sharding: `context_parallel` splits the buffers in place.
                num_items_in_batch = inputs["labels"][..., 1:].ne(-100).sum()  # eval needs no cross-rank count
                cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
                with self.compute_loss_context_manager(), cp_context():
                    if self.args.use_liger_kernel and prediction_loss_only:
                        inputs = {**inputs, "skip_logits": True}
                    loss, outputs = self.compute_loss(
                        model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
                    )
                loss = loss.detach().mean()

                if isinstance(outputs, dict):
                    logits = tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"])
                else:
                    logits = outputs[1:]
            else:
                loss = None
                with self.compute_loss_context_manager():
                    outputs = model(**inputs)
                if isinstance(outputs, dict):
                    logits = tuple(v for k, v in outputs.items() if k not in ignore_keys)
                else:
                    logits = outputs

    if prediction_loss_only:
        return (loss, None, None)

    logits = nested_detach(logits)
    if len(logits) == 1:
        logits = logits[0]

    return (loss, logits, labels)


@fault(
    "hf_eval_split_overlaps_train",
    target="hf", seam="targets.hf.data.split_texts",
    title="split_texts keeps the validation documents in the training split: eval measures memorized text",
    subsystem="eval", also_acceptable=("data",), trigger="always", symptoms=("eval-metric",),
    explanation="The validation list is filtered by document hash but the training list is the whole corpus: "
    "every validation document is also a training document. Nothing fails and short runs look the same; "
    "as training proceeds the model sees the validation texts, the eval loss falls below what held-out text "
    "would give, and every model-selection and overfitting signal drawn from it is optimistic.",
    fix="Filter both lists by the same hash: train = documents whose split is 'train', val = those whose split "
    "is 'val' (disjoint by construction).",
    references=(
        "scikit-learn docs 'Common pitfalls and recommended practices': data leakage between training and "
        "test sets",
        "Kapoor & Narayanan 2023, 'Leakage and the reproducibility crisis in machine-learning-based science' "
        "(Patterns): no separation of training and test data",
    ),
    manifest=Manifest(check="extra_at_least", scenario="train", steps=4,
                      params={"key": "val_train_overlap", "faulty_min": 0.99, "clean_max": 0.0}),
)
def split_texts_val_kept_in_train(texts, val_fraction: float) -> tuple[list[str], list[str]]:
    """The training split is the whole corpus: validation documents are trained on too."""
    train = list(texts)
    val = [t for t in texts if split_of(t, val_fraction) == "val"]
    return train, val
