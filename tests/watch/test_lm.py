"""CausalLM: the call convention learned from the signature and one trial call, on the HF tiny Llama, the
nanoGPT-style model, a nanoGPT that returns only the last position without targets, and a plain-tensor model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from faultbench import targets

targets.get("hf")  # HF_HUB_OFFLINE before transformers is imported

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from faultbench.detectors.blackbox.lm import CausalLM  # noqa: E402
from tests.watch import nanogpt  # noqa: E402

torch.set_num_threads(1)


def llama(seed: int) -> LlamaForCausalLM:
    """The HF target's tiny Llama shape (targets/hf/modeling.py) on a 64-token vocabulary."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def ids(vocab: int, shape=(3, 12), seed: int = 0) -> torch.Tensor:
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


class LastOnly(nn.Module):
    """nanoGPT's inference convention: without targets only the last position's logits come back."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 16)

    def forward(self, idx, targets=None):
        logits = self.emb(idx)
        return (logits, logits.sum()) if targets is not None else (logits[:, [-1]], None)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, tokens):
        return self.emb(tokens)


@pytest.mark.parametrize("seed", [0, 1])
def test_hf_llama_is_called_by_name_and_its_cached_decode_matches_the_full_forward(seed):
    lm = CausalLM.wrap(llama(seed))
    assert (lm.takes_attention_mask, lm.takes_position_ids, lm.takes_cache, lm.by_name) == (True, True, True, True)
    x = ids(64, seed=seed)
    with torch.no_grad():
        full, decoded = lm.logits(x), lm.decode_with_cache(x)
        direct = lm.model(input_ids=x).logits
    assert full.shape == (3, 12, 64) and full.dtype == torch.float32
    assert torch.equal(full, direct)
    assert (full - decoded).abs().max() < 1e-4
    with torch.no_grad():  # a prompt prefilled in one call, then token by token
        assert (full - lm.decode_with_cache(x, prefill=5)).abs().max() < 1e-4
    assert not torch.equal(full[:, 1:], full[:, :-1])  # per-position logits, not one row repeated


def test_hf_llama_generates_through_its_own_cache_with_the_logits_of_a_full_forward():
    lm = CausalLM.wrap(llama(0))
    prompt = ids(64, (2, 6))
    with torch.no_grad():
        sequences, logits = lm.generate(prompt, torch.ones_like(prompt), new_tokens=4)
        full = lm.logits(sequences)
    assert sequences.shape == (2, 10) and torch.equal(sequences[:, :6], prompt)
    assert logits.shape == (2, 4, 64)
    assert (full[:, 5:9] - logits).abs().max() < 1e-4  # position 5 predicts the first new token
    assert torch.equal(sequences[:, 6:], logits.argmax(-1))  # greedy


@pytest.mark.parametrize("seed", [0, 1])
def test_nanogpt_is_called_positionally_and_takes_no_mask_positions_or_cache(seed):
    model, _, _ = nanogpt.build(seed=seed)
    model.eval()
    lm = CausalLM.wrap(model)
    assert (lm.takes_attention_mask, lm.takes_position_ids, lm.takes_cache, lm.by_name) == (False,) * 4
    x = ids(nanogpt.TOKENIZER.vocab_size, seed=seed)
    with torch.no_grad():
        assert torch.equal(lm.logits(x), model(x)[0])
        assert lm.decode_with_cache(x) is None and lm.generate(x) is None
        with pytest.raises(ValueError, match="takes no attention_mask"):
            lm.logits(x, attention_mask=torch.ones_like(x))


def test_a_model_that_returns_every_position_only_with_targets_gets_them():
    lm = CausalLM.wrap(LastOnly())
    assert lm.pass_targets
    assert lm.logits(ids(16)).shape == (3, 12, 16)


def test_a_plain_tensor_model_is_wrapped():
    lm = CausalLM.wrap(Plain())
    assert not lm.pass_targets and lm.logits(ids(8)).shape == (3, 12, 8)


def test_a_model_without_logits_is_refused_in_one_line():
    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.w.sum()

    with pytest.raises(ValueError, match=r"gives no \(batch, time, vocab\) logits"):
        CausalLM.wrap(Scalar())


def test_the_trial_call_leaves_training_mode_and_the_rng_as_they_were():
    model, _, _ = nanogpt.build(seed=0)  # dropout 0.1: a call in train mode would draw random numbers
    model.train()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    CausalLM.wrap(model)
    assert model.training and torch.equal(torch.rand(3), expected)


def test_the_reference_gpt_generates_through_its_own_cache_with_logits_caught_by_a_forward_hook():
    """A generate that is not transformers' (max_new_tokens, its own KV cache, returns only the sequences): the
    logits of each decode call come from a forward hook and equal one forward over the generated sequence."""
    from faultbench.model.config import ModelConfig
    from faultbench.model.gpt import GPT

    torch.manual_seed(0)
    lm = CausalLM.wrap(GPT(ModelConfig(vocab_size=64)).eval())
    assert lm.has_generate and not lm.takes_cache  # its cache argument is not past_key_values
    prompt = ids(64, (2, 6))
    with torch.no_grad():
        sequences, logits = lm.generate(prompt, torch.ones_like(prompt), new_tokens=3)
        full = lm.logits(sequences)
    assert sequences.shape == (2, 9) and logits.shape == (2, 3, 64)
    assert (full[:, 5:8] - logits).abs().max() < 1e-4
    assert torch.equal(sequences[:, 6:], logits.argmax(-1))  # its default decoding is greedy


def test_a_model_that_raises_unpadded_but_runs_padded_is_wrapped_with_its_error_kept():
    class PaddedOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 16)

        def forward(self, input_ids, attention_mask=None):
            if attention_mask is None or bool(attention_mask.all()):
                raise TypeError("no mask to read")
            return self.emb(input_ids)

    lm = CausalLM.wrap(PaddedOnly())
    assert isinstance(lm.unpadded_error, TypeError) and lm.takes_attention_mask


class NeedsTarget(nn.Module):
    """Lightning's demo convention (lightning.pytorch.demos.Transformer): ``forward(inputs, target)`` feeds the
    targets to a decoder and returns flattened log-probabilities; it cannot be called on ids alone."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, inputs, target, mask=None):
        return torch.log_softmax(self.out(self.emb(inputs) + self.emb(target)), -1).view(-1, 16)


def test_a_forward_that_requires_more_than_the_ids_is_not_wrapped_and_its_probes_are_not_applicable():
    import faultbench

    model = NeedsTarget()
    with pytest.raises(ValueError, match="requires target besides the token ids"):
        CausalLM.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with faultbench.watch(model, opt, report=False) as w:
        for _ in range(3):
            x = torch.randint(0, 16, (4, 10))
            loss = torch.nn.functional.nll_loss(model(x, x.roll(-1, 1)), x.roll(-1, 1).reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert w.errors == {}
    assert "requires target besides the token ids" in w.not_applicable["bb_causality"]
