"""Cached decoding: ``generate`` with the DynamicCache computes the logits a full forward of the whole
sequence gives, on a left-padded batch (the cache offsets and position ids are what a RoPE fault breaks)."""

from __future__ import annotations

import torch

# Measured: max |cached - full| = 4.8e-7 (fp32 rounding of different matmul shapes)
TOL = 1e-4


def test_cached_generate_equals_full_forward(trained):
    run = trained("fp32", steps=12)  # trained a little: a fresh model's logits are too flat to tell
    tok, model = run.tokenizer, run.model.eval()
    tok.padding_side = "left"
    prompts = [tok(t)["input_ids"][:n] for t, n in zip(run.texts.val[:4], (3, 5, 4, 6), strict=True)]
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        cached = torch.stack(out.logits, 1)  # (B, 8, V): the logits of each generated token
        mask = torch.cat([batch["attention_mask"], torch.ones_like(out.sequences[:, batch["input_ids"].shape[1]:])], 1)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        full = model(input_ids=out.sequences, attention_mask=mask, position_ids=position_ids).logits
    prompt_len = batch["input_ids"].shape[1]
    gap = (cached - full[:, prompt_len - 1:-1]).abs().max().item()
    assert gap < TOL, f"cached decoding strays {gap:.2e} from the full forward"
    assert out.sequences.shape == (4, prompt_len + 8)
