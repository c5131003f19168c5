"""Checkpoint detectors: a resumed run must continue exactly where the saved one stopped.

``resume_continuity`` snapshots everything a run's future depends on when a checkpoint is saved
(weights, optimizer state and the learning rate of its param groups, LR scheduler, grad scaler,
sampler and the batch it would draw next, step counter and history, the global RNG states) and
compares the freshly built run that loaded the checkpoint with that snapshot, component by
component. The component that differs says what was lost; reading the checkpoint directory tells a
state that was never saved (``save_checkpoint``) from one that was saved but not restored
(``load_checkpoint``); calling the run's own ``restore_rng_state`` / ``capture_rng_state`` on the
saved RNG states tells a broken RNG seam from a loader that never called it. Under data parallelism
every rank compares its own state and the ranks share which components differed: a component
restored on some ranks only is a rank-dependent load (subsystem ``distributed``).
"""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, RunContext, register

LOAD, SAVE = "model.checkpoint.load_checkpoint", "model.checkpoint.save_checkpoint"
RESTORE_RNG, CAPTURE_RNG = "model.checkpoint.restore_rng_state", "model.checkpoint.capture_rng_state"

# the components compared after a load, in a fixed order (the ranks exchange one flag per component)
COMPONENTS = ("model", "optimizer", "lr", "scheduler", "scaler", "sampler", "next_batch", "step", "history", "rng")
WHAT = {
    "model": "model weights", "optimizer": "optimizer state (moments, step counts)",
    "lr": "learning rate of the optimizer's param groups", "scheduler": "LR scheduler state",
    "scaler": "grad scaler state", "sampler": "sampler state (epoch, position)",
    "next_batch": "the sampler's next batch of indices", "step": "step counter",
    "history": "step history", "rng": "global RNG states",
}


def _differences(a, b, path: str = "", out: list | None = None, limit: int = 4) -> list[str]:
    """Where two nested states (dicts, lists, tensors, arrays, numbers) differ: up to ``limit`` paths."""
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ta = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
        tb = b if isinstance(b, torch.Tensor) else torch.as_tensor(b)
        ta, tb = ta.detach().cpu(), tb.detach().cpu()
        if ta.shape != tb.shape:
            out.append(f"{path}: shape {tuple(ta.shape)} vs {tuple(tb.shape)}")
        elif not torch.equal(ta.to(torch.float64) if ta.dtype != tb.dtype else ta,
                             tb.to(torch.float64) if ta.dtype != tb.dtype else tb):
            diff = (ta.double() - tb.double()).abs()
            out.append(f"{path}: max abs diff {float(diff.nan_to_num(math.inf).max()) if diff.numel() else 0:.3g}")
        return out
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            out.append(f"{path}: arrays differ")
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if len(out) >= limit:
                break
            if key not in a or key not in b:
                out.append(f"{path}.{key}: {'missing' if key not in b else 'unexpected'} after the load"
                           if path else f"{key}: {'missing' if key not in b else 'unexpected'} after the load")
            else:
                _differences(a[key], b[key], f"{path}.{key}" if path else str(key), out, limit)
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} entries vs {len(b)}")
            return out
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if len(out) >= limit:
                break
            _differences(x, y, f"{path}[{i}]", out, limit)
        return out
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return out
    if callable(a) and callable(b):
        return out
    if a != b:
        out.append(f"{path}: {a!r:.60} vs {b!r:.60}")
    return out


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return copy.copy(value)


def _local_optimizer(optimizer):
    """The optimizer whose state this rank holds (ZeRO keeps one shard per rank in ``.optim``)."""
    return getattr(optimizer, "optim", optimizer)


def _rng_now() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, keys.copy(), pos, has_gauss, cached),
            "torch": torch.get_rng_state()}


def _rng_from_saved(saved: dict) -> dict:
    """A checkpoint's RNG entry (as ``capture_rng_state`` writes it) in the form of ``_rng_now``."""
    version, internal, gauss = saved["python"]
    np_state = saved["numpy"]
    keys = np_state["keys"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    return {"python": (version, tuple(internal), gauss),
            "numpy": (np_state["kind"], keys.astype(np.uint32), np_state["pos"], np_state["has_gauss"],
                      np_state["cached_gaussian"]),
            "torch": saved["torch"]}


def _rng_differences(a: dict, b: dict) -> list[str]:
    """Which of the generators (python, numpy, torch) differ between two ``_rng_now``-style states."""
    out = []
    if tuple(a["python"][1]) != tuple(b["python"][1]) or a["python"][2] != b["python"][2]:
        out.append("python")
    na, nb = a["numpy"], b["numpy"]
    if not np.array_equal(np.asarray(na[1]).astype(np.uint32), np.asarray(nb[1]).astype(np.uint32)) or \
            int(na[2]) != int(nb[2]):
        out.append("numpy")
    if not torch.equal(a["torch"], b["torch"]):
        out.append("torch")
    return out


def _scheduler_state(scheduler) -> dict:
    return {k: _clone(v) for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def snapshot(run) -> dict:
    """Everything the continuation of ``run`` depends on, copied."""
    sampler = copy.deepcopy(run.sampler)
    return {
        "model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
        "optimizer": _clone(_local_optimizer(run.optimizer).state_dict()),
        "lr": [float(g["lr"]) for g in run.optimizer.param_groups],
        "scheduler": _scheduler_state(run.scheduler),
        "scaler": _clone(run.scaler.state_dict()),
        "sampler": _clone(run.sampler.state_dict()),
        "next_batch": list(sampler.next_indices()),
        "step": int(run.step),
        "history": len(run.history),
        "rng": _rng_now(),
    }


@register
class ResumeContinuity(Detector):
    id = "resume_continuity"
    needs_run = ("sampler.next_indices",)
    needs_seams = (CAPTURE_RNG, RESTORE_RNG)
    family = "checkpoint"
    passive = False
    description = ("a run loaded from a checkpoint must equal the saved run in weights, optimizer, LR, scheduler, "
                   "scaler, sampler, step and RNG; the differing component localizes save vs load vs RNG seams")

    def __init__(self) -> None:
        super().__init__()
        self._snap: dict | None = None
        self._errors: list[str] = []

    def summary(self) -> dict:
        return {"errors": self._errors} if self._errors else {}

    def on_checkpoint_save(self, ctx: RunContext, path) -> None:
        try:  # never raise here: the load hook takes part in a collective on every rank
            self._snap = snapshot(ctx.run)
        except Exception as exc:  # pragma: no cover - recorded, the load hook then compares nothing
            self._snap = None
            self._errors.append(f"save: {type(exc).__name__}: {exc}"[:300])

    def on_checkpoint_load(self, ctx: RunContext, path) -> None:
        diffs: dict[str, list[str]] = {}
        try:
            if self._snap is not None:
                diffs = self._compare(ctx.run, self._snap)
        except Exception as exc:  # pragma: no cover
            self._errors.append(f"load: {type(exc).__name__}: {exc}"[:300])
        ranks_differing = self._share(ctx, diffs)  # collective: every rank, unconditionally
        if not diffs:
            return
        saved = self._saved_state(path)
        by_seam: dict[tuple[str, str], dict] = {}

        def add(subsystem, seam, component, detail, confidence):
            entry = by_seam.setdefault((subsystem, seam), {"components": {}, "confidence": 0.0})
            entry["components"][component] = detail
            entry["confidence"] = max(entry["confidence"], confidence)

        for component, detail in diffs.items():
            rank_dependent = 0 < ranks_differing.get(component, 1) < ctx.run.world_size
            if component == "rng":
                subsystem, seam, conf, why = self._localize_rng(ctx, saved, detail)
                add(subsystem, seam, component, why, conf)
                continue
            in_file = self._saved_matches(saved, component, ctx.run)
            if in_file is False:  # the checkpoint itself lacks or garbles the component
                add("checkpoint", SAVE, component, detail, 0.85)
            elif rank_dependent:
                add("distributed", LOAD, component, detail + [f"restored on some ranks only "
                                                              f"({ranks_differing[component]} of "
                                                              f"{ctx.run.world_size} differ)"], 0.9)
            else:
                add("checkpoint", LOAD, component, detail, 0.9 if in_file else 0.8)
        for (subsystem, seam), entry in by_seam.items():
            names = " and ".join(WHAT[c] for c in entry["components"])
            plural = len(entry["components"]) > 1 or names.endswith("states")
            verb = ("were" if plural else "was") + " not saved correctly" if seam == SAVE else \
                ("are" if plural else "is") + " not restored"
            self.report(ctx, subsystem, seam,
                        f"after resuming at step {self._snap['step']}, the {names} {verb}: the loaded run differs "
                        "from the run that was saved", evidence=entry["components"], confidence=entry["confidence"],
                        step=self._snap["step"])

    # --- comparison -------------------------------------------------------------------------------
    def _compare(self, run, snap: dict) -> dict[str, list[str]]:
        now = snapshot(run)
        diffs = {}
        for component in COMPONENTS:
            if component == "rng":
                gens = _rng_differences(snap["rng"], now["rng"])
                if gens:
                    diffs["rng"] = [f"{g} generator differs from its state at the save" for g in gens]
                continue
            found = _differences(snap[component], now[component], component)
            if found:
                diffs[component] = found
        return diffs

    def _share(self, ctx: RunContext, diffs: dict) -> dict[str, int]:
        """How many ranks found each component differing (the local flags when not distributed)."""
        flags = torch.tensor([1.0 if c in diffs else 0.0 for c in COMPONENTS], dtype=torch.float64)
        if probes.group_ready(ctx):
            flags = flags.to(probes.device(ctx))
            dist.all_reduce(flags)
            flags = flags.cpu()
        return {c: int(round(float(v))) for c, v in zip(COMPONENTS, flags, strict=True)}

    # --- localization -----------------------------------------------------------------------------
    def _saved_state(self, path) -> dict | None:
        try:
            return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=True)
        except Exception as exc:
            self._errors.append(f"reading {path}: {type(exc).__name__}: {exc}"[:300])
            return None

    def _saved_matches(self, saved: dict | None, component: str, run) -> bool | None:
        """Whether the checkpoint file holds the component as it was at the save (None: cannot tell)."""
        if saved is None:
            return None
        snap = self._snap
        try:
            if component == "model":
                return "model" in saved and not _differences(snap["model"], saved["model"])
            if component == "optimizer":
                if _local_optimizer(run.optimizer) is not run.optimizer:  # ZeRO saves the consolidated state
                    return None
                return "optimizer" in saved and not _differences(snap["optimizer"], saved["optimizer"])
            if component == "lr":
                groups = saved.get("optimizer", {}).get("param_groups")
                return None if groups is None else [float(g["lr"]) for g in groups] == snap["lr"]
            if component == "scheduler":
                if "scheduler" not in saved:
                    return False
                return not _differences(snap["scheduler"],
                                        {k: v for k, v in saved["scheduler"].items() if k != "lr_lambdas"})
            if component in ("scaler", "sampler"):
                return component in saved and not _differences(snap[component], saved[component])
            if component == "next_batch":
                return "sampler" in saved and not _differences(snap["sampler"], saved["sampler"])
            if component == "step":
                return "step" in saved and int(saved["step"]) == snap["step"]
            if component == "history":
                return "history" in saved and len(saved["history"]) == snap["history"]
        except Exception:
            return None
        return None

    def _localize_rng(self, ctx: RunContext, saved: dict | None, detail: list[str]):
        """(subsystem, seam, confidence, evidence) for RNG states that differ after the load."""
        try:
            entries = saved["rng"] if saved is not None else None
            entry = entries[ctx.run.rank] if isinstance(entries, (list, tuple)) else entries
        except (KeyError, IndexError, TypeError):
            entry = None
        if entry is None:
            return "checkpoint", SAVE, 0.7, detail + ["the checkpoint holds no RNG state for this rank"]
        file_state = _rng_from_saved(entry)
        in_file = _rng_differences(self._snap["rng"], file_state)
        if in_file:  # the checkpoint holds other states than the run had: capture or save is wrong
            with ctx.probe():
                captured = ctx.seam(CAPTURE_RNG)()
                wrong = _rng_differences(_rng_now(), _rng_from_saved(captured))
            if wrong:
                return "checkpoint", CAPTURE_RNG, 0.9, detail + [f"capture_rng_state misses the {', '.join(wrong)} "
                                                                 "generator state(s)"]
            return "checkpoint", SAVE, 0.8, detail + [f"the checkpoint's {', '.join(in_file)} state(s) differ from "
                                                      "the run's at the save"]
        # the file is right: does the run's restore_rng_state restore it when called?
        with ctx.probe():
            ctx.seam(RESTORE_RNG)(entry)
            wrong = _rng_differences(file_state, _rng_now())
        if wrong:
            return "checkpoint", RESTORE_RNG, 0.9, detail + [f"restore_rng_state called with the saved state leaves "
                                                             f"the {', '.join(wrong)} generator(s) unrestored"]
        return "checkpoint", LOAD, 0.8, detail + ["restore_rng_state works when called with the saved state: the "
                                                  "loader does not restore this rank's RNG state"]
