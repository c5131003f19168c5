"""Two contracts of the model's forward, probed black-box on hand-broken components written for them (catalogue
``attention.isolation.rows``, ``blocks.invariance.batch-independent-norm``, ``blocks.accounting.every-layer-once``):

- rows are isolated: a row's logits are the same alone and among other rows (``bb_row_isolation``); broken here by an
  attention that runs over the batch flattened into one sequence (a later row sees the rows before it) and by a
  normalization over the batch; the module where it is born is named, and the probes that compare rows of one batch
  stay silent (their reference is gone);
- every declared layer runs once per forward (``bb_layers_once``); broken by a forward that skips the last layer and
  one that runs the first layer twice in place of the second; named as the forward that iterates the stack.
Correct models (the reference GPT, the tiny Llama, nanoGPT, GPT-2, and a mixture-of-experts layer whose experts see
only the tokens routed to them) stay silent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from faultbench.detectors.blackbox import probes
from faultbench.detectors.blackbox.lm import CausalLM
from tests.watch import nanogpt
from tests.watch.test_lm import ids, llama
from tests.watch.test_probes import broken, gpt2, nano, nano_batch, ref_gpt, run_probes

torch.set_num_threads(1)
ISOLATION = ("row_isolation", "layers_once")


class FlattenedAttention(nanogpt.CausalSelfAttention):
    """Attends over the batch as one sequence: (B, T) rows become one row of B * T tokens under a causal mask, so
    row b sees every token of the rows before it (sequence packing without a per-row mask)."""

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.reshape(1, B * T, self.n_head, C // self.n_head).transpose(1, 2)  # (1, nh, B*T, hs)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def nano_with(attention=None, forward=None, seed: int = 0, layers: int = 2) -> CausalLM:
    """nanoGPT (``layers`` blocks) with its attention replaced, or its forward."""
    model, _, _ = nanogpt.build(seed=seed, model_cfg=nanogpt.GPTConfig(vocab_size=nanogpt.TOKENIZER.vocab_size,
                                                                       n_layer=layers))
    if attention is not None:
        for block in model.transformer.h:
            fixed = attention(model.config)
            fixed.load_state_dict(block.attn.state_dict())
            block.attn = fixed
    if forward is not None:
        model.forward = forward.__get__(model)
    return CausalLM.wrap(model.eval())


def skips_last_layer(self, idx, targets=None):
    """nanoGPT's forward over all layers but the last (``h[:-1]``: an off-by-one in the layer loop)."""
    x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1), device=idx.device))
    for block in self.transformer.h[:-1]:
        x = block(x)
    return self.lm_head(self.transformer.ln_f(x)), None


def first_layer_twice(self, idx, targets=None):
    """nanoGPT's forward calling ``h[0]`` where ``h[1]`` belongs (a copy-pasted index)."""
    x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1), device=idx.device))
    for i in range(len(self.transformer.h)):
        x = self.transformer.h[0 if i == 1 else i](x)
    return self.lm_head(self.transformer.ln_f(x)), None


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_over_the_flattened_batch_breaks_row_isolation_in_the_first_attention(seed):
    results = run_probes(nano_with(FlattenedAttention, seed=seed), nano_batch(seed)[0])
    assert broken(results) == {"row_isolation": ("model", "transformer.h.0.attn")}  # not causality, not determinism


def test_a_normalization_over_the_batch_breaks_row_isolation_where_it_is():
    model = llama(0)
    mlp = model.model.layers[1].mlp
    handle = mlp.register_forward_hook(lambda module, args, out: out - out.mean(0, keepdim=True))
    try:
        results = run_probes(CausalLM.wrap(model), ids(64, (4, 16)))
    finally:
        handle.remove()
    assert broken(results) == {"row_isolation": ("model", "model.layers.1.mlp")}


@pytest.mark.parametrize(("forward", "counts"), [(skips_last_layer, [1, 1, 0]), (first_layer_twice, [2, 0, 1])])
def test_a_layer_skipped_or_run_twice_is_named_in_the_forward_that_runs_the_stack(forward, counts):
    lm = nano_with(forward=forward, layers=3)
    assert len(lm.model.transformer.h) == 3
    results = run_probes(lm, nano_batch(0)[0])
    assert broken(results) == {"layers_once": ("model", "transformer")}
    assert results["layers_once"].evidence["layer_calls"] == {"transformer.h": counts}


class MixtureOfExperts(nn.Module):
    """A top-1 mixture: each expert is called on the tokens routed to it only (a few of the row's tokens each)."""

    def __init__(self, width: int, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            if bool((choice == i).any()):
                out[choice == i] = expert(flat[choice == i])
        return x + out.reshape(x.shape)


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_correct_models(seed):
    moe = nano(seed)
    for block in moe.model.transformer.h:
        block.mlp = MixtureOfExperts(moe.model.config.n_embd)
    cases = [(ref_gpt(seed), ids(64, (4, 16), seed), "relative"),
             (CausalLM.wrap(llama(seed)), ids(64, (4, 16), seed), "relative"), (nano(seed), nano_batch(seed)[0], None),
             (gpt2(seed), ids(64, (4, 16), seed), None), (CausalLM.wrap(moe.model.eval()), nano_batch(seed)[0], None)]
    for lm, batch, positions in cases:
        results = run_probes(lm, batch, positions=positions)
        assert {p: results[p] for p in ISOLATION} == {p: None for p in ISOLATION}
        assert broken(results) == {}


def test_the_layer_counter_counts_calls_on_the_residual_stream_only():
    model = nano(0).model
    with probes.counted_layers(model, (2, 5)) as calls:
        model(torch.zeros(2, 5, dtype=torch.long))
        model(torch.zeros(3, 5, dtype=torch.long))  # another batch shape: not counted
    assert calls == {"transformer.h": [1, 1]}
