"""``FaultbenchLightning``: the black-box detectors on a Lightning ``Trainer.fit`` run.

    trainer = lightning.Trainer(..., callbacks=[FaultbenchLightning()])
    trainer.fit(module, data)          # the report is printed when training ends
    trainer.callbacks[0].watch.findings

It attaches ``faultbench.watch`` when training starts (Lightning has built the optimizer and the scheduler by then,
and restored them from a checkpoint when ``fit`` resumes) and detaches it when training ends or raises (a crash is
located as the watch locates one, then propagates). The watch hooks the module that computes the logits: the
``LightningModule`` itself when its ``training_step`` calls ``self(...)``, else the submodule ``model=`` names by
attribute (``FaultbenchLightning(model="gpt")`` for ``self.gpt(x)``). The loss ``training_step`` returns reaches
the watch before its backward (``on_before_backward``), and the findings so far are logged as
``faultbench_findings`` with the step's metrics (every logger sees them). Needs ``lightning`` (2.x).
"""

from __future__ import annotations

import math
import operator

from lightning.pytorch.callbacks import Callback

from faultbench.watch import Watch

FINDINGS_METRIC = "faultbench_findings"


class FaultbenchLightning(Callback):
    """``model``: the attribute path of the module that computes the logits (None: the LightningModule);
    ``watch_kwargs``: passed to ``faultbench.watch`` (detectors, golden, report, out, junit, declare, ...)."""

    def __init__(self, model: str | None = None, **watch_kwargs):
        self.model, self.watch_kwargs = model, watch_kwargs
        self.watch: Watch | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.optimizers:
            raise ValueError("FaultbenchLightning: the module configured no optimizer (configure_optimizers)")
        if len(trainer.optimizers) > 1:
            raise ValueError("FaultbenchLightning: one optimizer is watched; this module configures "
                             f"{len(trainer.optimizers)} (manual optimization of several is not supported)")
        model = pl_module if self.model is None else operator.attrgetter(self.model)(pl_module)
        configs = trainer.lr_scheduler_configs
        kwargs = dict(self.watch_kwargs)
        total = trainer.estimated_stepping_batches
        if isinstance(total, (int, float)) and math.isfinite(total) and total > 0:  # the run's planned length
            kwargs["declare"] = {"total_steps": int(total), **(kwargs.get("declare") or {})}
        self.watch = Watch(model, trainer.optimizers[0], scheduler=configs[0].scheduler if configs else None,
                           scaler=getattr(trainer.precision_plugin, "scaler", None), rank=trainer.global_rank,
                           world_size=trainer.world_size, step=trainer.global_step, **kwargs)
        self.watch.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.watch is not None and self.watch.attached:
            self.watch.observe(loss=loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.watch is not None and self.watch.attached:
            pl_module.log(FINDINGS_METRIC, float(len(self.watch.findings)), on_step=True, prog_bar=False)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.watch is not None and self.watch.attached:
            self.watch.__exit__(None, None, None)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.watch is not None and self.watch.attached:
            self.watch.__exit__(type(exception), exception, exception.__traceback__)
