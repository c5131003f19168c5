"""Model detectors: attend diagnosis, output contract, init envelope against a hand-made golden."""

import pytest
import torch
import torch.nn.functional as F

from detectors.api import RunContext
from detectors.model import InitEnvelope, ModuleComposition, attend_diagnosis, output_kind
from model.attention import attend
from model.run import build_run
from model.seams import SEAMS, resolve

CPU = torch.device("cpu")


def test_attend_diagnosis():
    assert attend_diagnosis(attend, CPU) is None

    def not_causal(q, k, v, attn_mask, dropout_p):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)

    def keep_convention(q, k, v, attn_mask, dropout_p):
        scores = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask == 0, float("-inf"))
        return torch.softmax(scores, -1) @ v

    def wrong_axis(q, k, v, attn_mask, dropout_p):
        scores = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5
        scores = scores + attn_mask if attn_mask is not None else scores.masked_fill(
            ~torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(), float("-inf"))
        return torch.softmax(scores, -2) @ v

    assert attend_diagnosis(not_causal, CPU)["subsystem"] == "mask"
    assert attend_diagnosis(keep_convention, CPU)["subsystem"] == "mask"
    assert attend_diagnosis(wrong_axis, CPU)["subsystem"] == "model"


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
    ctx = RunContext(run=run, seam_resolver=resolve, seams=dict(SEAMS), golden=golden_of(run.model))
    det = InitEnvelope()
    det.on_start(ctx)
    assert not det.findings
    with torch.no_grad():
        run.model.blocks[0].mlp.fc.weight.mul_(10)
    det = InitEnvelope()
    det.on_start(ctx)
    assert [(f.subsystem, f.seam) for f in det.findings] == [("model", "model.gpt.GPT.init_weights")]


def test_module_composition(run, monkeypatch):
    ctx = RunContext(run=run, seam_resolver=resolve, seams=dict(SEAMS))
    det = ModuleComposition()
    det.on_start(ctx)
    assert not det.findings

    def normed_residual(self, x, rope, attn_mask, cache=None, layer_idx=0):
        x = self.ln_1(x)
        x = x + self.attn(x, rope, attn_mask, cache, layer_idx)
        return x + self.mlp(self.ln_2(x))

    monkeypatch.setattr("model.gpt.Block.forward", normed_residual)
    det = ModuleComposition()
    det.on_start(ctx)
    assert [(f.subsystem, f.seam) for f in det.findings] == [("model", "model.gpt.Block.forward")]
