"""A plain nanoGPT-style training loop with faultbench watching it: the lines marked ``# faultbench`` are all it
takes. Nothing else of faultbench is imported; the model, data and loop are this script's own.

    python examples/own_loop.py            # trains 40 steps, prints the watch's report, writes findings.json
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import faultbench  # faultbench


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 48, layers: int = 2, heads: int = 4, block: int = 32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def main(steps: int = 40, warmup: int = 10, lr: float = 3e-3, seed: int = 0) -> None:
    torch.manual_seed(seed)
    text = " ".join(f"the {a} {b} sat on the {c}" for a in ("cat", "dog", "fox") for b in ("quietly", "slowly")
                    for c in ("mat", "log", "rug")) * 8
    chars = sorted(set(text))
    data = torch.tensor([chars.index(ch) for ch in text])
    model = GPT(len(chars))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # warmup, then cosine
        optimizer, lambda s: (s + 1) / (warmup + 1) if s < warmup else 0.5 * (1 + math.cos(math.pi * s / steps)))
    with faultbench.watch(model, optimizer, scheduler=schedule, out="findings.json") as w:  # faultbench
        for _ in range(steps):
            starts = torch.randint(0, len(data) - 33, (8,))
            x = torch.stack([data[i : i + 32] for i in starts])
            y = torch.stack([data[i + 1 : i + 33] for i in starts])  # the next token of each position
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
    print(f"final loss {loss.item():.3f}; {len(w.findings)} findings")  # faultbench


if __name__ == "__main__":
    main()
