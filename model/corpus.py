"""A seeded synthetic text source whose probability of every document is known exactly.

The source is a word-level Markov chain over a lexicon of pseudo-words. A document is either
ordinary (stops after each word with probability ``short_stop``) or, rarely, long (``long_stop``),
so lengths have a long tail that makes padding and truncation matter. Because ``log_prob`` is exact
(the document type is marginalized out), the Bayes-optimal cross-entropy of any sample is known:
that is the **loss floor** a perfect model would reach.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config validates against the corpus (``longest_document_chars``): no import at run time
    from .config import DataConfig

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _lexicon(num_words: int, rng: random.Random) -> tuple[str, ...]:
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < num_words:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return tuple(words)


def _dirichlet(k: int, rng: random.Random) -> list[float]:
    draws = [rng.gammavariate(1.0, 1.0) for _ in range(k)]
    total = sum(draws)
    return [d / total for d in draws]


@dataclass(frozen=True)
class MarkovSource:
    """Word-level Markov source: ``start[w]`` then ``successors[w][j]`` with ``weights[w][j]``."""

    config: DataConfig
    words: tuple[str, ...]
    start: tuple[float, ...]
    successors: tuple[tuple[int, ...], ...]
    weights: tuple[tuple[float, ...], ...]

    @classmethod
    def from_config(cls, cfg: DataConfig) -> MarkovSource:
        return _build_source(cfg)

    def sample(self, num_docs: int, seed: int) -> list[str]:
        """``num_docs`` documents drawn i.i.d. from the source, deterministic in ``seed``."""
        rng = random.Random(seed)
        cfg = self.config
        start_cdf = _cdf(self.start)
        succ_cdfs = [_cdf(w) for w in self.weights]
        docs = []
        for _ in range(num_docs):
            stop = cfg.long_stop if rng.random() < cfg.long_fraction else cfg.short_stop
            word = _draw(start_cdf, rng)
            out = [self.words[word]]
            while len(out) < cfg.max_words and rng.random() >= stop:
                word = self.successors[word][_draw(succ_cdfs[word], rng)]
                out.append(self.words[word])
            docs.append(" ".join(out))
        return docs

    def log_prob(self, text: str) -> float:
        """Exact natural-log probability of a document (the document type marginalized out)."""
        index = self._index
        ids = [index[w] for w in text.split(" ")]
        logp = math.log(self.start[ids[0]])
        for prev, nxt in zip(ids, ids[1:], strict=False):
            logp += math.log(self.weights[prev][self.successors[prev].index(nxt)])
        return logp + math.log(self._length_prob(len(ids)))

    def _length_prob(self, n: int) -> float:
        cfg = self.config
        total = 0.0
        for share, stop in ((1.0 - cfg.long_fraction, cfg.short_stop), (cfg.long_fraction, cfg.long_stop)):
            ended = stop if n < cfg.max_words else 1.0  # the source always stops at max_words
            total += share * (1.0 - stop) ** (n - 1) * ended
        return total

    @cached_property
    def _index(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.words)}


def _cdf(weights) -> list[float]:
    out, acc = [], 0.0
    for w in weights:
        acc += w
        out.append(acc)
    out[-1] = 1.0  # guard the last bucket against rounding
    return out


def _draw(cdf: list[float], rng: random.Random) -> int:
    return bisect.bisect_right(cdf, rng.random())


@lru_cache(maxsize=8)
def _build_source(cfg: DataConfig) -> MarkovSource:
    rng = random.Random(cfg.corpus_seed)
    words = _lexicon(cfg.num_words, rng)
    start = tuple(_dirichlet(cfg.num_words, rng))
    successors, weights = [], []
    for _ in range(cfg.num_words):
        successors.append(tuple(rng.sample(range(cfg.num_words), cfg.branching)))
        weights.append(tuple(_dirichlet(cfg.branching, rng)))
    return MarkovSource(cfg, words, start, tuple(successors), tuple(weights))


def longest_document_chars(cfg: DataConfig) -> int:
    """An upper bound on a document's length in characters (words plus separating spaces)."""
    longest_word = max(len(w) for w in _build_source(cfg).words)
    return cfg.max_words * (longest_word + 1) - 1


def split_of(text: str, val_fraction: float) -> str:
    """``"val"`` or ``"train"``, decided by a hash of the text: identical documents share a split."""
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") / 2**32
    return "val" if bucket < val_fraction else "train"


# A corpus small enough that a dozen global batches of 16 cross an epoch boundary (143 training documents, 8
# batches an epoch); a quarter of it is validation. The combined recipes of every target train on it.
SMALL_EPOCH = {"num_docs": 200, "val_fraction": 0.25}


@lru_cache(maxsize=32)
def train_doc_count(cfg: DataConfig) -> int:
    """Documents in the training split of ``cfg``'s corpus (sampled and split, not tokenized)."""
    texts = MarkovSource.from_config(cfg).sample(cfg.num_docs, seed=cfg.corpus_seed + 1)
    return sum(split_of(t, cfg.val_fraction) == "train" for t in texts)
