"""Mask detectors: contract probes flag hand-broken mask builders and attention, and stay silent on the reference."""

import pytest
import torch
import torch.nn.functional as F

from detectors.mask import CausalityProbe, MaskContract, PaddingInvariance, check_build_mask
from model.attention import build_attention_mask
from model.run import build_run
from tests.detectors.helpers import context


def transposed_mask(attention_mask, query_len, dtype):
    """Causal part transposed: queries see the keys after them."""
    batch, key_len = attention_mask.shape
    query_pos = torch.arange(key_len - query_len, key_len)[None, :]
    key_pos = torch.arange(key_len)[:, None]
    allowed = ((key_pos <= query_pos) & attention_mask.bool()[:, None, :]) | (key_pos == query_pos)
    mask = torch.zeros(batch, 1, query_len, key_len, dtype=dtype)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def fp32_min_mask(attention_mask, query_len, dtype):
    """float32's min cast to dtype (-inf in fp16), no self-attention guarantee."""
    batch, key_len = attention_mask.shape
    query_pos = torch.arange(key_len - query_len, key_len)[:, None]
    allowed = (torch.arange(key_len)[None, :] <= query_pos) & attention_mask.bool()[:, None, :]
    mask = torch.zeros(batch, 1, query_len, key_len)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min).to(dtype)


def attend_not_causal(q, k, v, attn_mask, dropout_p):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=False)


@pytest.fixture(scope="module")
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}, data={"pad_side": "left"}))


def test_reference_mask_keeps_its_contract():
    assert check_build_mask(build_attention_mask, torch.device("cpu")) == {}


@pytest.mark.parametrize("broken, words", [(transposed_mask, "later keys"), (fp32_min_mask, "-inf")])
def test_contract_flags_broken_builders(broken, words):
    failures = check_build_mask(broken, torch.device("cpu"))
    assert failures and any(words in p for problems in failures.values() for p in problems)


def test_mask_contract_reports_the_builder(run):
    det = MaskContract()
    det.on_start(context(run))
    assert not det.findings
    det.on_start(context(run, **{"model.attention.build_attention_mask": transposed_mask}))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("mask", "model.attention.build_attention_mask")]


def test_model_probes_silent_on_the_reference(run):
    for cls in (CausalityProbe, PaddingInvariance):
        det = cls()
        det.on_start(context(run))
        assert not det.findings, det.findings


def test_padding_invariance_blames_the_mask_free_path(run, monkeypatch):
    """The model itself runs a non-causal attend: right padding changes logits, the explicit mask path is fine."""
    monkeypatch.setattr("model.attention.attend", attend_not_causal)
    det = PaddingInvariance()
    det.on_start(context(run))
    assert det.findings and det.findings[0].seam == "model.attention.attend"
    assert det.findings[0].subsystem == "mask"
