"""Resource detectors: padding waste and graphs kept alive by step records."""

from types import SimpleNamespace

import pytest
import torch

from faultbench.detectors.resources import GraphRetention, PaddingWaste
from faultbench.model.data import collate
from faultbench.model.run import build_run
from tests.detectors.helpers import context


@pytest.fixture(scope="module")
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}))




def test_padding_waste(run):
    docs = [list(d) for d in run.corpus.train[:8] if len(d) < 30]
    batch = {k: v[: len(docs)] for k, v in collate([*docs, [1] + [5] * 60 + [2]], 0, "right").items()}
    det = PaddingWaste()
    det.on_batch(context(run), [collate(docs, 0, "right")])
    assert not det.findings
    det.on_batch(context(run), [batch])  # collate is fine: the caller widened the batch
    assert [(f.subsystem, f.seam) for f in det.findings] == [("data", "model.train.next_micro_batches")]

    def wide(docs, pad_id, pad_side="right", ignore_index=-100):
        out = collate([*docs, [1] + [5] * 60 + [2]], pad_id, pad_side, ignore_index)
        return {k: v[: len(docs)] for k, v in out.items()}

    det = PaddingWaste()
    det.on_batch(context(run, **{"model.data.collate": wide}), [batch])
    assert [(f.subsystem, f.seam) for f in det.findings] == [("collate", "model.data.collate")]


def test_graph_retention(run):
    w = torch.ones(2, requires_grad=True)
    det = GraphRetention()
    det.on_after_step(context(run), SimpleNamespace(step=0, loss=1.5))
    assert not det.findings
    det.on_after_step(context(run), SimpleNamespace(step=1, loss=(w * 2).sum()))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("optimizer", "model.train.train_step")]
