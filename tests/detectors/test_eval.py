"""Eval detectors: the evaluate and split_of probes on hand-broken functions; silent on the reference."""

import random

import pytest
import torch

from detectors.eval import EvalContract, SplitOverlap
from model.data import collate
from model.evaluate import evaluate
from model.loss import lm_loss
from model.run import build_run
from tests.detectors.helpers import context


@pytest.fixture(scope="module")
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}, model={"dropout": 0.1}))


@torch.no_grad()
def evaluate_train_mode(model, docs, pad_id, batch_size, precision="fp32", pad_side="right"):
    total, count = 0.0, 0
    for i in range(0, len(docs), batch_size):
        batch = collate(docs[i : i + batch_size], pad_id, pad_side)
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += lm_loss(logits, batch["labels"], n).item() * n
        count += n
    return total / count


@torch.no_grad()
def evaluate_over_positions(model, docs, pad_id, batch_size, precision="fp32", pad_side="right"):
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(docs), batch_size):
        batch = collate(docs[i : i + batch_size], pad_id, pad_side)
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        n = batch["labels"][:, 1:].numel()
        total += lm_loss(logits, batch["labels"], n).item() * n
        count += n
    model.train(was)
    return total / count


def test_reference_evaluate_and_split_are_silent(run):
    for det in (EvalContract(), SplitOverlap()):
        det.on_start(context(run))
        assert not det.findings, det.findings


@pytest.mark.parametrize("broken, words", [(evaluate_train_mode, "train mode"), (evaluate_over_positions, "real")])
def test_evaluate_contract(run, broken, words):
    det = EvalContract()
    det.on_start(context(run, **{"model.evaluate.evaluate": broken}))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("eval", "model.evaluate.evaluate")]
    assert words in det.findings[0].message


def test_random_split_is_blamed_on_split_of(run):
    def split_random(text, val_fraction):
        return "val" if random.random() < val_fraction else "train"

    state = random.getstate()
    det = SplitOverlap()
    det.on_start(context(run, **{"model.corpus.split_of": split_random}))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("eval", "model.corpus.split_of")]
    assert random.getstate() == state  # the probe leaves the run's RNG alone


def test_reference_evaluate_is_what_the_probe_expects(run):
    docs = list(run.corpus.val[:8])
    assert evaluate(run.model, docs, 0, 4) == pytest.approx(evaluate(run.model, docs, 0, 8), rel=1e-5)
