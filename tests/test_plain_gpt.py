"""The benchmark baseline (benchmarks/plain_gpt.py) computes the same function as the reference GPT."""

import torch

from benchmarks.plain_gpt import PlainGPT, lm_loss
from faultbench.model.config import ModelConfig
from faultbench.model.data import collate
from faultbench.model.gpt import GPT
from faultbench.model.loss import lm_loss as reference_lm_loss


def _pair(cfg: ModelConfig) -> tuple[GPT, PlainGPT]:
    torch.manual_seed(0)
    reference = GPT(cfg)
    plain = PlainGPT(cfg)
    plain.load_state_dict(reference.state_dict())  # strict: same names and shapes
    assert plain.lm_head.weight is plain.wte.weight  # still tied after loading
    return reference.eval(), plain.eval()


def test_same_logits_on_unpadded_batch():
    cfg = ModelConfig()
    reference, plain = _pair(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (reference(ids) - plain(ids)).abs().max().item()
    assert diff < 1e-5


def test_same_loss_and_grads_on_right_padded_batch():
    # The benchmark feeds right-padded batches to both models; ignoring padding must not change the step.
    cfg = ModelConfig(bias=False)
    reference, plain = _pair(cfg)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 11)]
    batch = collate(docs, pad_id=0, pad_side="right")
    ref_loss = reference_lm_loss(
        reference(batch["input_ids"], batch["attention_mask"], batch["position_ids"]), batch["labels"]
    )
    plain_loss = lm_loss(plain(batch["input_ids"]), batch["labels"])
    ref_loss.backward()
    plain_loss.backward()
    assert abs(ref_loss.item() - plain_loss.item()) < 1e-5
    ref_grads = dict(reference.named_parameters())
    for name, param in plain.named_parameters():
        assert (param.grad - ref_grads[name].grad).abs().max().item() < 1e-5, name
