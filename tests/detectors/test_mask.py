"""Mask detectors: contract probes flag hand-broken mask builders and attention, and stay silent on the reference."""

import pytest
import torch
import torch.nn.functional as F

from faultbench.detectors.mask import CausalityProbe, MaskContract, PaddingInvariance, check_build_mask
from faultbench.model.attention import build_attention_mask
from faultbench.model.run import build_run
from tests.detectors.helpers import context


def _mask(allowed, dtype, blocked):
    """(B, 1, T_q, T_k) additive mask: 0 where ``allowed`` (B, T_q, T_k), ``blocked`` elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, blocked)[:, None]


def _allowed(attention_mask, query_len, see_next=False):
    """The causal + padding entries (plus each query itself); ``see_next`` lets each query see one key further."""
    key_len = attention_mask.shape[1]
    query_pos = torch.arange(key_len - query_len, key_len)[:, None] + int(see_next)
    key_pos = torch.arange(key_len)[None, :]
    return ((key_pos <= query_pos) & attention_mask.bool()[:, None, :]) | (key_pos == query_pos - int(see_next))


def sees_next_token(attention_mask, query_len, dtype):
    """Off-by-one causal part: each query also sees the key right after it."""
    return _mask(_allowed(attention_mask, query_len, see_next=True), dtype, torch.finfo(dtype).min)


def neg_inf_no_self(attention_mask, query_len, dtype):
    """Masked entries hold -inf and pad queries get no key at all: their softmax rows are NaN in every dtype."""
    key_len = attention_mask.shape[1]
    causal = torch.ones(query_len, key_len, dtype=torch.bool).tril(key_len - query_len)
    return _mask(causal & attention_mask.bool()[:, None, :], dtype, float("-inf"))


def weak_pad_constant(attention_mask, query_len, dtype):
    """Blocked entries hold -4, which does not block: real queries still put weight on pad keys."""
    return _mask(_allowed(attention_mask, query_len), dtype, -4.0)


def attend_sees_next(q, k, v, attn_mask, dropout_p):
    """Mask-free path with an off-by-one causal mask (tril(1)): each query sees the next key."""
    if attn_mask is None:
        attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


@pytest.fixture(scope="module")
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}, data={"pad_side": "left"}))


def test_reference_mask_keeps_its_contract():
    assert check_build_mask(build_attention_mask, torch.device("cpu")) == {}


@pytest.mark.parametrize("broken, words", [
    (sees_next_token, "see later keys"), (neg_inf_no_self, "NaN/inf"), (weak_pad_constant, "see pad keys")])
def test_contract_flags_broken_builders(broken, words):
    failures = check_build_mask(broken, torch.device("cpu"))
    assert failures and any(words in p for problems in failures.values() for p in problems), failures


def test_a_constant_offset_on_allowed_entries_keeps_the_contract():
    """What counts is the softmax: an allowed entry need not hold exactly 0."""
    def offset(attention_mask, query_len, dtype):
        return build_attention_mask(attention_mask, query_len, dtype) - 1.0 if query_len != attention_mask.shape[1] \
            or not bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()) else None

    assert check_build_mask(offset, torch.device("cpu")) == {}


def test_mask_contract_reports_the_builder(run):
    det = MaskContract()
    det.on_start(context(run))
    assert not det.findings
    det.on_start(context(run, **{"model.attention.build_attention_mask": sees_next_token}))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("mask", "model.attention.build_attention_mask")]


def test_model_probes_silent_on_the_reference(run):
    for cls in (CausalityProbe, PaddingInvariance):
        det = cls()
        det.on_start(context(run))
        assert not det.findings, det.findings


def test_padding_invariance_blames_the_mask_free_path(run, monkeypatch):
    """The model itself runs an attend whose mask-free path sees the next key: right padding changes logits,
    the explicit mask path is fine."""
    monkeypatch.setattr("faultbench.model.attention.attend", attend_sees_next)
    det = PaddingInvariance()
    det.on_start(context(run))
    assert det.findings and det.findings[0].seam == "model.attention.attend"
    assert det.findings[0].subsystem == "mask"
