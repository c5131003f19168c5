"""Positive tests of white-box detectors whose own tests checked only their helper functions (benchmarks/
detector_mutation.py: a no-op version of each passed them).

Each case hands the detector a hand-broken component (a seam function through the context, a module swapped into a
fresh run's model, or the gradient a broken training step would give) and expects its finding, with subsystem and
seam; the same detector on the intact component stays silent. The hooks are called as the harness's Suite calls
them (targets/ref/recipes.py), on the tiny preset.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from faultbench.detectors.baselines import DetectAnomaly
from faultbench.detectors.data import TokenizerRoundtrip
from faultbench.detectors.loss import LogitGradScale, LossVsFloor
from faultbench.detectors.mask import CausalityProbe
from faultbench.detectors.model import AttendContract, OutputContract
from faultbench.detectors.position import KVCacheConsistency, RopeProperties, ShiftInvariance
from faultbench.detectors.precision import NonfiniteOrigin
from faultbench.model import attention
from faultbench.model.gpt import GPT, KVCache
from faultbench.model.loss import count_targets, lm_loss
from faultbench.model.rope import apply_rope
from faultbench.model.run import build_run
from faultbench.model.train import next_micro_batches
from faultbench.targets.ref.recipes import RECIPES
from tests.detectors.helpers import context, start_findings


@pytest.fixture
def run(tiny_cfg):
    """A fresh tiny run (its model may be broken by the test)."""
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}))


def _where(findings) -> list[tuple[str, str | None]]:
    return [(f.subsystem, f.seam) for f in findings]


# ---- rope_properties: apply_rope is a rotation ----------------------------------------------------------------
def sign_slip(x, cos, sin):
    """apply_rope with the second half's sign slipped: not a rotation (norms change)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos - x1 * sin), dim=-1).to(x.dtype)


def test_rope_properties_blames_a_rope_that_is_not_a_rotation(run):
    assert start_findings(RopeProperties, run) == []
    found = start_findings(RopeProperties, run, **{"model.rope.apply_rope": sign_slip})
    assert _where(found) == [("position", "model.rope.apply_rope")]


# ---- shift_invariance: attention rotates queries and keys alike -------------------------------------------------
class CausalSelfAttention(attention.CausalSelfAttention):
    """The reference attention with the keys left unrotated (same class name: the detector looks it up by name)."""

    def forward(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        q = apply_rope(q, *rope)
        y = attention.attend(q, k, v, attn_mask, 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))


def test_shift_invariance_blames_an_attention_that_rotates_only_the_queries(run):
    assert start_findings(ShiftInvariance, run) == []
    for block in run.model.blocks:
        block.attn.__class__ = CausalSelfAttention
    found = start_findings(ShiftInvariance, run)
    assert _where(found) == [("position", "model.attention.CausalSelfAttention.forward")]
    assert found[0].evidence["relative_change"] > 1e-3


# ---- kv_cache_consistency: KVCache.update returns the keys/values written ----------------------------------------
class LateCache(KVCache):
    """KVCache writing each update one slot late (the returned keys begin with a zero slot)."""

    def update(self, layer, k, v):
        start = self.lengths[layer]
        end = start + k.shape[2]
        if self.keys[layer] is None:
            self.keys[layer] = k.new_zeros(*k.shape[:2], self.max_len + 1, k.shape[3])
            self.values[layer] = v.new_zeros(*v.shape[:2], self.max_len + 1, v.shape[3])
        self.keys[layer][:, :, start + 1:end + 1] = k
        self.values[layer][:, :, start + 1:end + 1] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def test_kv_cache_consistency_blames_a_cache_that_writes_one_slot_late(run):
    assert start_findings(KVCacheConsistency, run) == []
    found = start_findings(KVCacheConsistency, run, **{"model.gpt.KVCache": LateCache})
    assert _where(found) == [("model", "model.gpt.KVCache.update")]


# ---- logit_grad_scale: d(loss)/d(logits) is bounded by a token mean over the step's targets ------------------------
@pytest.mark.parametrize("per_micro_mean", [False, True], ids=["window_mean", "each_micro_batch_its_own_mean"])
def test_logit_grad_scale_flags_micro_batch_losses_not_normalized_by_the_window(per_micro_mean):
    """The accum recipe (4 micro-batches): a train step that averages each micro-batch over its own targets instead
    of the window's makes every logit gradient ~4x what a token mean allows."""
    run = build_run(RECIPES["accum"].config(0))
    ctx = context(run)
    det = LogitGradScale()
    det.on_start(ctx)
    micro_batches = next_micro_batches(run)
    assert len(micro_batches) == 4
    det.on_batch(ctx, micro_batches)
    window = sum(count_targets(b["labels"]) for b in micro_batches)
    for batch in micro_batches:
        logits = run.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        loss = lm_loss(logits, batch["labels"], None if per_micro_mean else window)
        (grad,) = torch.autograd.grad(loss, logits)
        det.on_forward(ctx, batch, logits)
        det.on_backward(ctx, batch, grad)
    if not per_micro_mean:
        assert det.findings == []
        return
    assert _where(det.findings) == [("optimizer", "model.train.train_step")]
    assert 3.0 < det.findings[0].evidence["ratio"] <= 4.0


# ---- nonfinite_origin: where a non-finite loss is born --------------------------------------------------------
class Log(torch.nn.Module):
    """A user's activation: log of values that can be negative (NaN)."""

    def forward(self, x):
        return torch.log(x)


@pytest.mark.parametrize("broken", [False, True], ids=["finite_loss", "log_activation"])
def test_nonfinite_origin_names_the_module_where_nan_is_born(run, broken):
    if broken:
        run.model.blocks[1].mlp.act = Log()
    ctx = context(run)
    det = NonfiniteOrigin()
    det.on_start(ctx)
    batch = next_micro_batches(run)[0]
    det.on_batch(ctx, [batch])
    with torch.no_grad():
        loss = float(lm_loss(run.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"]),
                             batch["labels"]))
    assert math.isfinite(loss) != broken
    det.on_after_step(ctx, SimpleNamespace(step=0, loss=loss))
    if not broken:
        assert det.findings == []
        return
    assert _where(det.findings) == [("model", None)]
    assert det.findings[0].evidence["origin"]["fp32"] == {"module": "blocks.1.mlp.act", "type": "Log",
                                                          "inputs_finite": True}


# ---- attend_contract: attend is softmax(q k^T / sqrt(hs) + mask) v -----------------------------------------------
def attend_scaled_by_hs(q, k, v, attn_mask, dropout_p):
    """Scores divided by hs instead of sqrt(hs) (the mask honoured, the math wrong)."""
    scale = 1.0 / q.size(-1)
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.size(-2) == k.size(-2), scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def attend_sees_next(q, k, v, attn_mask, dropout_p):
    """The mask-free path with an off-by-one causal mask (tril(1)): each query also sees the next key."""
    if attn_mask is None:
        attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


@pytest.mark.parametrize(("broken", "subsystem"), [(None, None), (attend_scaled_by_hs, "model"),
                                                   (attend_sees_next, "mask")], ids=["reference", "hs", "sees_next"])
def test_attend_contract_blames_attend_and_tells_mask_from_math(run, broken, subsystem):
    found = start_findings(AttendContract, run, **({"model.attention.attend": broken} if broken else {}))
    assert _where(found) == ([(subsystem, "model.attention.attend")] if broken else [])


# ---- causality_probe: no logit moves when later tokens change --------------------------------------------------
def test_causality_probe_finds_a_leak_in_the_models_own_attention(run, monkeypatch):
    det = CausalityProbe()
    det.on_start(context(run))
    assert det.findings == []
    monkeypatch.setattr("faultbench.model.attention.attend", attend_sees_next)  # the model runs it, as a bug would
    det = CausalityProbe()
    det.on_start(context(run))
    assert _where(det.findings) == [("mask", "model.attention.attend")]
    assert det.findings[0].evidence["relative_logit_change"]["unpadded"] > 1e-3


# ---- detect_anomaly (baseline): a NaN in backward is traced to the seam its forward ran in ------------------------
def attend_with_nan_backward(q, k, v, attn_mask, dropout_p):
    """attend plus a term that is 0 forward and NaN backward (sqrt at 0, times 0): a finite loss, a NaN gradient."""
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
    return y + (y.abs() * 0).sqrt()


@pytest.mark.parametrize("broken", [False, True], ids=["reference", "nan_in_backward"])
def test_detect_anomaly_maps_a_nan_gradient_to_its_forward_seam(run, monkeypatch, broken):
    if broken:
        monkeypatch.setattr("faultbench.model.attention.attend", attend_with_nan_backward)
    ctx = context(run)
    det = DetectAnomaly()
    batch = next_micro_batches(run)[0]
    det.on_start(ctx)
    try:
        logits = run.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        loss = lm_loss(logits, batch["labels"])
        assert math.isfinite(float(loss))
        loss.backward()
    except RuntimeError as exc:  # the harness's crash record, as the Suite hands it to on_crash
        det.on_crash(ctx, {"type": type(exc).__name__, "message": str(exc), "step": 0})
    finally:
        det.on_end(ctx, {})
    assert not torch.is_anomaly_enabled()
    assert _where(det.findings) == ([("model", "model.attention.attend")] if broken else [])


# ---- loss_vs_floor: no correct pipeline's loss is far below the corpus's Bayes-optimal loss ------------------------
def leaky_logits(batch: dict, vocab: int) -> torch.Tensor:
    """What a model that sees its targets predicts: at each position, the next input token with certainty."""
    return 20.0 * F.one_hot(batch["input_ids"].roll(-1, dims=1), vocab).float()


@pytest.mark.parametrize("leak", [None, "train", "eval"])
def test_loss_vs_floor_flags_losses_only_a_leak_can_reach(run, leak):
    ctx = context(run)
    det = LossVsFloor()
    batch = next_micro_batches(run)[0]
    with torch.no_grad():
        honest = float(lm_loss(run.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"]),
                               batch["labels"]))
        leaked = float(lm_loss(leaky_logits(batch, run.config.model.vocab_size), batch["labels"]))
    floor = run.corpus.loss_floor
    assert leaked < 0.1 * floor < floor < honest
    for step in range(3):
        record = SimpleNamespace(step=step, loss=leaked if leak == "train" else honest)
        run.history.append(record)
        det.on_after_step(ctx, record)
    det.on_end(ctx, {"val_loss": leaked if leak == "eval" else honest})
    expected = {None: [], "train": [("loss", None)], "eval": [("eval", "model.evaluate.evaluate")]}[leak]
    assert _where(det.findings) == expected
    if leak == "train":  # at the second step in a row below the floor
        assert det.findings[0].evidence["step"] == 1


# ---- output_contract: the model returns (B, T, vocab) unnormalized scores ---------------------------------------
FORWARD_BUGS = {
    "log_probabilities": lambda logits: logits.log_softmax(-1),  # the loss's log_softmax applied twice
    "probabilities": lambda logits: logits.softmax(-1),
    "last_position_only": lambda logits: logits[:, -1:],  # nanoGPT's inference shortcut left in training
}


@pytest.mark.parametrize("bug", [None, *FORWARD_BUGS])
def test_output_contract_flags_a_forward_that_returns_no_logits(run, monkeypatch, bug):
    if bug is not None:
        forward = GPT.forward
        monkeypatch.setattr(GPT, "forward", lambda self, *args, **kw: FORWARD_BUGS[bug](forward(self, *args, **kw)))
    found = start_findings(OutputContract, run)
    assert _where(found) == ([("model", "model.gpt.GPT.forward")] if bug else [])
    if bug:
        assert ("output shape" if bug == "last_position_only" else bug.replace("_", "-")) in found[0].message


# ---- tokenizer_roundtrip: encode wraps [bos, ..., eos], encode_batch agrees with encode, decode inverts encode ------
class BrokenTokenizer:
    """The run's tokenizer with one bug: ``no_eos_in_batch`` (encode_batch drops each document's EOS) or
    ``decode_drops_last_char`` (decode loses the text's last character)."""

    def __init__(self, tok, bug: str):
        self._tok, self.bug = tok, bug
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id
        self.vocab_size = tok.vocab_size

    def encode(self, text):
        return self._tok.encode(text)

    def encode_batch(self, texts):
        out = self._tok.encode_batch(texts)
        return [e[:-1] for e in out] if self.bug == "no_eos_in_batch" else out

    def decode(self, ids):
        text = self._tok.decode(ids)
        return text[:-1] if self.bug == "decode_drops_last_char" else text


@pytest.mark.parametrize(("bug", "seam"), [(None, None),
                                           ("no_eos_in_batch", "model.tokenizer.Tokenizer.encode_batch"),
                                           ("decode_drops_last_char", "model.tokenizer.Tokenizer.decode")], ids=str)
def test_tokenizer_roundtrip_blames_the_broken_method(run, bug, seam):
    if bug is not None:  # the run as the detector sees it, with that tokenizer (the shared corpus left alone)
        run = SimpleNamespace(config=run.config, corpus=run.corpus, model=run.model, step=run.step,
                              tokenizer=BrokenTokenizer(run.tokenizer, bug))
    found = start_findings(TokenizerRoundtrip, run)
    assert _where(found) == ([("data", seam)] if bug else [])
