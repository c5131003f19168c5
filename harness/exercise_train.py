"""Train the GPT in this folder and report what happened (the `train.py` of a practice exercise).

    python train.py [--steps N] [--seed S] [--precision fp32|bf16|fp16] [--pad-side left|right] [--accum K]
                    [--batch-size B] [--grad-clip C] [--seq-len T] [--vocab-size V] [--dropout P] [--init-std S]
                    [--world-size 1|2] [--zero] [--resume-at STEP] [--generate]

Prints one line per step (loss, grad norm, learning rate, loss scale), then the validation loss. With
--resume-at it saves a checkpoint at that step and continues from a fresh run loaded from it, as a
preempted job would; with --generate it decodes a few left-padded prompts with the KV cache and
compares the logits with one full forward over the same tokens; with --world-size 2 it trains on two
data-parallel processes (gloo). Uses only the `model/` package next to it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from model.config import get_preset  # noqa: E402
from model.data import collate  # noqa: E402
from model.distributed import init_from_env  # noqa: E402
from model.evaluate import evaluate  # noqa: E402
from model.run import build_run  # noqa: E402
from model.train import train  # noqa: E402


def config(args):
    base = get_preset("tiny")
    train_cfg = {"steps": args.steps, "warmup_steps": min(base.train.warmup_steps, args.steps),
                 "precision": args.precision, "accum": args.accum, "batch_size": args.batch_size,
                 "grad_clip": args.grad_clip, "world_size": args.world_size, "zero": args.zero}
    data = {"pad_side": args.pad_side, "seq_len": args.seq_len, "vocab_size": args.vocab_size}
    return base.replace(train=train_cfg, data=data, model={"dropout": args.dropout, "init_std": args.init_std},
                        seed=args.seed)


def log_step(run, record) -> None:
    if run.rank == 0:
        print(f"step {record.step:4d}  loss {record.loss:.4f}  grad_norm {record.grad_norm:.4f}  lr {record.lr:.2e}  "
              f"scale {record.scale:g}", flush=True)


def generation_check(run) -> None:
    """Cached greedy decode of left-padded prompts vs one uncached forward over the same tokens."""
    model = run.model.eval()
    docs = sorted(run.corpus.val, key=len)[-3:]
    prompts = [list(d[: 3 + 2 * i]) for i, d in enumerate(docs)]
    batch = collate(prompts, run.tokenizer.pad_id, "left")
    new = 10
    with torch.no_grad():
        steps = []
        hook = model.register_forward_hook(lambda module, args, output: steps.append(output[:, -1]))
        try:
            out = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=new)
        finally:
            hook.remove()
        mask = torch.cat([batch["attention_mask"], torch.ones(len(prompts), new, dtype=torch.long)], 1)
        full = model(out, mask)[:, batch["input_ids"].shape[1] - 1 : -1]
        gap = (torch.stack(steps, 1).float() - full.float()).abs().max().item()
    print(f"generation: cached decode vs full forward, max logit difference {gap:.2e}")


def run_training(rank: int, args) -> None:
    if args.world_size > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world_size))
        init_from_env()
    cfg = config(args)
    run = build_run(cfg, rank)
    if args.resume_at:
        train(run, args.resume_at, on_step=log_step)
        with tempfile.TemporaryDirectory() as tmp:  # every rank gets the same path from rank 0 via the env
            path = Path(os.environ.get("EXERCISE_CKPT", tmp)) / "ckpt"
            save_checkpoint(run, path)
            if rank == 0:
                print(f"saved a checkpoint at step {run.step}; resuming from it in a fresh process state", flush=True)
            run = build_run(cfg, rank)
            load_checkpoint(run, path)
    train(run, on_step=log_step)
    val = evaluate(run.model, run.corpus.val, run.tokenizer.pad_id, cfg.train.eval_batch_size, cfg.train.precision,
                   cfg.data.pad_side)
    if rank == 0:
        print(f"validation loss {val:.4f} (this corpus cannot be predicted better than {run.corpus.loss_floor:.4f})")
        if args.generate:
            generation_check(run)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--pad-side", default="right", choices=("left", "right"))
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=256, help="tokenizer vocabulary (the model embeds 256)")
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--world-size", type=int, default=1, choices=(1, 2))
    parser.add_argument("--zero", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--resume-at", type=int, default=0)
    parser.add_argument("--generate", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.world_size == 1:
        run_training(0, args)
        return 0
    with socket.socket() as s, tempfile.TemporaryDirectory() as ckpt:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), EXERCISE_CKPT=ckpt)
        s.close()
        torch.multiprocessing.spawn(run_training, args=(args,), nprocs=args.world_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
