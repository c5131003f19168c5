"""The command line's commands (``faultbench.harness.cli.COMMANDS`` names each with its module): one module per
command, each with ``arguments(parser)`` and ``run(args) -> int``; here the argument types and helpers they share.
A bad value is an ``argparse.ArgumentTypeError`` or a ``ValueError``: one line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import math

import torch

from faultbench.model.config import get_preset

MAX_SEEDS, MAX_JOBS, MAX_STEPS = 1000, 256, 10_000_000  # beyond these a count is a typo, not a plan


def positive_int(text: str, most: int | None = None) -> int:
    """A count (seeds, steps, jobs, ...): an integer >= 1 (and <= ``most``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if most is not None and value > most:
        raise argparse.ArgumentTypeError(f"expected at most {most}, got {value}")
    return value


def at_most(most: int):
    """``positive_int`` up to ``most``: a count whose huge values would only exhaust memory or time."""
    def parse(text: str) -> int:
        return positive_int(text, most)

    return parse


MAX_SEED = 2**32 - 1  # what every generator a run seeds accepts (numpy's is the narrowest)


def seed_arg(text: str) -> int:
    """A seed: an integer from 0 to ``MAX_SEED``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to {MAX_SEED}, got {value}")
    return value


def new_file(text: str) -> str:
    """A file to write (``--junit``): its folder must exist, so that a long run does not fail at its end."""
    from pathlib import Path

    if not Path(text).parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder does not exist")
    return text


def positive_float(text: str) -> float:
    """A time or a rate: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def target_name(text: str) -> str:
    """A target's name (``ref``, ``hf``); an unknown one is refused with the closest name."""
    from faultbench import targets

    try:
        targets.get(text) if text not in targets.names() else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def targets_or_all(text: str) -> tuple[str, ...]:
    """``all`` (every target) or one target's name, as the tuple of targets meant."""
    from faultbench import targets

    return targets.names() if text == "all" else (target_name(text),)


def runnable_preset(name: str):
    """The named preset, if this machine can run it: a CUDA preset without a CUDA device is refused in one line
    (it used to run and be reported as the fault's crash)."""
    preset = get_preset(name)
    if preset.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"preset {name!r} trains on CUDA and this machine has no CUDA device "
                         "(torch.cuda.is_available() is False); use 'tiny' or 'small'")
    return preset


def check_batch_split(base, world: int, accum: int | None, world_flag: str = "--world-size") -> None:
    """The preset's batch (documents per optimizer step) must split into equal micro-batches on every rank."""
    accum = accum or base.train.accum
    if base.train.batch_size % (world * accum):
        raise ValueError(f"{world_flag} {world} x --accum {accum} must divide the preset's batch of "
                         f"{base.train.batch_size} documents per step (equal micro-batches on every rank)")


def load_plugins(args) -> None:
    """Load the ``--plugin`` files and modules a command line names (none where it names none)."""
    from faultbench.faults.registry import load_plugin

    for plugin in getattr(args, "plugin", None) or ():
        load_plugin(plugin)
