"""A plugin for the bench's own tests: a fault that hangs, a detector that raises, one that always reports."""

from faultbench.detectors.api import Detector, register
from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import IGNORE_INDEX


@fault(
    "test_collate_hangs",
    seam="model.data.collate",
    title="collate waits forever (a test of the bench's timeout)",
    subsystem="collate",
    trigger="always",
    symptoms=("hang",),
    explanation="collate blocks forever, as a dataloader waiting on a dead worker would.",
    fix="Do not block.",
    references=("PyTorch DataLoader hangs when a worker dies",),
    manifest=Manifest(check="crash", steps=2),
)
def collate_hangs(docs, pad_id, pad_side="right", ignore_index=IGNORE_INDEX):
    """Never returns."""
    import time

    while True:
        time.sleep(0.05)


@register
class RaisesOnStart(Detector):
    id = "test_raises_on_start"
    family = "data"
    baseline = True  # never part of the default suite
    description = "raises at on_start (the bench must contain it)"

    def on_start(self, ctx):
        raise RuntimeError("detector bug")


@register
class ReportsEveryRun(Detector):
    id = "test_reports_every_run"
    family = "collate"
    baseline = True
    description = "reports the collate seam after step 0 of any run"

    def on_after_step(self, ctx, record):
        if record.step == 0:
            self.report(ctx, "collate", "model.data.collate", "always", {"loss": record.loss}, confidence=0.9)
