"""Byte-level BPE tokenizer (HF ``tokenizers``) with ``<pad> <bos> <eos> <unk>``, trained and cached.

Special ids are fixed by their order: pad=0, bos=1, eos=2, unk=3. ``encode`` wraps a document in
BOS ... EOS; ``decode`` drops special tokens, so ``decode(encode(text)) == text`` for corpus text.
Training is deterministic for the same texts, and the result is cached on disk by a key of the
training texts' hash, the vocabulary size and the ``tokenizers`` version.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


class Tokenizer:
    """Thin wrapper that owns the special ids and the BOS/EOS convention."""

    def __init__(self, hf: HFTokenizer):
        self._hf = hf
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (hf.token_to_id(t) for t in SPECIAL_TOKENS)
        if None in (self.pad_id, self.bos_id, self.eos_id, self.unk_id):
            raise ValueError(f"tokenizer lacks one of the special tokens {SPECIAL_TOKENS}")

    # the special ids under the names of the tokenizer protocol (Hugging Face's), as training tools read them
    @property
    def pad_token_id(self) -> int:
        return self.pad_id

    @property
    def bos_token_id(self) -> int:
        return self.bos_id

    @property
    def eos_token_id(self) -> int:
        return self.eos_id

    @property
    def unk_token_id(self) -> int:
        return self.unk_id

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` wrapped as ``[bos, ..., eos]``."""
        return [self.bos_id, *self._hf.encode(text, add_special_tokens=False).ids, self.eos_id]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encoded = self._hf.encode_batch(texts, add_special_tokens=False)
        return [[self.bos_id, *e.ids, self.eos_id] for e in encoded]

    def decode(self, ids) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return self._hf.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        return self._hf.to_str()

    @property
    def sha256(self) -> str:
        """Identity of the vocabulary and merges: a checkpoint records it to refuse another tokenizer."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        return cls(HFTokenizer.from_str(text))


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE on ``texts``; the alphabet is the bytes seen (others map to ``<unk>``)."""
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False, min_frequency=2
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)


def cache_dir() -> Path:
    """Where trained tokenizers are kept: ``$TOKENIZER_CACHE_DIR``, else ``.cache/tokenizers`` in the repo."""
    default = Path(__file__).resolve().parent.parent / ".cache" / "tokenizers"
    return Path(os.environ.get("TOKENIZER_CACHE_DIR", default))


def load_or_train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """The tokenizer trained on exactly ``texts`` with ``vocab_size``, cached on disk after the first use."""
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    path = cache_dir() / f"tokenizer-{digest}-v{vocab_size}-tk{tokenizers.__version__}.json"
    if path.exists():
        try:
            return Tokenizer.from_json(path.read_text())
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: trained again, never used
            print(f"discarding the bad tokenizer cache {path} ({type(e).__name__}); training it again",
                  file=sys.stderr)
            path.unlink(missing_ok=True)
    tok = train_tokenizer(texts, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    # atomic: concurrent test workers may train the same tokenizer; the last rename wins, all equal
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(tok.to_json())
    os.replace(f.name, path)
    return tok
