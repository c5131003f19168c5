"""Speed of the reference training step against a plain nanoGPT-style GPT of the same shape and math.

    python -m benchmarks.perf [--preset tiny] [--steps 200] [--warmup 20] [--repeats 5] [--json]

(A) is ``model.train.train_step`` on the reference run; (B) is the same step written plainly for
benchmarks/plain_gpt.py (same weights, AdamW groups, lr schedule, clipping). Both see the same fixed
list of right-padded micro-batches. "Forward only" is the forward and loss under no_grad: the
models' own cost without autograd or the optimizer. The seams and safety features of the reference should cost at
most 5%: target reference/plain <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.plain_gpt import PlainGPT, lm_loss
from faultbench.model.config import get_preset
from faultbench.model.loss import count_targets
from faultbench.model.optim import configure_optimizer, lr_at
from faultbench.model.precision import autocast_context
from faultbench.model.run import build_run
from faultbench.model.train import forward_loss, next_micro_batches, train_step

TARGET = 1.05


def make_plain(run):
    """The plain model with the reference's weights, and its train/forward steps."""
    cfg = run.config
    plain = PlainGPT(cfg.model).to(cfg.train.device)
    plain.load_state_dict(run.model.state_dict())
    plain.train()
    optimizer = configure_optimizer(plain, cfg.train)  # same groups, lr, betas, eps as the reference
    device_type = torch.device(cfg.train.device).type
    step = 0

    def train(micro_batches):
        nonlocal step
        for group in optimizer.param_groups:  # nanoGPT-style schedule, same values as the reference's LambdaLR
            group["lr"] = lr_at(step, cfg.train)
        for batch in micro_batches:
            with autocast_context(cfg.train.precision, device_type):
                logits = plain(batch["input_ids"])
            (lm_loss(logits, batch["labels"]) / len(micro_batches)).backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

    @torch.no_grad()
    def forward(micro_batches):
        for batch in micro_batches:
            with autocast_context(cfg.train.precision, device_type):
                logits = plain(batch["input_ids"])
            lm_loss(logits, batch["labels"])

    return train, forward


def make_reference(run):
    def train(micro_batches):
        train_step(run, micro_batches)

    @torch.no_grad()
    def forward(micro_batches):
        for batch in micro_batches:  # the window count, as train_step computes it
            forward_loss(run.model, batch, count_targets(batch["labels"]), run.config.train.precision)

    run.model.train()
    return train, forward


def time_pair(fns: dict, batches: list, warmup: int, repeats: int, sync) -> dict:
    """Seconds per step of each function: per batch, the median over repeats; then the mean over batches.

    Blocks alternate A/B (ABBA...) so drift and order effects cancel; the per-batch median drops the
    steps that a context switch or a GC pause hit, which block means on a busy machine do not.
    """
    for fn in fns.values():  # allocator, optimizer state, lazy inits
        for micro_batches in batches[:warmup]:
            fn(micro_batches)
    names, times = list(fns), {name: [] for name in fns}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            block = []
            for micro_batches in batches:
                sync()
                start = time.perf_counter()
                fns[name](micro_batches)
                sync()
                block.append(time.perf_counter() - start)
            times[name].append(block)
    return {name: statistics.fmean(map(statistics.median, zip(*t, strict=True))) for name, t in times.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=200, help="steps per timed block (distinct batches)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # single-threaded: overheads show up instead of hiding behind idle cores
    cfg = get_preset(args.preset)
    if cfg.train.precision == "fp16":
        raise SystemExit("fp16 needs a GradScaler in the plain step; benchmark an fp32 or bf16 preset")
    run = build_run(cfg)
    batches = [next_micro_batches(run) for _ in range(args.steps)]  # fixed, shared by A and B
    tokens = sum(int(b["attention_mask"].sum()) for mbs in batches for b in mbs) / len(batches)
    cuda = torch.device(cfg.train.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    ref_train, ref_forward = make_reference(run)
    plain_train, plain_forward = make_plain(run)
    train = time_pair({"reference": ref_train, "plain": plain_train}, batches, args.warmup, args.repeats, sync)
    forward = time_pair({"reference": ref_forward, "plain": plain_forward}, batches, args.warmup, args.repeats,
                        sync)

    result = {"preset": args.preset, "steps": args.steps, "repeats": args.repeats, "threads": 1,
              "tokens_per_step": tokens, "target_ratio": TARGET}
    print(f"preset {args.preset}: {args.steps} steps x {args.repeats} repeats, 1 thread, "
          f"{tokens:.0f} real tokens/step; per-batch median over repeats")
    print(f"{'':14}{'ref ms':>9}{'plain ms':>10}{'ref tok/s':>11}{'plain tok/s':>13}{'ref/plain':>11}")
    for name, t in (("train step", train), ("forward only", forward)):
        ratio = t["reference"] / t["plain"]
        result[name.split()[0]] = {"reference_ms": 1e3 * t["reference"], "plain_ms": 1e3 * t["plain"],
                                   "reference_tokens_per_s": tokens / t["reference"],
                                   "plain_tokens_per_s": tokens / t["plain"], "ratio": ratio}
        print(f"{name:14}{1e3 * t['reference']:9.3f}{1e3 * t['plain']:10.3f}"
              f"{tokens / t['reference']:11.0f}{tokens / t['plain']:13.0f}{ratio:11.3f}")
    met = result["train"]["ratio"] <= TARGET
    result["target_met"] = met
    print(f"train-step ratio {result['train']['ratio']:.3f}: target <= {TARGET} {'met' if met else 'MISSED'}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
