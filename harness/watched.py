"""The black-box track in a bench case: ``faultbench.watch`` on the target's own loop, beside the white-box suite.

One training run serves both tracks: the case's black-box detectors see the run only through a watch (module,
optimizer and gradient hooks, as any user's loop would give them), its white-box detectors through the suite.
While a white-box hook runs, the watch is quiet, so a white-box probe's crafted calls never reach what the
black-box detectors saw of the loop (and the black-box probes run in eval mode, which the suite's forward hook
ignores). A resumed run is new model and optimizer objects: it gets a watch of its own, and the case's record
holds the findings of every watch of the case.
"""

from __future__ import annotations

import dataclasses

from faultbench.detectors.api import all_detectors, rank_key

WATCH_HISTORY = "watch_history"  # a case record's summaries key: the StepRecords its watches took
WATCH_RECORDER = "watch_recorder"  # a golden case's pseudo detector: a watch with no detector, recording only


def split_tracks(ids) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(white-box ids, black-box ids) of a case's detectors, each in the given order."""
    registry = all_detectors()
    black = tuple(d for d in ids if d == WATCH_RECORDER or getattr(registry.get(d), "track", "") == "black-box")
    return tuple(d for d in ids if d not in black), black


class Watched:
    """The black-box detectors of a case over the segments of its run (one watch per model/optimizer pair)."""

    def __init__(self, ids: tuple[str, ...], rank: int = 0, world_size: int = 1, golden: dict | None = None,
                 declare: dict | None = None):
        self.ids, self.rank, self.world_size = tuple(d for d in ids if d != WATCH_RECORDER), rank, world_size
        self.golden = envelope(golden)
        self.declare = declare  # what the target's user would declare about the loop (faultbench.watch's declare=)
        self.watches: list = []
        # around the whole case, as a user wraps their program: a crash before the first watch is located too
        from faultbench.guard import Guard

        self.guard = Guard(report=False).__enter__()

    @property
    def current(self):
        return self.watches[-1] if self.watches and self.watches[-1].attached else None

    def attach(self, model, optimizer, *, scheduler=None, scaler=None, tokenizer=None, step: int = 0,
               collate=None) -> None:
        """Watch a (new) segment of the run: the previous watch, if still attached, ends normally first. ``step``:
        the loop's step counter at the start of the segment (a resumed run's); the previous segment's watch is
        handed to the new one, as a user resuming their loop would."""
        from faultbench.watch import Watch

        self.finish()
        watch = Watch(model, optimizer, scheduler=scheduler, scaler=scaler, tokenizer=tokenizer, detectors=self.ids,
                      golden=self.golden, rank=self.rank, world_size=self.world_size, report=False, step=step,
                      previous=self.watches[-1] if self.watches else None, declare=self.declare, collate=collate)
        self.watches.append(watch)
        watch.__enter__()

    def callback(self):
        """A ``FaultbenchCallback`` for a Trainer segment; its watch joins this case's watches."""
        from faultbench.hf import FaultbenchCallback

        watched = self

        class CaseCallback(FaultbenchCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                watched.finish()
                self.previous = watched.watches[-1] if watched.watches else None
                super().on_train_begin(args, state, control, **kwargs)
                watched.watches.append(self.watch)

        return CaseCallback(detectors=self.ids, golden=self.golden, report=False, declare=self.declare)

    def quiet(self, on: bool) -> None:
        """Hide (``on``) or show again the model's calls from the watch: a white-box hook is running."""
        if self.current is not None:
            self.current.ctx.probing = on

    def observe_eval(self, eval_loss: float) -> None:
        """The loop's evaluation loss, handed to the attached watch as a user would (``Watch.observe``): the
        reference evaluates the whole split on every rank, so the value is this rank's own."""
        if self.current is not None:
            self.current.observe(eval_loss=eval_loss)

    def finish(self, exc: BaseException | None = None) -> None:
        """End the attached watch, if any: normally, or with the run's exception (its detectors' ``on_crash``); with
        none attached, the exception of an evaluation after training goes to the last watch (``Watch.crashed``),
        and one raised before any watch to the guard."""
        if self.current is not None:
            self.current.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        elif exc is not None and self.watches:  # an evaluation after training, still watched, raised
            self.watches[-1].crashed(exc)
        elif isinstance(exc, Exception):
            self.guard.crashed(exc)

    def close(self) -> None:
        """The case is over: the guard's hook is removed (a finished watch has removed its own)."""
        self.guard.close()

    def merge_into(self, out: dict) -> None:
        """Add the black-box findings, errors, not-applicable reasons and hook times to a case record."""
        findings = [_with_class(f.to_dict(), modules) for w in self.watches
                    for modules in [dict(w.ctx.model.named_modules())] for f in w.findings]
        findings += [_with_class(f.to_dict(), {}) for f in self.guard.findings]
        out["findings"] = sorted(out["findings"] + findings, key=rank_key)
        for w in self.watches:
            for det, error in w.errors.items():
                out["detector_errors"].setdefault(det, error)
            for det, reason in w.not_applicable.items():
                out["summaries"].setdefault(det, {})["not_applicable"] = reason
            for key in ("step_seconds", "other_seconds"):
                for det, seconds in getattr(w, key).items():
                    out[key][det] = out[key].get(det, 0.0) + seconds
        # what the watch measured, step by step over the segments: a golden run's envelope is made of these
        out["summaries"][WATCH_HISTORY] = [dataclasses.asdict(r) for w in self.watches for r in w.ctx.history]


def envelope(golden: dict | None) -> dict | None:
    """The black-box track's golden envelope of a recipe: what watches saw on its golden runs (the bench's known-good
    runs of the same loop, as a user records them with ``faultbench.record_golden``); None without golden runs."""
    from faultbench.watch import record_golden

    histories = [run[WATCH_HISTORY] for run in (golden or {}).get("runs", []) if run.get(WATCH_HISTORY)]
    return record_golden(histories) if histories else None


def _with_class(finding: dict, modules: dict) -> dict:
    """The finding with ``where_class``, the qualified class name of the module its ``where`` names in the watched
    model (``modules``: its named modules; "" is the model itself; None for other places): what the scorer maps to a
    seam of the target (detectors never do)."""
    module = modules.get(finding["where"]) if isinstance(finding.get("where"), str) else None
    finding["where_class"] = None if module is None else f"{type(module).__module__}.{type(module).__qualname__}"
    return finding
