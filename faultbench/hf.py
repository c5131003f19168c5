"""``FaultbenchCallback``: the black-box detectors on a ``transformers.Trainer`` run.

    trainer = Trainer(..., callbacks=[FaultbenchCallback()])
    trainer.train()          # the report is printed when training ends
    trainer.callback_handler.callbacks[-1].watch.findings

It attaches ``faultbench.watch`` when training begins (Trainer has created the optimizer and the scheduler by
then, and loaded them from the checkpoint of a resumed run; the loss scaler is accelerate's, held by its optimizer
wrapper) and detaches it when training ends. A resumed ``train()`` is watched from its ``state.global_step``; the
watch of the callback's previous ``train()`` (or ``previous=``) is handed to it: what the run trained on before.
Evaluations run inside ``train()`` are watched, and so is ``trainer.evaluate()`` called after it (the model keeps
two forward hooks for evaluation forwards until the next ``train()`` or ``close()``): their findings join
``watch.findings`` after the report printed when training ended. Each evaluation's reported loss is handed to
the watch, which checks it against the next-token NLL of the evaluation forwards it saw.
"""

from __future__ import annotations

from transformers import TrainerCallback

from faultbench.watch import Watch

FINDINGS_METRIC = "faultbench_findings"  # the findings so far, in every log of the run


class FaultbenchCallback(TrainerCallback):
    """``watch_kwargs``: passed to ``faultbench.watch`` (detectors, golden, report, out, ...). ``watch`` is the
    last run's ``Watch`` (its findings, JSON and report) once training has begun. ``check_eval_loss=False``: the
    evaluation loss is not handed to the watch (a custom ``compute_loss``: Trainer's loss is not the NLL)."""

    def __init__(self, previous: Watch | None = None, check_eval_loss: bool = True, **watch_kwargs):
        self.watch_kwargs, self.check_eval_loss = watch_kwargs, check_eval_loss
        self.watch: Watch | None = None
        self.previous = previous  # the watch of the run's segment before this one (a resume), if any

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       processing_class=None, **kwargs):
        self.on_train_end(args, state, control)  # a train() that raised never ended its watch
        self.close()
        previous = self.previous or self.watch
        kwargs = dict(self.watch_kwargs)
        if state.max_steps and state.max_steps > 0:  # the run's planned length, as Trainer computed it
            kwargs["declare"] = {"total_steps": state.max_steps, **(kwargs.get("declare") or {})}
        self.watch = Watch(model, optimizer, scheduler=lr_scheduler, scaler=getattr(optimizer, "scaler", None),
                           tokenizer=processing_class, rank=args.process_index, world_size=args.world_size,
                           step=state.global_step, previous=previous if state.global_step else None, **kwargs)
        self.watch.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None and self.watch.attached:
            self.watch.ctx.evaluations_follow = True  # evaluate() after train() is still watched
            self.watch.__exit__(None, None, None)
            self.watch.watch_evaluations()

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Trainer's ``grad_norm`` (the norm it clipped, of its last step) to the watch (``Watch.observe``); and the
        watch's finding count into the log as ``faultbench_findings``: it lands in ``state.log_history`` (and
        trainer_state.json) and reaches every ``report_to`` callback that runs after this one (``attach``)."""
        if self.watch is None or logs is None:
            return
        if self.watch.attached and logs.get("grad_norm") is not None:
            self.watch.observe(grad_norm=logs["grad_norm"])
        count = {FINDINGS_METRIC: len(self.watch.findings)}
        last = state.log_history[-1] if state.log_history else None  # Trainer appended {**logs, step} just before
        if last is not None and last.get("step") == state.global_step and all(last.get(k) == v for k, v in
                                                                               logs.items()):
            last.update(count)
        logs.update(count)

    def attach(self, trainer) -> FaultbenchCallback:
        """Add this callback to ``trainer`` ahead of the others, so the ``report_to`` integrations (TensorBoard,
        W&B, MLflow, ...) log ``faultbench_findings`` with each step's metrics; ``Trainer(callbacks=[...])`` and
        ``add_callback`` put it after them."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """Trainer's evaluation loss (``eval_loss``, or the one ``*_loss`` of another metric prefix) to the watch
        (``Watch.observe(eval_loss=...)``): gathered over the ranks, on every rank. Not under label smoothing, nor
        with ``check_eval_loss=False`` (a Trainer whose loss is not the model's next-token cross-entropy)."""
        losses = [v for k, v in (metrics or {}).items() if k.endswith("_loss")]
        if self.watch is not None and self.check_eval_loss and not args.label_smoothing_factor and len(losses) == 1:
            self.watch.observe(eval_loss=losses[0], across_ranks=args.world_size > 1)

    def close(self) -> None:
        """Remove the hooks kept for evaluations after training."""
        if self.watch is not None:
            self.watch.stop_watching_evaluations()
