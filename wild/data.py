"""Data made locally for the wild programs: nothing is downloaded.

The corpus is English prose from Python's own standard library (the docstrings of a fixed list of modules, which
ship with every Python), so a character-level model and a small BPE tokenizer have real text to learn. A seed picks
which modules and in what order, so seeds differ in their data even for programs that pin their own RNG seed
(nanoGPT's train.py seeds torch with 1337 in code).
"""

from __future__ import annotations

import importlib
import random
import warnings

MODULES = ("collections", "json", "os", "re", "string", "textwrap", "argparse", "functools", "itertools",
           "pathlib", "random", "statistics", "typing", "dataclasses", "contextlib", "heapq", "bisect", "shutil",
           "tempfile", "logging", "unittest", "inspect", "csv", "fractions", "decimal", "calendar", "datetime")
# minGPT's chargpt samples from this prompt at its first step: every character must be in the vocabulary
PROMPT = "O God, O God!"


def documents(seed: int, count: int = 400) -> list[str]:
    """Paragraphs (docstrings split on blank lines) of the standard library, shuffled by ``seed``."""
    paragraphs = []
    for name in MODULES:
        module = importlib.import_module(name)
        texts = [module.__doc__ or ""]
        with warnings.catch_warnings():  # typing's deprecated aliases warn when read
            warnings.simplefilter("ignore", DeprecationWarning)
            texts += [getattr(v, "__doc__", None) for k, v in sorted(vars(module).items()) if not k.startswith("_")]
        texts = [t for t in texts if isinstance(t, str)]
        for text in texts:
            for para in text.split("\n\n"):
                para = " ".join(para.split())
                if 40 <= len(para) <= 600 and para.isascii():
                    paragraphs.append(para)
    paragraphs = sorted(set(paragraphs))
    random.Random(seed).shuffle(paragraphs)
    return [PROMPT, *paragraphs[:count]]


def text(seed: int, chars: int = 60_000) -> str:
    """One text of about ``chars`` characters, paragraphs joined by newlines."""
    out, total = [], 0
    for para in documents(seed, count=10_000):
        out.append(para)
        total += len(para) + 1
        if total >= chars:
            break
    return "\n".join(out) + "\n"


def nanogpt_char_dataset(folder, seed: int) -> None:
    """``data/<name>/{train,val}.bin`` and ``meta.pkl`` in the format nanoGPT's data/shakespeare_char/prepare.py
    writes (uint16 ids of the sorted characters, 90/10 split), from the local corpus instead of a download."""
    import pickle
    from pathlib import Path

    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = text(seed)
    chars = sorted(set("\n".join(documents(0, count=10_000))))  # one vocabulary for every seed
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = len(data)
    for name, part in (("train", data[: int(n * 0.9)]), ("val", data[int(n * 0.9):])):
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(folder / f"{name}.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)


def bpe_tokenizer(folder, vocab_size: int = 512, padding_side: str = "right"):
    """A byte-level BPE tokenizer trained on the local corpus, saved to ``folder`` as a transformers tokenizer
    (``AutoTokenizer.from_pretrained(folder)`` loads it offline): pad, bos, eos and unk tokens of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents(0, count=10_000), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side=padding_side)
    fast.save_pretrained(str(folder))
    return fast
