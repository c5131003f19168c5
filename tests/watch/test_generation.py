"""bb_generation: a model's own greedy generate keeps the prompt, returns the tokens asked for, and emits each
time the argmax of one forward over the sequence so far (generation.declared.decoding, generation.accounting.stop).
Silent on the reference GPT and HF's Llama; found on decode loops broken by hand; not applicable to a generate that
samples by default."""

from __future__ import annotations

import pytest
import torch

from faultbench.detectors.api import NotApplicable
from faultbench.detectors.blackbox import probes
from faultbench.detectors.blackbox.lm import CausalLM
from faultbench.model.config import ModelConfig
from faultbench.model.gpt import GPT
from tests.watch.test_lm import ids, llama

torch.set_num_threads(1)


class Decoder(GPT):
    """The reference GPT with a plain decode loop of its own (no cache): ``bug`` picks how it goes wrong. Its
    head is untied: an untrained tied model predicts each token again, as a stale decode step repeats it."""

    def __init__(self, bug: str | None = None, temperature: float = 0.0):
        torch.manual_seed(0)
        super().__init__(ModelConfig(vocab_size=64))
        self.lm_head.weight = torch.nn.Parameter(torch.randn_like(self.lm_head.weight))
        self.bug, self.temperature = bug, temperature

    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 20):
        seq = input_ids
        # carried: the logits of the last call kept on the model and used for the next call's first token
        logits = self.kept if self.bug == "carried" and hasattr(self, "kept") else self(seq)
        for i in range(max_new_tokens):
            last = logits[:, 0 if self.bug == "first_position" else -1]
            if self.temperature > 0:
                token = torch.multinomial(torch.softmax(last / self.temperature, -1), 1)
            else:
                token = last.argmax(-1, keepdim=True)
            seq = torch.cat([seq, token], 1)
            if self.bug != "stale" or i == 0:  # stale: the logits are not refreshed after the first new token
                logits = self(seq)
        self.kept = self(seq)
        return torch.cat([seq, seq[:, -1:]], 1) if self.bug == "one_more" else seq


def generation(model: torch.nn.Module, seed: int = 0):
    with torch.no_grad():
        return probes.generation(CausalLM.wrap(model.eval()), ids(64, (2, 16), seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_silent_on_correct_decoders(seed):
    torch.manual_seed(seed)
    assert generation(GPT(ModelConfig(vocab_size=64)), seed) is None  # its own KV-cache decode
    assert generation(llama(seed), seed) is None  # transformers' generate: the tokens asked, the prompt kept
    assert generation(Decoder(), seed) is None


@pytest.mark.parametrize("bug", ["first_position", "stale", "one_more", "carried"])
def test_a_decode_loop_that_picks_the_wrong_token_or_count_is_found(bug):
    result = generation(Decoder(bug))
    assert result is not None and (result.subsystem, result.where) == ("model", "generate")
    assert ("returned" in result.evidence) == (bug == "one_more")
    assert ("second" in result.evidence) == (bug == "carried")


def test_a_generate_that_samples_by_default_is_not_judged_by_the_argmax():
    with pytest.raises(NotApplicable, match="samples"):
        generation(Decoder(temperature=100.0))  # near-uniform: off the argmax
