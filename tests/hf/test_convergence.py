"""Convergence: the HF target, trained 300 steps on the reference's corpus, approaches its loss floor.

The floor (Bayes-optimal nats per predicted token of the val documents) is the reference's, since the
HF pipeline yields the reference's token ids (test_padding). The training result is cached under
``.cache/hf-convergence/`` by a digest of the target's and the reference's sources, targets/ref/recipes.py (the recipes'
corpus helpers), this file (its steps, warmup and evaluation) and the installed transformers/accelerate/torch
versions, so it is paid once per change and never read stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import accelerate
import pytest
import torch
import transformers
from transformers import DataCollatorForLanguageModeling

from faultbench.harness.digest import source_digest
from faultbench.targets.hf.hooks import train
from faultbench.targets.hf.recipes import RECIPES
from faultbench.targets.hf.run import build_run

ROOT = Path(__file__).resolve().parents[2]
STEPS = 300
# Measured (seed 0): val 1.7562 against the floor 1.6614, a gap of 0.095 (the reference: 0.10-0.11 at
# 300 steps); last train loss 1.607. 300 steps cost 32 s cold on the shared 2-core machine.
MARGIN = 0.15


def val_loss(run) -> float:
    """Token-weighted next-token loss over every val document (the floor's own unit), batches of 128."""
    collate = DataCollatorForLanguageModeling(run.tokenizer, mlm=False)
    docs = [{"input_ids": run.tokenizer(t, truncation=True)["input_ids"]} for t in run.texts.val]
    total, count = 0.0, 0
    model = run.model.eval()
    with torch.no_grad():
        for i in range(0, len(docs), 128):
            batch = collate(docs[i:i + 128])
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += model(**batch).loss.item() * n
            count += n
    return total / count


def train_result(tmp_path) -> dict:
    # the targets' and the reference's sources (their recipes included), the runner's glue and this file's settings
    sources = source_digest("targets", "model", "harness/case.py", "harness/record.py", "harness/suite.py",
                           "tests/hf/test_convergence.py")
    key = "|".join((sources, transformers.__version__, accelerate.__version__, torch.__version__))
    path = ROOT / ".cache" / "hf-convergence" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())
    run = build_run(dataclasses.replace(RECIPES["fp32"], steps=STEPS, warmup_steps=20), 0, tmp_path)
    train(run)
    result = {"val_loss": val_loss(run), "floor": run.loss_floor, "first_loss": run.history[0].loss,
              "last_loss": run.history[-1].loss}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


@pytest.mark.slow
def test_hf_target_approaches_the_loss_floor(tmp_path):
    r = train_result(tmp_path)
    gap = r["val_loss"] - r["floor"]
    assert 0.0 < gap < MARGIN, f"val {r['val_loss']:.4f} is {gap:.4f} above the floor {r['floor']:.4f}"
    assert r["first_loss"] > 5.0 and r["last_loss"] < 2.6  # from ~ln(173) down towards the floor
