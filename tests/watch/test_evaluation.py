"""The evaluation checks of the black-box track: the reported evaluation loss against the NLL of the evaluation
forwards (``bb_eval_loss``, through ``Watch.observe(eval_loss=...)`` and the HF callback's ``on_evaluate``), and
evaluation documents the run trained on (``bb_eval_overlap``), on the nanoGPT-style loop and a Trainer run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import faultbench
from faultbench import targets
from faultbench.detectors.blackbox.evaluation import target_nll
from tests.watch.nanogpt import TOKENIZER, TrainConfig, build, estimate_loss, get_batch

torch.set_num_threads(1)
targets.get("hf")  # sets HF_HUB_OFFLINE before transformers is imported
from transformers import TrainerCallback  # noqa: E402

CFG = TrainConfig(eval_iters=3)


def _reference_nll(logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor) -> tuple[float, int]:
    """Position by position: -log p(next token) where both positions are real."""
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if real[b, t] and real[b, t + 1]:
                total -= float(F.log_softmax(logits[b, t], -1)[ids[b, t + 1]])
                count += 1
    return total, count


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_nll_of_a_forward_is_the_same_from_labels_shifted_or_not_and_from_the_mask(side):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 30, (3, 7), generator=gen)
    lengths = torch.tensor([7, 4, 2])
    cols = torch.arange(7)[None]
    real = cols < lengths[:, None] if side == "right" else cols >= 7 - lengths[:, None]
    ids[~real] = 0
    logits = torch.randn(3, 7, 30, generator=gen)
    expected_sum, expected_n = _reference_nll(logits, ids, real)
    first = real & ~torch.cat([torch.zeros(3, 1, dtype=torch.bool), real[:, :-1]], 1)
    # the labels, when passed, decide the targets: here pads and each row's first token are ignored, as the mask says
    hf_labels = ids.masked_fill(~real | first, -100)  # aligned with the inputs, the model shifts
    preshifted = torch.cat([hf_labels[:, 1:], torch.full((3, 1), -100)], 1)  # nanoGPT's targets
    for batch in ({"input_ids": ids, "attention_mask": real.long()}, {"input_ids": ids, "labels": hf_labels},
                  {"input_ids": ids, "labels": preshifted}):
        total, n = target_nll(batch, logits)
        assert n == expected_n and total == pytest.approx(expected_sum, rel=1e-5), sorted(batch)
    assert target_nll({"input_ids": ids[:, :1]}, logits[:, :1]) is None  # a decoding step predicts nothing here
    assert target_nll({"input_ids": ids}, logits[:, -1:]) is None  # last-position logits only


def _nanogpt_run(*reports, steps: int = 3):
    """The nanoGPT-style loop for ``steps`` steps, then nanoGPT's estimate_loss (train and val splits); the loop
    reports each ``report(losses)`` as an evaluation loss (none: it reports none). -> the Watch."""
    model, optimizer, _ = build(CFG, seed=0)
    with faultbench.watch(model, optimizer, report=False) as w:
        for _ in range(steps):
            _, loss = model(*get_batch("train", CFG.batch_size, model.config.block_size))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses = estimate_loss(model, CFG)
        for report in reports:
            w.observe(eval_loss=report(losses))
    return w


def test_a_correct_eval_loss_of_either_split_is_accepted_and_a_loop_reporting_none_is_excused():
    w = _nanogpt_run(lambda losses: losses["val"], lambda losses: torch.tensor(losses["train"]))
    assert w.findings == [] and "bb_eval_loss" not in w.not_applicable and w.errors == {}
    assert "observe(eval_loss" in _nanogpt_run().not_applicable["bb_eval_loss"]


def test_an_eval_loss_summed_over_batches_is_an_eval_finding():
    """estimate_loss's per-batch losses added up and not divided by their count: eval_iters times too high."""
    w = _nanogpt_run(lambda losses: losses["val"] * CFG.eval_iters)
    top = w.findings[0]
    assert (top.detector, top.subsystem, top.where) == ("bb_eval_loss", "eval", "eval")
    assert top.evidence["reported"] / top.evidence["token_mean"] == pytest.approx(CFG.eval_iters, rel=0.05)


def _rows(step: int, offset: int) -> torch.Tensor:
    """16 distinct documents of 4 tokens."""
    return (torch.arange(64).reshape(16, 4) * step + offset) % TOKENIZER.vocab_size


def _short_rows_run(eval_rows: torch.Tensor, golden=None):
    """Train on 16 fixed rows of 4 tokens, then evaluate ``eval_rows`` and decode one token: the Watch."""
    model, optimizer, _ = build(CFG, seed=0)
    train_rows = _rows(1, 0)
    with faultbench.watch(model, optimizer, golden=golden, report=False) as w:
        for i in range(4):
            _, loss = model(train_rows[4 * i: 4 * i + 4], train_rows[4 * i: 4 * i + 4].roll(-1, 1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            model(eval_rows)
            model(train_rows[:, :1])  # a decoding step: one-token rows are not documents
    return w


def test_short_evaluation_documents_that_were_trained_on_are_an_overlap():
    held_out = _rows(7, 3)
    golden = faultbench.record_golden([_short_rows_run(held_out)])
    assert golden["eval_overlap"] == 0
    clean = _short_rows_run(held_out, golden)
    assert clean.findings == [] and clean.ctx.history[-1].evals == [16, 0]
    leaky = held_out.clone()
    leaky[:5] = _rows(1, 0)[3:8]  # five validation documents are training documents
    w = _short_rows_run(leaky, golden)
    assert w.ctx.history[-1].evals == [16, 5]
    assert [(f.detector, f.subsystem, f.where) for f in w.findings] == [("bb_eval_overlap", "eval", "eval")]


def _packed(docs: list[list[int]]) -> torch.Tensor:
    """Rows of 16 tokens, each four whole 4-token documents ending with EOS (1) one after another (packing)."""
    return torch.tensor([sum(docs[i:i + 4], []) for i in range(0, len(docs), 4)])


def _packed_run(eval_docs: list[list[int]], golden=None):
    """Train on 32 distinct documents packed four a row, then evaluate ``eval_docs`` packed the same way."""
    from tests.watch.test_gradients import Toy

    torch.manual_seed(0)
    docs = [[2 + (3 * i) % 20, 2 + (5 * i + 1) % 20, 2 + (7 * i + 2) % 21, 1] for i in range(32)]
    model = Toy(24)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with faultbench.watch(model, optimizer, golden=golden, declare={"eos_id": 1}, report=False) as w:
        for i in range(0, 32, 8):
            rows = _packed(docs[i:i + 8])
            F.cross_entropy(model(rows)[:, :-1].reshape(-1, 24), rows[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            model(_packed(eval_docs))
    return w, docs


def test_an_evaluation_of_packed_rows_overlaps_training_by_its_documents_not_its_rows():
    """Packed rows mix documents, so no evaluation row equals a training row; the documents inside them (EOS-ended)
    are compared instead: training documents packed in another order are found as an overlap."""
    held_out = [[21, 22, 23 - i % 2, 1] for i in range(8)]
    golden = faultbench.record_golden([_packed_run(held_out)[0]])
    clean, docs = _packed_run(held_out, golden)
    assert clean.findings == [] and clean.ctx.history[-1].evals == [8, 0]
    leaky, _ = _packed_run(docs[::-1][:8], golden)  # eight training documents, packed in another order
    assert leaky.ctx.history[-1].evals == [8, 8]
    assert [(f.detector, f.where) for f in leaky.findings] == [("bb_eval_overlap", "eval")]


def _metrics_reforward_run(golden=None, same_batch: bool = True):
    """As ``_short_rows_run``, but each step also runs a batch under no_grad before the step, for its metrics: the
    batch it just trained on (``same_batch``; TRL's SFTTrainer does so for its token accuracy) or the next one."""
    model, optimizer, _ = build(CFG, seed=0)
    train_rows = _rows(1, 0)
    with faultbench.watch(model, optimizer, golden=golden, report=False) as w:
        for i in range(4):
            x = train_rows[4 * i: 4 * i + 4]
            _, loss = model(x, x.roll(-1, 1))
            loss.backward()
            with torch.no_grad():
                model(x if same_batch else train_rows[(4 * i + 4) % 16: (4 * i + 4) % 16 + 4])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            model(_rows(7, 3))
    return w


def test_a_no_grad_forward_on_the_batch_just_trained_is_metrics_not_an_evaluation():
    """Only the 16 held-out rows count as evaluated; another batch's no-grad forward before the step still does
    (the watch cannot tell it from an evaluation), so its trained-on rows show as an overlap."""
    golden = faultbench.record_golden([_short_rows_run(_rows(7, 3))])
    w = _metrics_reforward_run(golden)
    assert w.findings == [] and w.ctx.history[-1].evals == [16, 0]
    other = _metrics_reforward_run(golden, same_batch=False)
    assert sum(r.evals[0] for r in other.ctx.history if r.evals) > 16


class _DoubledEvalLoss(TrainerCallback):
    """A callback before faultbench's that doubles the reported eval_loss once ``on``: a wrongly scaled metric."""

    on = False

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.on:
            metrics["eval_loss"] *= 2


def test_the_trainers_eval_loss_reaches_the_watch_and_a_scaled_one_is_found(tmp_path):
    from faultbench.hf import FaultbenchCallback
    from faultbench.targets.hf.recipes import RECIPES
    from faultbench.targets.hf.run import build_run

    run = build_run(RECIPES["fp32"], 0, tmp_path)
    doubled, callback = _DoubledEvalLoss(), FaultbenchCallback(report=False)
    run.trainer.add_callback(doubled)
    run.trainer.add_callback(callback)
    run.trainer.train()
    assert "bb_eval_loss" not in callback.watch.not_applicable  # evaluate() may still come after train()
    run.trainer.evaluate()
    assert callback.watch.findings == [], [f.message for f in callback.watch.findings]
    doubled.on = True
    run.trainer.evaluate()
    callback.close()
    top = callback.watch.findings[0]
    assert (top.detector, top.subsystem, top.where) == ("bb_eval_loss", "eval", "eval")
    assert top.evidence["reported"] / top.evidence["token_mean"] == pytest.approx(2, rel=1e-4)
