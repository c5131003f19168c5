"""Data of the HF target: the reference's synthetic corpus, as a Hugging Face user would feed it.

The texts, the split and the BPE are the reference's own (``model.corpus``, ``model.tokenizer``), so
the loss floor is the reference's ``corpus.loss_floor``. The tokenizer is that BPE wrapped in a
``PreTrainedTokenizerFast`` whose post-processor adds ``<bos> ... <eos>``; tokenizing with
``truncation=True, max_length=seq_len`` cuts the text, never the EOS, exactly as ``model.data.truncate``
does. Documents are tokenized lazily by the dataset (``TextDataset.__getitem__``), as with a
``datasets`` transform: a 16-step case touches a few hundred of the 19k documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from faultbench.model.config import DataConfig
from faultbench.model.corpus import MarkovSource, split_of
from faultbench.model.data import load_corpus
from faultbench.model.tokenizer import SPECIAL_TOKENS


@dataclass(frozen=True)
class Texts:
    """The corpus's documents by split, and the Bayes-optimal val loss (nats per predicted token)."""

    train: tuple[str, ...]
    val: tuple[str, ...]
    loss_floor: float
    tokenizer_json: str  # the reference's trained BPE


def split_texts(texts, val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val) documents, by the reference's hash split: no document text is in both."""
    train = [t for t in texts if split_of(t, val_fraction) == "train"]
    val = [t for t in texts if split_of(t, val_fraction) == "val"]
    return train, val


@lru_cache(maxsize=4)
def load_texts(cfg: DataConfig) -> Texts:
    """The documents of the reference's corpus for ``cfg`` (sampled as ``model.data.load_corpus`` does)."""
    corpus = load_corpus(cfg)  # trains (or loads) the BPE and computes the floor
    docs = MarkovSource.from_config(cfg).sample(cfg.num_docs, seed=cfg.corpus_seed + 1)
    train, val = split_texts(docs, cfg.val_fraction)
    return Texts(tuple(train), tuple(val), corpus.loss_floor, corpus.tokenizer.to_json())


def wrap_tokenizer(tokenizer_json: str, seq_len: int, padding_side: str) -> PreTrainedTokenizerFast:
    """The BPE as a ``PreTrainedTokenizerFast``: pad/bos/eos/unk set (pad != eos, so EOS stays a label),
    ``<bos> text <eos>`` added on encoding, ``model_max_length = seq_len``, pads on ``padding_side``."""
    backend = BackendTokenizer.from_str(tokenizer_json)
    pad, bos, eos, unk = SPECIAL_TOKENS
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, backend.token_to_id(bos)), (eos, backend.token_to_id(eos))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos,
                                   unk_token=unk, model_max_length=seq_len, padding_side=padding_side)


class TextDataset(torch.utils.data.Dataset):
    """Documents tokenized on access: item i is ``{"input_ids": [bos, ..., eos]}``, at most seq_len ids."""

    def __init__(self, texts, tokenizer: PreTrainedTokenizerFast):
        self.texts, self.tokenizer = texts, tokenizer

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict:
        ids = self.tokenizer(self.texts[i], truncation=True, max_length=self.tokenizer.model_max_length)["input_ids"]
        return {"input_ids": ids}
