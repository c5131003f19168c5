"""Padding: a prompt's logits are the same alone and inside a padded batch, on either side; the HF data
pipeline yields exactly the reference's token ids (so the reference's loss floor applies to it)."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorForLanguageModeling

from faultbench.model.data import load_corpus

TOL = 1e-5  # measured: 1.6e-7 (left) and 1.5e-7 (right)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_document_alone(fresh_model, side):
    model, tok, run = fresh_model
    tok.padding_side = side
    docs = [run.trainer.train_dataset[i] for i in range(6)]
    batch = DataCollatorForLanguageModeling(tok, mlm=False)(docs)
    assert (batch["input_ids"] == tok.pad_token_id).any(), "the batch needs padding to test anything"
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        for row, doc in enumerate(docs):
            n = len(doc["input_ids"])
            alone = model(input_ids=torch.tensor([doc["input_ids"]])).logits[0]
            padded = logits[row, :n] if side == "right" else logits[row, -n:]
            gap = (padded - alone).abs().max().item()
            assert gap < TOL, f"{side} padding changes document {row}'s logits by {gap:.2e}"
    tok.padding_side = "right"


def test_labels_ignore_pads_only(fresh_model):
    _, tok, run = fresh_model
    docs = [run.trainer.train_dataset[i] for i in range(6)]
    batch = DataCollatorForLanguageModeling(tok, mlm=False)(docs)
    pads = batch["attention_mask"] == 0
    assert (batch["labels"][pads] == -100).all()
    assert (batch["labels"][~pads] == batch["input_ids"][~pads]).all()  # EOS stays a target: pad != eos


def test_hf_tokens_are_the_reference_tokens(fresh_model):
    """bos + text + eos, truncated to seq_len keeping EOS: the same ids as model.data's corpus."""
    _, _, run = fresh_model
    corpus = load_corpus(run.config.data)
    dataset = run.trainer.train_dataset
    assert len(dataset) == len(corpus.train)
    longest = sorted(range(len(corpus.train)), key=lambda i: -len(corpus.train[i]))[:20]  # truncated ones
    for i in [*range(200), *longest]:
        assert tuple(dataset[i]["input_ids"]) == corpus.train[i]
    assert len(corpus.train[longest[0]]) == run.config.data.seq_len
