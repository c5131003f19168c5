"""Gradient accumulation: 4 micro-batches of 4 documents train exactly like one batch of 16.

Trainer counts the window's target tokens (``num_items_in_batch``) and the Llama loss divides each
micro-batch's summed cross-entropy by that count, so the micro-batch gradients add up to the big
batch's token mean. Warmup 0: the warmup's first learning rate is 0 and would hide any difference.
"""

from __future__ import annotations

from tests.hf.conftest import max_gap, params

# Measured after 3 steps: params 1.7e-6 apart (they moved 6.0e-3 from init), losses <= 4.8e-7, grad
# norms <= 1.2e-7 apart: fp32 rounding of summing in another order. With the pre-4.46 accumulation bug
# (each micro-batch's own token mean, divided by accum: ``model_accepts_loss_kwargs=False``) the losses
# move by up to 1.5e-2, the grad norms by up to 0.22 and the params by 1.2e-2.
PARAM_TOL, LOSS_TOL = 2e-5, 1e-5


def test_accumulation_equals_one_big_batch(trained):
    big = trained("fp32", steps=3, warmup_steps=0)
    accum = trained("accum", steps=3, warmup_steps=0)
    assert accum.config.micro_batch_size == 4 and big.config.micro_batch_size == 16
    for b, a in zip(big.history, accum.history, strict=True):
        assert abs(b.loss - a.loss) < LOSS_TOL and abs(b.grad_norm - a.grad_norm) < LOSS_TOL * b.grad_norm
        assert b.tokens == a.tokens  # the same 16 documents
    gap = max_gap(params(big.model), params(accum.model))
    assert gap < PARAM_TOL, f"accumulated training strays {gap:.2e} from the big batch"
