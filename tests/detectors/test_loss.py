"""Loss detectors: the lm_loss / forward_loss contract probes flag hand-broken functions; silent on the reference."""

import pytest
import torch
import torch.nn.functional as F

from faultbench.detectors.loss import ForwardLossContract, LossContract, reference_loss
from faultbench.model.loss import lm_loss
from faultbench.model.run import build_run
from faultbench.model.train import forward_loss
from tests.detectors.helpers import start_findings as findings


@pytest.fixture(scope="module")
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 4, "warmup_steps": 1, "accum": 2}))


def test_reference_loss_matches_lm_loss():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[:, 0] = -100
    labels[1, 5:] = -100
    assert reference_loss(logits, labels, -100) == pytest.approx(float(lm_loss(logits, labels)), rel=1e-5)
    assert reference_loss(logits, labels, -100, 40) == pytest.approx(float(lm_loss(logits, labels, 40)), rel=1e-5)


def test_silent_on_the_reference(run):
    assert findings(LossContract, run) == []
    assert findings(ForwardLossContract, run) == []


def unshifted(logits, labels, num_targets=None, ignore_index=-100):
    total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="sum")
    return total / max(num_targets if num_targets is not None else int((labels != ignore_index).sum()), 1)


def summed(logits, labels, num_targets=None, ignore_index=-100):
    return lm_loss(logits, labels, num_targets, ignore_index) * (num_targets or int((labels[:, 1:] != -100).sum()))


def mean_over_batch(logits, labels, num_targets=None, ignore_index=-100):
    return lm_loss(logits, labels, None, ignore_index)  # ignores num_targets


@pytest.mark.parametrize("broken", [unshifted, summed, mean_over_batch], ids=lambda f: f.__name__)
def test_broken_lm_loss_is_localized(run, broken):
    found = findings(LossContract, run, **{"model.loss.lm_loss": broken})
    assert [(f.subsystem, f.seam, f.confidence) for f in found] == [("loss", "model.loss.lm_loss", 0.9)]
    assert findings(ForwardLossContract, run, **{"model.loss.lm_loss": broken}) == []  # not forward_loss's fault


def test_broken_forward_loss_is_localized(run):
    def own_count(model, batch, num_targets, precision):
        return forward_loss(model, batch, None, precision)

    def reversed_rows(model, batch, num_targets, precision):
        flipped = {k: v.flip(0) for k, v in batch.items()}
        return forward_loss(model, {**flipped, "labels": batch["labels"]}, num_targets, precision)

    def labels_rolled(model, batch, num_targets, precision):
        return forward_loss(model, {**batch, "labels": batch["labels"].roll(1, 0)}, num_targets, precision)

    for broken, hint in ((own_count, "does not scale as 1/num_targets"), (reversed_rows, "not scored independently"),
                         (labels_rolled, "not scored independently")):
        found = findings(ForwardLossContract, run, **{"model.train.forward_loss": broken})
        assert [(f.seam, f.confidence) for f in found] == [("model.train.forward_loss", 0.9)]
        assert hint in found[0].message


def test_count_targets_contract(run):
    found = findings(LossContract, run, **{"model.loss.count_targets": lambda labels, ignore_index=-100:
                                           int((labels[:, :-1] != ignore_index).sum())})  # shifts the wrong way
    assert [f.seam for f in found] == ["model.loss.count_targets"]
