"""Configuration: small frozen dataclasses for the model, data and training, and named presets.

Every config validates itself on construction and raises ``ValueError`` with a message that says
what to change. ``RunConfig`` checks what only makes sense across the three (sequence length vs the
position table, vocabulary sizes).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

PRECISIONS = ("fp32", "bf16", "fp16")
PAD_SIDES = ("left", "right")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    max_positions: int = 64  # size of the RoPE table: the longest sequence the model accepts
    dropout: float = 0.0
    bias: bool = True
    rope_base: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "max_positions"):
            _require(getattr(self, name) > 0, f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        _require(
            self.n_embd % self.n_head == 0,
            f"n_head={self.n_head} does not divide n_embd={self.n_embd}; pick n_embd as a multiple of n_head",
        )
        _require(
            self.head_dim % 2 == 0,
            f"RoPE rotates pairs of channels, so head_dim = n_embd / n_head must be even, got {self.head_dim}",
        )
        _require(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        _require(self.init_std > 0, f"init_std must be positive, got {self.init_std}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class DataConfig:
    # the synthetic corpus (see model/corpus.py)
    num_words: int = 48  # lexicon size of the word-level Markov source
    branching: int = 5  # successors per word
    short_stop: float = 0.12  # per-word stop probability of an ordinary document
    long_fraction: float = 0.03  # share of rare long documents
    long_stop: float = 0.02  # per-word stop probability of a long document
    max_words: int = 160  # hard cap on document length (the source stops there)
    num_docs: int = 20000
    val_fraction: float = 0.05
    corpus_seed: int = 1234
    # tokenizer and examples
    vocab_size: int = 256  # BPE target vocabulary, special tokens included
    seq_len: int = 64  # longest example in tokens, BOS and EOS included
    truncate: bool = True  # cut over-long documents to seq_len, keeping EOS
    pad_side: str = "right"

    def __post_init__(self) -> None:
        _require(self.num_words >= 2, f"num_words must be >= 2, got {self.num_words}")
        _require(
            1 <= self.branching <= self.num_words,
            f"branching must be in [1, num_words={self.num_words}], got {self.branching}",
        )
        for name in ("short_stop", "long_stop"):
            _require(0.0 < getattr(self, name) <= 1.0, f"{name} must be in (0, 1], got {getattr(self, name)}")
        _require(0.0 <= self.long_fraction <= 1.0, f"long_fraction must be in [0, 1], got {self.long_fraction}")
        _require(self.max_words >= 1, f"max_words must be >= 1, got {self.max_words}")
        _require(self.num_docs >= 10, f"num_docs must be >= 10, got {self.num_docs}")
        _require(0.0 < self.val_fraction < 1.0, f"val_fraction must be in (0, 1), got {self.val_fraction}")
        _require(self.seq_len >= 3, f"seq_len must be >= 3 (BOS, one token, EOS), got {self.seq_len}")
        _require(
            self.pad_side in PAD_SIDES, f"unknown pad_side {self.pad_side!r}; expected one of {PAD_SIDES}"
        )


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16  # documents per optimizer step (the whole accumulation window)
    accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    precision: str = "fp32"
    init_scale: float = 2.0**16  # GradScaler's first scale (fp16 only)
    eval_batch_size: int = 64
    device: str = "cpu"
    world_size: int = 1  # data-parallel ranks; each takes batch_size / world_size documents a step
    zero: bool = False  # shard optimizer state across ranks (ZeroRedundancyOptimizer)

    def __post_init__(self) -> None:
        _require(
            self.precision in PRECISIONS,
            f"unknown precision {self.precision!r}; expected one of {PRECISIONS}",
        )
        _require(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _require(self.accum >= 1, f"accum must be >= 1, got {self.accum}")
        _require(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        _require(
            self.batch_size % (self.accum * self.world_size) == 0,
            f"batch_size={self.batch_size} must be divisible by accum={self.accum} x world_size="
            f"{self.world_size} (equal micro-batches on every rank)",
        )
        _require(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"need 0 <= min_lr <= lr and lr > 0, got {self}")
        _require(0 <= self.warmup_steps <= self.steps, f"warmup_steps must be in [0, steps], got {self.warmup_steps}")
        _require(all(0.0 <= b < 1.0 for b in self.betas), f"betas must be in [0, 1), got {self.betas}")
        _require(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        _require(self.eval_batch_size >= 1, f"eval_batch_size must be >= 1, got {self.eval_batch_size}")

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // (self.accum * self.world_size)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        _require(
            self.data.seq_len <= self.model.max_positions,
            f"seq_len={self.data.seq_len} is longer than the position table (max_positions="
            f"{self.model.max_positions}); lower data.seq_len or raise model.max_positions",
        )
        _require(
            self.data.vocab_size <= self.model.vocab_size,
            f"tokenizer vocab_size={self.data.vocab_size} exceeds the model's embedding table "
            f"(vocab_size={self.model.vocab_size})",
        )
        if not self.data.truncate:
            # Without truncation every document must fit the position table. A byte-level token spans
            # at least one character, so characters + BOS + EOS bound a document's token count.
            from .corpus import longest_document_chars

            bound = longest_document_chars(self.data) + 2
            _require(
                bound <= self.model.max_positions,
                f"truncate=False but documents can reach {bound} tokens, longer than the position table "
                f"(max_positions={self.model.max_positions}); enable truncation or cap data.max_words",
            )

    def replace(self, **sections: dict) -> RunConfig:
        """A copy with fields overridden per section: ``cfg.replace(train={"steps": 10}, seed=3)``."""
        updates = {}
        for name, value in sections.items():
            if name == "seed":
                updates["seed"] = value
            else:
                updates[name] = dataclasses.replace(getattr(self, name), **value)
        return dataclasses.replace(self, **updates)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        train = dict(d["train"])
        train["betas"] = tuple(train["betas"])
        return cls(ModelConfig(**d["model"]), DataConfig(**d["data"]), TrainConfig(**train), d["seed"])


PRESETS: dict[str, RunConfig] = {
    # The bench size: ~0.12M parameters, about 10 ms per step single-threaded on a laptop-class core.
    "tiny": RunConfig(),
    # ~1.8M parameters, a richer corpus; minutes on a CPU.
    "small": RunConfig(
        model=ModelConfig(vocab_size=512, n_layer=4, n_head=6, n_embd=192, max_positions=128, dropout=0.1),
        data=DataConfig(num_words=256, branching=8, vocab_size=512, seq_len=128, num_docs=50000),
        train=TrainConfig(steps=2000, batch_size=32, lr=1e-3, min_lr=1e-4, warmup_steps=100),
    ),
    # ~25M parameters for a single GPU, bf16.
    "gpu": RunConfig(
        model=ModelConfig(vocab_size=2048, n_layer=8, n_head=8, n_embd=512, max_positions=256, dropout=0.1),
        data=DataConfig(
            num_words=1024, branching=12, vocab_size=2048, seq_len=256, num_docs=200000, max_words=400
        ),
        train=TrainConfig(
            steps=5000, batch_size=64, lr=6e-4, min_lr=6e-5, warmup_steps=200, precision="bf16", device="cuda"
        ),
    ),
}


def get_preset(name: str) -> RunConfig:
    """The named preset; an unknown name raises ``ValueError`` with the closest match."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name.lower(), PRESETS, n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} (known: {', '.join(PRESETS)})")
    return PRESETS[name]
