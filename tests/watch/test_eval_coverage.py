"""bb_eval_coverage: every reported evaluation covers the documents the known-good runs' evaluation covered.

A loop evaluates a fixed validation split of 21 documents in batches of 4 and reports the token-mean loss. Its golden
comes from two clean runs (other seeds); a clean third run is silent, an evaluation that drops the last partial batch
and one that evaluates the last batch twice (a padded shard gathered as is) are found, after the step they follow.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import faultbench
from tests.watch.test_conventions import IGNORE, SinusoidalLM, batch

torch.set_num_threads(1)

VAL = 21  # validation documents: the last batch of 4 is partial


def _validation() -> list[dict]:
    rng = torch.Generator().manual_seed(123)
    rows = batch(rng)
    docs = []
    while len(docs) < VAL:
        docs += [{k: v[i:i + 1] for k, v in rows.items()} for i in range(rows["input_ids"].shape[0])]
        rows = batch(rng)
    return docs[:VAL]


def evaluate(model, bug: str | None) -> float:
    docs = _validation()
    batches = [docs[i:i + 4] for i in range(0, VAL, 4)]
    if bug == "drop_last":
        batches = [b for b in batches if len(b) == 4]
    if bug == "repeat_last":
        batches.append(batches[-1])
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for group in batches:
            inputs = {k: torch.cat([d[k] for d in group]) for k in group[0]}
            logits = model(inputs["input_ids"], inputs["attention_mask"]).logits
            labels = inputs["labels"][:, 1:]
            total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           ignore_index=IGNORE, reduction="sum"))
            count += int((labels != IGNORE).sum())
    model.train()
    return total / count


def run(seed: int, bug: str | None = None, golden=None):
    torch.manual_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    model = SinusoidalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with faultbench.watch(model, optimizer, golden=golden, report=False,
                          detectors=["bb_eval_coverage", "bb_eval_loss"]) as w:
        for step in range(6):
            model(**batch(rng)).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 3 == 2:
                w.observe(eval_loss=evaluate(model, bug))
    assert w.errors == {}
    return w


@pytest.fixture(scope="module")
def golden():
    return faultbench.record_golden([run(1), run(2)])


def test_the_golden_records_each_evaluations_documents(golden):
    assert golden["eval_sizes"] == {"3": [VAL], "6": [VAL]}


def test_a_clean_run_is_silent_and_without_a_golden_not_applicable(golden):
    assert run(0, golden=golden).findings == []
    assert "golden" in run(0).not_applicable["bb_eval_coverage"]


@pytest.mark.parametrize(("bug", "size"), [("drop_last", 20), ("repeat_last", 22)])
def test_an_evaluation_that_drops_or_repeats_documents_is_an_eval_finding(golden, bug, size):
    found = [(f.detector, f.subsystem, f.where, f.evidence) for f in run(0, bug, golden).findings
             if f.detector == "bb_eval_coverage"]
    code = found[0][3].pop("code")
    assert found == [("bb_eval_coverage", "eval", "eval", {"step": 3, "documents": size, "golden": VAL})]
    assert code["qualname"] == f"{__name__}.evaluate" and code["library"] is None  # the code that evaluated
