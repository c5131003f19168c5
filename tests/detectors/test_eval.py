"""Eval detectors: the evaluate and split_of probes on hand-broken functions; silent on the reference."""

import pytest
import torch

from faultbench.detectors.eval import EvalContract, SplitOverlap
from faultbench.model.data import collate
from faultbench.model.evaluate import evaluate
from faultbench.model.loss import lm_loss
from faultbench.model.run import build_run
from tests.detectors.helpers import context


@pytest.fixture(scope="module")
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}, model={"dropout": 0.1}))


@torch.no_grad()
def evaluate_mc_dropout(model, docs, pad_id, batch_size, precision="fp32", pad_side="right"):
    """Switches the model to train mode on purpose (a Monte-Carlo dropout estimate) and leaves it there."""
    model.train()
    return _token_mean(model, docs, pad_id, batch_size, pad_side)


@torch.no_grad()
def evaluate_last_batch(model, docs, pad_id, batch_size, precision="fp32", pad_side="right"):
    """Reports the loss of the last batch only, not the mean over every batch's targets."""
    was = model.training
    model.eval()
    value = _token_mean(model, docs[-batch_size:], pad_id, batch_size, pad_side)
    model.train(was)
    return value


def _token_mean(model, docs, pad_id, batch_size, pad_side):
    total, count = 0.0, 0
    for i in range(0, len(docs), batch_size):
        batch = collate(docs[i : i + batch_size], pad_id, pad_side)
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += lm_loss(logits, batch["labels"], n).item() * n
        count += n
    return total / count


def test_reference_evaluate_and_split_are_silent(run):
    for det in (EvalContract(), SplitOverlap()):
        det.on_start(context(run))
        assert not det.findings, det.findings


@pytest.mark.parametrize("broken, words", [(evaluate_mc_dropout, "train mode"), (evaluate_last_batch, "real")])
def test_evaluate_contract(run, broken, words):
    det = EvalContract()
    det.on_start(context(run, **{"model.evaluate.evaluate": broken}))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("eval", "model.evaluate.evaluate")]
    assert words in det.findings[0].message


def split_by_length(text, val_fraction):
    """Deterministic, but not the split the corpus was built with: every short text goes to val."""
    return "val" if len(text) < 40 else "train"


def split_by_torch_draw(text, val_fraction):
    """A fresh draw from torch's RNG per call: the same text can land in either split."""
    return "val" if float(torch.rand(())) < val_fraction else "train"


@pytest.mark.parametrize("broken", [split_by_length, split_by_torch_draw])
def test_a_split_of_that_disagrees_with_the_corpus_is_blamed(run, broken):
    state = torch.get_rng_state()
    det = SplitOverlap()
    det.on_start(context(run, **{"model.corpus.split_of": broken}))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("eval", "model.corpus.split_of")]
    assert torch.equal(torch.get_rng_state(), state)  # the probe leaves the run's RNG alone


def test_reference_evaluate_is_what_the_probe_expects(run):
    docs = list(run.corpus.val[:8])
    assert evaluate(run.model, docs, 0, 4) == pytest.approx(evaluate(run.model, docs, 0, 8), rel=1e-5)
