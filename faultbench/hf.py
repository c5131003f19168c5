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
``watch.findings`` after the report printed when training ended.
"""

from __future__ import annotations

from transformers import TrainerCallback

from faultbench.watch import Watch


class FaultbenchCallback(TrainerCallback):
    """``watch_kwargs``: passed to ``faultbench.watch`` (detectors, golden, report, out, ...). ``watch`` is the
    last run's ``Watch`` (its findings, JSON and report) once training has begun."""

    def __init__(self, previous: Watch | None = None, **watch_kwargs):
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.previous = previous  # the watch of the run's segment before this one (a resume), if any

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       processing_class=None, **kwargs):
        self.on_train_end(args, state, control)  # a train() that raised never ended its watch
        self.close()
        previous = self.previous or self.watch
        self.watch = Watch(model, optimizer, scheduler=lr_scheduler, scaler=getattr(optimizer, "scaler", None),
                           tokenizer=processing_class, rank=args.process_index, world_size=args.world_size,
                           step=state.global_step, previous=previous if state.global_step else None,
                           **self.watch_kwargs)
        self.watch.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None and self.watch.attached:
            self.watch.__exit__(None, None, None)
            self.watch.watch_evaluations()

    def close(self) -> None:
        """Remove the hooks kept for evaluations after training."""
        if self.watch is not None:
            self.watch.stop_watching_evaluations()
