"""The ``faultbench`` command line (``python -m harness``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from model.config import PAD_SIDES, PRECISIONS, PRESETS, get_preset


def _train(args) -> int:
    from model.checkpoint import load_checkpoint, save_checkpoint
    from model.evaluate import evaluate
    from model.run import build_run
    from model.train import train

    torch.set_num_threads(args.threads)
    overrides = {"train": {}, "data": {}}
    for section, key, value in (
        ("train", "steps", args.steps), ("train", "precision", args.precision), ("train", "accum", args.accum),
        ("data", "pad_side", args.pad_side),
    ):
        if value is not None:
            overrides[section][key] = value
    if args.steps is not None:
        overrides["train"]["warmup_steps"] = min(get_preset(args.preset).train.warmup_steps, args.steps)
    cfg = get_preset(args.preset).replace(**overrides, seed=args.seed)

    start = time.perf_counter()
    run = build_run(cfg)
    if args.resume:
        load_checkpoint(run, args.resume)
    log = sys.stderr if args.json else sys.stdout

    def progress(run, record):
        if record.step % args.log_every == 0 or run.step == cfg.train.steps:
            print(f"step {record.step:5d}  loss {record.loss:.4f}  grad_norm {record.grad_norm:.3f}  "
                  f"lr {record.lr:.2e}  scale {record.scale:g}  {record.tokens_per_s:,.0f} tok/s", file=log)

    train_start = time.perf_counter()
    train(run, on_step=progress)
    train_s = time.perf_counter() - train_start
    if args.save:
        save_checkpoint(run, args.save)
    val_loss = evaluate(run.model, run.corpus.val, run.tokenizer.pad_id, cfg.train.eval_batch_size,
                        cfg.train.precision, cfg.data.pad_side)
    history = run.history
    summary = {
        "preset": args.preset,
        "steps": run.step,
        "params": run.model.num_params(),
        "final_loss": history[-1].loss,
        "val_loss": val_loss,
        "loss_floor": run.corpus.loss_floor,
        "gap_to_floor": val_loss - run.corpus.loss_floor,
        "skipped_steps": sum(r.skipped for r in history),
        "tokens_per_s": sum(r.tokens for r in history) / max(sum(r.seconds for r in history), 1e-9),
        "train_s": train_s,
        "wall_s": time.perf_counter() - start,
        "precision": cfg.train.precision,
        "pad_side": cfg.data.pad_side,
        "accum": cfg.train.accum,
        "seed": cfg.seed,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"val_loss {val_loss:.4f}  loss_floor {run.corpus.loss_floor:.4f}  "
              f"gap {summary['gap_to_floor']:.4f}  {summary['tokens_per_s']:,.0f} tok/s  "
              f"{run.step} steps in {train_s:.1f}s")
    return 0


def _seams(args) -> int:
    from model.seams import seams

    table = seams()
    if args.json:
        print(json.dumps([s.to_dict() for s in table], indent=2))
    else:
        width = max(len(s.name) for s in table)
        for s in table:
            print(f"{s.subsystem:<11} {s.name:<{width}}  {s.file}:{s.line}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="faultbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the clean reference and print its summary")
    train.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    train.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    train.add_argument("--precision", choices=PRECISIONS)
    train.add_argument("--pad-side", choices=PAD_SIDES)
    train.add_argument("--accum", type=int, help="micro-batches per optimizer step")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=1, help="torch threads (small models run fastest on 1)")
    train.add_argument("--log-every", type=int, default=50)
    train.add_argument("--save", metavar="DIR", help="write a checkpoint here at the end")
    train.add_argument("--resume", metavar="DIR", help="continue from this checkpoint")
    train.add_argument("--json", action="store_true", help="progress on stderr; last stdout line is a JSON summary")
    train.set_defaults(func=_train)

    seams = sub.add_parser("seams", help="list every seam of the reference with its subsystem and file:line")
    seams.add_argument("--json", action="store_true")
    seams.set_defaults(func=_seams)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad configs and checkpoints: a clear message, not a traceback
        print(f"faultbench: error: {e}", file=sys.stderr)
        return 2
