"""``faultbench train``: train the clean reference, on one process or several ranks (torchrun too)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from faultbench.harness.atomic import check_output, check_replaceable
from faultbench.harness.commands import (
    MAX_JOBS,
    MAX_STEPS,
    at_most,
    check_batch_split,
    positive_float,
    positive_int,
    runnable_preset,
    seed_arg,
)
from faultbench.model.config import PAD_SIDES, PRECISIONS, PRESETS

TRAIN_TIMEOUT_S = 3600.0  # train --world-size N: how long a hung rank may take


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=at_most(MAX_STEPS), help="optimizer steps (default: the preset's)")
    parser.add_argument("--precision", choices=PRECISIONS)
    parser.add_argument("--pad-side", choices=PAD_SIDES)
    parser.add_argument("--accum", type=positive_int, help="micro-batches per optimizer step")
    parser.add_argument("--seed", type=seed_arg, default=0)
    parser.add_argument("--world-size", type=positive_int, default=1,
                        help="data-parallel ranks (gloo on CPU); under torchrun its WORLD_SIZE wins")
    parser.add_argument("--zero", action="store_true", help="shard optimizer state across ranks (ZeRO)")
    parser.add_argument("--timeout", type=positive_float,
                        help=f"seconds before a hung rank is killed (default {TRAIN_TIMEOUT_S:.0f})")
    parser.add_argument("--threads", type=at_most(MAX_JOBS), default=1,
                        help="torch threads (small models run fastest on 1)")
    parser.add_argument("--log-every", type=at_most(MAX_STEPS), default=50)
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint here at the end")
    parser.add_argument("--resume", metavar="DIR", help="continue from this checkpoint")
    parser.add_argument("--json", action="store_true", help="progress on stderr; last stdout line is a JSON summary")


def run(args) -> int:
    from faultbench.harness.training import train_on_rank, train_reference
    from faultbench.model.distributed import init_from_env

    torch.set_num_threads(args.threads)
    if args.save is not None:
        check_replaceable(args.save, "meta.json", "checkpoint")
        check_output(args.save, "--save", force=True, folder_of="meta.json")
    base = runnable_preset(args.preset)
    launched_by_torchrun = torchrun()
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun else args.world_size
    train_overrides = {"world_size": world, "zero": args.zero}
    for key, value in (("steps", args.steps), ("precision", args.precision), ("accum", args.accum)):
        if value is not None:
            train_overrides[key] = value
    if args.steps is not None:
        train_overrides["warmup_steps"] = min(base.train.warmup_steps, args.steps)
    check_batch_split(base, world, args.accum, "torchrun's WORLD_SIZE" if launched_by_torchrun else "--world-size")
    data_overrides = {"pad_side": args.pad_side} if args.pad_side else {}
    cfg = base.replace(train=train_overrides, data=data_overrides, seed=args.seed)
    log = sys.stderr if args.json else sys.stdout
    common = {"save": args.save, "resume": args.resume, "log_every": args.log_every}

    if launched_by_torchrun:
        import torch.distributed as dist

        rank, _ = init_from_env(cfg.train.device)
        summary = train_reference(cfg, rank, log=log, **common)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    elif world > 1:
        from faultbench.harness.launch import RankPool

        with RankPool(world, start_method="spawn") as pool:  # one case: a pool would not be reused
            summary = pool.run(train_on_rank, cfg.to_dict(), {**common, "log": True},
                               timeout_s=args.timeout or TRAIN_TIMEOUT_S)[0]
    else:
        summary = train_reference(cfg, log=log, **common)

    summary["preset"] = args.preset
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"val_loss {summary['val_loss']:.4f}  loss_floor {summary['loss_floor']:.4f}  "
              f"gap {summary['gap_to_floor']:.4f}  {summary['tokens_per_s']:,.0f} tok/s  "
              f"{summary['steps']} steps in {summary['train_s']:.1f}s")
    return 0


def torchrun() -> bool:
    """Whether torchrun (or another launcher that sets WORLD_SIZE > 1) started this process as one rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def ranks(args) -> bool:
    """Whether this training runs on several ranks (``--world-size`` or torchrun)."""
    return args.world_size > 1 or torchrun()
