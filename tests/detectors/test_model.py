"""Model detectors: attend diagnosis, output contract, init envelope against a hand-made golden."""

import pytest
import torch
import torch.nn.functional as F

from faultbench.detectors.api import RunContext
from faultbench.detectors.model import InitEnvelope, ModuleComposition, output_kind
from faultbench.detectors.probes import attend_diagnosis
from faultbench.model.attention import attend
from faultbench.model.run import build_run
from faultbench.model.seams import SEAMS, resolve
from tests.detectors.helpers import REF_ROLES

CPU = torch.device("cpu")


def _scores(q, k, attn_mask, scale=None):
    """q k^T * scale plus the additive mask, or the causal mask (-inf) when there is none."""
    scores = q @ k.transpose(-2, -1) * (q.size(-1) ** -0.5 if scale is None else scale)
    if attn_mask is None:
        return scores.masked_fill(~torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(), float("-inf"))
    return scores + attn_mask


def sees_next_when_unmasked(q, k, v, attn_mask, dropout_p):
    """Mask-free path with an off-by-one causal mask: each query sees the next key (a mask bug)."""
    keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(1) if attn_mask is None else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask if keep is None else keep)


def mask_keys_reversed(q, k, v, attn_mask, dropout_p):
    """The explicit mask applied with its key axis reversed: forbidden keys get weight (a mask bug)."""
    return torch.softmax(_scores(q, k, None if attn_mask is None else attn_mask.flip(-1)), -1) @ v


def scaled_by_hs(q, k, v, attn_mask, dropout_p):
    """Scores divided by hs instead of sqrt(hs): the mask is honoured, the math is wrong (a model bug)."""
    return torch.softmax(_scores(q, k, attn_mask, 1.0 / q.size(-1)), -1) @ v


def unnormalized(q, k, v, attn_mask, dropout_p):
    """exp(scores - max) @ v without dividing by the row sum: weights do not sum to one (a model bug)."""
    scores = _scores(q, k, attn_mask)
    return (scores - scores.amax(-1, keepdim=True)).exp() @ v


def clamped_scores(q, k, v, attn_mask, dropout_p):
    """Scores clamped to +-30 (a guard against overflow): right on ordinary inputs, wrong on large ones."""
    return torch.softmax(_scores(q, k, attn_mask).clamp(-30, 30), -1) @ v


def test_attend_diagnosis():
    assert attend_diagnosis(attend, CPU) is None
    got = {fn.__name__: (attend_diagnosis(fn, CPU) or {}).get("subsystem") for fn in (
        sees_next_when_unmasked, mask_keys_reversed, scaled_by_hs, unnormalized, clamped_scores)}
    assert got == {"sees_next_when_unmasked": "mask", "mask_keys_reversed": "mask", "scaled_by_hs": "model",
                   "unnormalized": "model", "clamped_scores": "precision"}


def test_output_kind():
    logits = torch.randn(2, 5, 32)
    assert output_kind(logits) is None
    assert output_kind(logits.softmax(-1)) == "probabilities"
    assert output_kind(logits.log_softmax(-1)) == "log-probabilities"


@pytest.fixture
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}))


def golden_of(model):
    shared = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    trace = {"structure": {"num_params": sum(p.numel() for p in model.parameters()),
                           "shared": sorted(n for n in shared.values() if len(n) > 1)},
             "param_rms": {n: float(p.detach().pow(2).mean().sqrt()) for n, p in model.named_parameters()},
             "activation_rms": {}}
    return {"seeds": [0], "runs": [trace]}


def test_init_envelope(run):
    ctx = RunContext(run=run, seam_resolver=resolve, seams=dict(SEAMS), golden=golden_of(run.model), roles=REF_ROLES)
    det = InitEnvelope()
    det.on_start(ctx)
    assert not det.findings
    with torch.no_grad():
        run.model.blocks[0].mlp.fc.weight.mul_(10)
    det = InitEnvelope()
    det.on_start(ctx)
    assert [(f.subsystem, f.seam) for f in det.findings] == [("model", "model.gpt.GPT.init_weights")]


def test_module_composition(run, monkeypatch):
    ctx = RunContext(run=run, seam_resolver=resolve, seams=dict(SEAMS), roles=REF_ROLES)
    det = ModuleComposition()
    det.on_start(ctx)
    assert not det.findings

    def normed_residual(self, x, rope, attn_mask, cache=None, layer_idx=0):
        x = self.ln_1(x)
        x = x + self.attn(x, rope, attn_mask, cache, layer_idx)
        return x + self.mlp(self.ln_2(x))

    monkeypatch.setattr("faultbench.model.gpt.Block.forward", normed_residual)
    det = ModuleComposition()
    det.on_start(ctx)
    assert [(f.subsystem, f.seam) for f in det.findings] == [("model", "model.gpt.Block.forward")]
