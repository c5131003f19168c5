"""Detector hooks on a ``Trainer`` run: when each ``detectors.api.Detector`` hook fires on the HF target.

  on_start        Trainer's on_train_begin of a fresh run (model, optimizer and scheduler exist)
  on_checkpoint_load   on_train_begin of the resumed run (weights, optimizer, scheduler loaded; the RNG
                  state is restored later, at the first batch, by ``Trainer._load_rng_state``)
  on_batch        the step's micro-batches, from ``StepTrainer.get_batch_samples``, before any forward
  on_forward      forward hook of the LlamaForCausalLM, training forwards only; batch = the forward's
                  kwargs (input_ids, attention_mask, labels; no position_ids: Llama derives them)
  on_backward     hook on the logits' gradient, once per micro-batch
  on_before_step  the torch optimizer's step pre-hook (after clipping)
  on_after_step   Trainer's on_log of the step (loss, grad_norm, learning_rate): the step's StepRecord
  on_checkpoint_save   Trainer's on_save, with the checkpoint folder
``StepRecorder`` always records the step history; the suite's hooks are attached only when wanted.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

from faultbench.model.train import StepRecord


class StepRecorder(TrainerCallback):
    """Appends a ``StepRecord`` per optimizer step to ``run.history``; fires ``suite``'s hooks if given.

    ``begin_hook``: the suite hook fired at train begin ("on_start", or "on_checkpoint_load" with
    ``checkpoint``). ``stop_at``: save a checkpoint at that step and stop (the first half of a resume).
    """

    def __init__(self, run, suite=None, begin_hook: str = "on_start", checkpoint=None, stop_at: int | None = None):
        self.run, self.suite, self.stop_at = run, suite, stop_at
        self.begin = (begin_hook, *(() if checkpoint is None else (checkpoint,)))
        self.handles: list = []
        self.tokens, self.started = 0, 0.0
        run.trainer.add_callback(self)
        run.trainer.on_batches = self._on_batches

    def _fire(self, hook: str, *args) -> None:
        if self.suite is not None:
            self.suite.fire(hook, *args)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.suite is not None:
            self.handles = attach(self.suite, self.run)
        self._fire(*self.begin)

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()
        if self.suite is not None:
            self.suite.in_step = True

    def _on_batches(self, micro_batches: list[dict]) -> None:
        self.tokens = int(sum(b["attention_mask"].sum() for b in micro_batches))
        self._fire("on_batch", micro_batches)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at:
            control.should_save = control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in logs:  # the end-of-train summary, an evaluation
            return
        scaler = self.run.scaler
        record = StepRecord(
            step=state.global_step - 1, loss=logs["loss"], grad_norm=float(logs.get("grad_norm", float("nan"))),
            lr=logs["learning_rate"], scale=scaler.get_scale() if scaler.is_enabled() else 1.0,
            skipped=bool(self.run.trainer.accelerator.optimizer_step_was_skipped), tokens=self.tokens,
            seconds=time.perf_counter() - self.started,
        )
        self.run.history.append(record)
        self._fire("on_after_step", record)
        if self.suite is not None:
            self.suite.in_step = False

    def on_save(self, args, state, control, **kwargs):
        self._fire("on_checkpoint_save", checkpoint_dir(args.output_dir, state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def train(run, suite=None, resume: str | None = None, **recorder) -> list:
    """``run.trainer.train()`` with a ``StepRecorder`` (and ``suite``'s hooks) attached, resuming from the
    checkpoint folder ``resume`` if given; returns this call's ``StepRecord``s (also in ``run.history``).
    ``recorder``: ``StepRecorder``'s begin_hook, checkpoint and stop_at."""
    done = len(run.history)
    recorder_cb = StepRecorder(run, suite, **recorder)
    try:
        run.trainer.train(resume_from_checkpoint=resume)
    finally:
        recorder_cb.detach()
        run.trainer.remove_callback(recorder_cb)
    return run.history[done:]


def checkpoint_dir(output_dir: str, step: int) -> str:
    """Where Trainer saves the checkpoint of ``step`` (its ``checkpoint-{global_step}`` convention)."""
    return f"{output_dir}/checkpoint-{step}"


def attach(suite, run) -> list:
    """Wire the model's forward (and logits' gradient) and the optimizer's step to ``suite``; the handles."""
    handles = []
    if suite.wants("on_forward") or suite.wants("on_backward"):
        def forward_hook(module, args, kwargs, output):
            if not module.training or suite.ctx.phase != "train":
                return
            batch = {k: kwargs.get(k) for k in ("input_ids", "attention_mask", "position_ids", "labels")}
            logits = output.logits
            suite.fire("on_forward", batch, logits)
            if suite.wants("on_backward") and logits.requires_grad:
                logits.register_hook(lambda grad: suite.fire("on_backward", batch, grad))

        handles.append(run.model.register_forward_hook(forward_hook, with_kwargs=True))
    if suite.wants("on_before_step"):
        torch_optimizer = run.optimizer.optimizer  # under accelerate's wrapper
        handles.append(torch_optimizer.register_step_pre_hook(lambda opt, args, kwargs: suite.fire("on_before_step")))
    return handles
