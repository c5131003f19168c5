"""The ``faultbench`` command line (``python -m faultbench``): every command registered in ``COMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass

from faultbench.harness.commands.train import ranks
from faultbench.paths import cache_dir, in_checkout


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (``faultbench bench: error: ...``), exit 2, no usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class Command:
    """A subcommand: the module that implements it (``arguments(parser)`` and ``run(args) -> int``) and its help."""

    module: str
    help: str


COMMANDS = {name: Command(f"faultbench.harness.commands.{name}", text) for name, text in (
    ("train", "train the clean reference and print its summary"),
    ("seams", "list every seam of a target with its subsystem and file:line"),
    ("faults", "list the registered faults"),
    ("show", "a fault's metadata and its diff against the clean seam"),
    ("run", "train with faults injected, next to the clean run, and report"),
    ("replay", "run a repro bundle's case again and say whether its finding comes back"),
    ("plugins", "list what loads code into faultbench: installed entry points, and when --plugin files load"),
    ("detectors", "list the registered detectors"),
    ("bench", "every fault x seeds plus the clean matrix, scored; writes results/ (or one shard of it)"),
    ("merge", "the shards of a bench --shard K/N, scored as one bench; writes results/"),
    ("page", "redraw a results folder's figures and index.html from its bench.csv"),
    ("golden", "golden envelopes of your own loop, from its known-good runs"),
    ("contracts", "the contract catalogue: what every correct causal-LM run keeps, per component and kind, with the "
                  "detectors that check each and the coverage"),
    ("mutate", "the mutant set: machine-made faults over every seam, admitted by the bench's evidence; prints each "
               "operator's admit rate"),
    ("practice", "practice and interview mode: exercises with one hidden fault"),
)}


def build_parser() -> argparse.ArgumentParser:
    """One parser: a subparser per ``COMMANDS`` entry, its arguments and its ``run`` from its module."""
    parser = _Parser(prog="faultbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        module = importlib.import_module(command.module)
        module.arguments(sub.add_parser(name, help=command.help))
        sub.choices[name].set_defaults(func=module.run)
    return parser


# A flag that means something only beside another would otherwise be ignored without a word: (command, flag,
# whether it was given, whether it applies, what it needs). Checked before any work.
_DETECTORS = "the fault runs in its bench recipe with --detectors (--recipe and --seed choose the case)"

_ONLY_WITH = [
    ("train", "--zero", lambda a: a.zero, ranks, "with --world-size 2 or more (or torchrun): it shards across ranks"),
    ("train", "--timeout", lambda a: a.timeout is not None, ranks,
     "with --world-size 2 or more: it is how long a hung rank may take"),
    *(("run", flag, given, lambda a: a.detectors, "with --detectors") for flag, given in (
        ("--recipe", lambda a: a.recipe), ("--bundle", lambda a: a.bundle is not None),
        ("--no-bundle", lambda a: a.no_bundle))),
    ("run", "--force", lambda a: a.force, lambda a: a.plot is not None, "with --plot (the file it replaces)"),
    *(("run", flag, given, lambda a: not a.detectors, f"to the clean-vs-faulty comparison: {_DETECTORS}")
      for flag, given in (("--plot", lambda a: a.plot is not None), ("--steps", lambda a: a.steps is not None),
                          ("--precision", lambda a: a.precision), ("--pad-side", lambda a: a.pad_side),
                          ("--accum", lambda a: a.accum), ("--world-size", lambda a: a.world_size != 1),
                          ("--preset", lambda a: a.preset != "tiny"))),
    ("run", "--bundle", lambda a: a.bundle is not None, lambda a: not a.no_bundle, "without --no-bundle"),
    *(("mutate", flag, given, lambda a: a.admit, "with --admit (it configures the admission)") for flag, given in (
        ("--per-cell", lambda a: a.per_cell is not None), ("--sample", lambda a: a.sample is not None),
        ("--jobs", lambda a: a.jobs is not None), ("--force", lambda a: a.force))),
    *((command, flag, given, lambda a: not a.fault, "without --fault: it helps choose the hidden fault")
      for command in ("practice new", "practice export") for flag, given in (
        ("--seed", lambda a: a.seed is not None), ("--subsystem", lambda a: a.subsystem),
        ("--difficulty", lambda a: a.difficulty))),
    ("bench", "--costs", lambda a: a.costs is not None, lambda a: a.shard is not None,
     "with --shard (the table the matrix is cut by)"),
    ("bench", "--junit", lambda a: a.junit is not None, lambda a: a.shard is None,
     "without --shard (a shard writes no scores: give --junit to merge)"),
    ("practice export", "--force", lambda a: a.force, lambda a: a.archive is not None,
     "with --archive (the file it replaces)"),
    ("practice report", "--force", lambda a: a.force, lambda a: a.out is not None, "with --out (the file it replaces)"),
]



def _refuse_unused_flags(args) -> None:
    """One line (ValueError) for the first flag given where it would be ignored (``_ONLY_WITH``)."""
    command = " ".join(filter(None, (args.command, getattr(args, "practice_command", None))))
    for only_in, flag, given, applies, needs in _ONLY_WITH:
        if command == only_in and given(args) and not applies(args):
            raise ValueError(f"{flag} applies only {needs}; here it would be ignored")



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = ["faultbench", *(sys.argv[1:] if argv is None else argv)]
    if not in_checkout():  # installed: the reference's tokenizer cache goes with the others, not into the package
        os.environ.setdefault("TOKENIZER_CACHE_DIR", str(cache_dir() / "tokenizers"))
    try:
        _refuse_unused_flags(args)
        return args.func(args)
    except ValueError as e:  # bad configs and checkpoints: a clear message, not a traceback
        print(f"faultbench: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader (head, less) closed the pipe: stop quietly, as a pipeline expects
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
