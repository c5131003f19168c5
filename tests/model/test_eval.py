"""The eval loop measures the model, not the dropout noise or the padding."""

import torch

from faultbench.model.data import collate
from faultbench.model.evaluate import evaluate
from faultbench.model.loss import lm_loss
from faultbench.model.run import build_run


def test_evaluate_is_deterministic_and_in_eval_mode_even_with_dropout(tiny_cfg):
    run = build_run(tiny_cfg.replace(model={"dropout": 0.3}))
    docs, pad = run.corpus.val[:96], run.tokenizer.pad_id
    first, second = evaluate(run.model, docs, pad, 32), evaluate(run.model, docs, pad, 32)
    assert first == second  # dropout on during eval would make these differ
    assert run.model.training  # the caller's mode is restored
    run.model.eval()
    with torch.no_grad():
        batch = collate(docs, pad)
        manual = lm_loss(run.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"]),
                         batch["labels"]).item()
    assert abs(first - manual) < 1e-5
