"""A nanoGPT-style model and training loop (our own code, written in the style of karpathy/nanoGPT's
model.py and train.py) with switches for five classic bugs, for the black-box track's tests.

Conventions kept from nanoGPT on purpose (a correct loop that differs from the reference's): weight decay
on every >=2-dim parameter INCLUDING the embeddings, warmup ``lr * (s + 1) / (W + 1)`` then cosine to
``min_lr``, a char-level corpus with no BOS/EOS, ``forward(idx, targets=None) -> (logits, loss)`` with
``F.scaled_dot_product_attention(..., is_causal=True)``. One departure: ``forward`` without targets returns
the logits of every position (nanoGPT returns only the last one at inference), so the model can be
probed as a causal LM.

Bugs (``train(..., bugs=(...))``):
  "no_shift"            targets = inputs (not shifted by one)            -> loss
  "no_zero_grad"        optimizer.zero_grad() removed                    -> optimizer
  "not_causal"          is_causal=False in the attention                 -> mask
  "clip_before_unscale" clip_grad_norm_ before scaler.unscale_           -> precision / optimizer
  "endless_warmup"      warmup measured in tokens, not iterations        -> optimizer
AMP: ``amp=True`` enables ``torch.amp.GradScaler("cpu")`` (torch 2.13 supports it) on fp32 compute: the loss
scaling, unscale and skip logic are the real ones; autocast is left out (bf16 on CPU would only slow it).
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

BUGS = ("no_shift", "no_zero_grad", "not_causal", "clip_before_unscale", "endless_warmup")


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1
    bias: bool = True
    causal: bool = True  # False is the "not_causal" bug


@dataclass(frozen=True)
class TrainConfig:
    """train.py's knobs (a tiny char-level config)."""

    max_iters: int = 30
    batch_size: int = 8
    gradient_accumulation_steps: int = 2
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 5
    lr_decay_iters: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    amp: bool = False  # GradScaler enabled
    eval_interval: int = 10
    eval_iters: int = 2


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.dropout, self.causal = config.dropout, config.causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=self.causal)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) int64 -> logits (B, T, V), loss (scalar, or None without targets)."""
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas) -> torch.optim.AdamW:
        """nanoGPT's groups: decay every >=2-dim parameter (matmuls AND embeddings), not biases/norms."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


# ---- the corpus: a few KB of generated text, char-level, no BOS/EOS ----
_WORDS = ("the cat dog bird sees eats runs sleeps under over a red blue small big tree house river "
          "and then quickly slowly").split()


def make_text(n_chars: int = 6000, seed: int = 1234) -> str:
    """Deterministic sentences from a small vocabulary (lowercase, spaces, periods, newlines)."""
    rng, out, size = random.Random(seed), [], 0
    while size < n_chars:
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
        sentence = words + (".\n" if rng.random() < 0.3 else ". ")
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


class CharTokenizer:
    """nanoGPT's shakespeare_char meta: stoi/itos over the corpus' characters (no special tokens)."""

    def __init__(self, text: str):
        self.itos = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.vocab_size = len(self.itos)

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.itos[i] for i in ids)


TEXT = make_text()
TOKENIZER = CharTokenizer(TEXT)
_DATA = torch.tensor(TOKENIZER.encode(TEXT), dtype=torch.long)
SPLITS = {"train": _DATA[: int(0.9 * len(_DATA))], "val": _DATA[int(0.9 * len(_DATA)):]}


def get_batch(split: str, batch_size: int, block_size: int, shift: bool = True):
    """x, y: (B, T) random windows of the split; y is x shifted by one (unless ``shift`` is False: the bug)."""
    data = SPLITS[split]
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix]) if shift else x.clone()
    return x, y


def get_lr(it: int, cfg: TrainConfig, warmup_iters: int | None = None) -> float:
    """nanoGPT's schedule: linear warmup (it+1)/(W+1), cosine decay to min_lr, then min_lr."""
    warmup = cfg.warmup_iters if warmup_iters is None else warmup_iters
    if it < warmup:
        return cfg.learning_rate * (it + 1) / (warmup + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    decay_ratio = (it - warmup) / max(1, cfg.lr_decay_iters - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, decay_ratio))))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def build(cfg: TrainConfig = TrainConfig(), bugs=(), seed: int = 0, model_cfg: GPTConfig | None = None):
    """The seeded model, its optimizer and its scaler: what a user has before the loop. -> (model, opt, scaler)."""
    unknown = set(bugs) - set(BUGS)
    if unknown:
        raise ValueError(f"unknown bugs {sorted(unknown)}; known: {BUGS}")
    torch.manual_seed(seed)
    model_cfg = replace(model_cfg or GPTConfig(vocab_size=TOKENIZER.vocab_size), causal="not_causal" not in bugs)
    model = GPT(model_cfg)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2))
    scaler = torch.amp.GradScaler("cpu", enabled=cfg.amp)
    return model, optimizer, scaler


@torch.no_grad()
def estimate_loss(model: GPT, cfg: TrainConfig) -> dict[str, float]:
    """Mean loss over ``eval_iters`` batches of each split, in eval mode (as nanoGPT's estimate_loss)."""
    out = {}
    model.eval()
    for split in SPLITS:
        losses = [model(*get_batch(split, cfg.batch_size, model.config.block_size))[1].item()
                  for _ in range(cfg.eval_iters)]
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


def train(cfg: TrainConfig = TrainConfig(), bugs=(), seed: int = 0, steps: int | None = None, watch=None,
          parts=None) -> dict:
    """train.py's loop. ``watch``: None, or a callable ``(model, optimizer, scaler) -> context manager``
    (e.g. ``lambda m, o, s: faultbench.watch(m, o, scaler=s)``) entered around the loop. ``parts``: the
    (model, optimizer, scaler) of ``build`` to train instead of fresh ones.
    Returns {"model", "optimizer", "scaler", "losses" (per iteration), "lrs", "evals", "watch"}."""
    torch.set_num_threads(1)
    model, optimizer, scaler = parts or build(cfg, bugs, seed)
    steps = cfg.max_iters if steps is None else steps
    block = model.config.block_size
    # the "endless_warmup" bug: warmup given in tokens where the schedule counts iterations
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * block
    warmup = cfg.warmup_iters * tokens_per_iter if "endless_warmup" in bugs else cfg.warmup_iters
    shift = "no_shift" not in bugs
    out = {"model": model, "optimizer": optimizer, "scaler": scaler, "losses": [], "lrs": [], "evals": []}
    monitor = watch(model, optimizer, scaler) if watch else contextlib.nullcontext()
    with monitor as w:
        out["watch"] = w
        X, Y = get_batch("train", cfg.batch_size, block, shift)
        for iter_num in range(steps):
            lr = get_lr(iter_num, cfg, warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if iter_num % cfg.eval_interval == 0 and iter_num > 0:
                out["evals"].append(estimate_loss(model, cfg))
            total = 0.0
            for _ in range(cfg.gradient_accumulation_steps):
                _, loss = model(X, Y)
                loss = loss / cfg.gradient_accumulation_steps
                X, Y = get_batch("train", cfg.batch_size, block, shift)
                scaler.scale(loss).backward()
                total += loss.item()
            if cfg.grad_clip != 0.0:
                if "clip_before_unscale" in bugs:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                    scaler.unscale_(optimizer)
                else:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            if "no_zero_grad" not in bugs:
                optimizer.zero_grad(set_to_none=True)
            out["losses"].append(total)
            out["lrs"].append(lr)
    return out
