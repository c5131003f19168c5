"""``FaultbenchLightning`` on a Lightning ``Trainer.fit`` of the nanoGPT-style model: silent on a correct module,
the forgotten causal mask and a schedule stepped per micro-batch found, the findings logged with the metrics, a
crash located and propagated. Lightning is a test dependency (dev extra)."""

from __future__ import annotations

import pytest
import torch

lightning = pytest.importorskip("lightning")

from faultbench.lightning import FINDINGS_METRIC, FaultbenchLightning  # noqa: E402
from tests.watch.nanogpt import TrainConfig, build, get_batch  # noqa: E402

STEPS = 12


class Batches(torch.utils.data.IterableDataset):
    def __iter__(self):
        torch.manual_seed(1)
        for _ in range(STEPS * 2):
            yield get_batch("train", 8, 16)


class LM(lightning.LightningModule):
    """The GPT as a user wraps it: ``self.gpt`` computes the logits and the loss; AdamW with a warmup schedule."""

    def __init__(self, bugs=(), crash_at: int | None = None):
        super().__init__()
        self.gpt, self.opt, _ = build(TrainConfig(), bugs=bugs, seed=0)
        self.crash_at = crash_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.crash_at:
            raise RuntimeError("the user's own bug")
        x, y = (t.squeeze(0) for t in batch)
        _, loss = self.gpt(x, y)
        return loss

    def configure_optimizers(self):
        schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def fit(module, **trainer_kwargs) -> FaultbenchLightning:
    callback = FaultbenchLightning(model="gpt", report=False)
    trainer = lightning.Trainer(max_steps=STEPS, callbacks=[callback], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                                **trainer_kwargs)
    trainer.fit(module, torch.utils.data.DataLoader(Batches(), batch_size=None))
    callback.trainer = trainer
    return callback


def test_a_correct_module_is_watched_and_draws_no_finding():
    callback = fit(LM())
    watch = callback.watch
    assert watch.ctx.step == STEPS and not watch.attached and watch.errors == {}
    assert watch.findings == [], [f"{f.detector}: {f.message}" for f in watch.findings]
    assert len(watch.ctx.history) == STEPS and all(r.loss is not None and r.lrs for r in watch.ctx.history)
    assert callback.trainer.callback_metrics[FINDINGS_METRIC] == 0


def test_a_missing_causal_mask_is_found_in_the_model():
    watch = fit(LM(bugs=("not_causal",))).watch
    assert watch.findings and watch.findings[0].subsystem in ("mask", "model"), [
        f"{f.detector} [{f.subsystem}]: {f.message}" for f in watch.findings]


def test_a_crash_in_training_step_is_located_and_propagates():
    with pytest.raises(RuntimeError, match="the user's own bug"):
        fit(LM(crash_at=5))
