"""Proof that a fault is real: run its scenario clean and faulty on the same seeds and check the symptom.

Each check takes the clean and faulty outcomes (one pair per seed) plus the thresholds in the fault's
``Manifest.params`` and returns (passed, evidence). Checks that compare means across seeds use a
paired test where the effect is statistical.
"""

from __future__ import annotations

import math
import statistics

from faultbench.faults.registry import get_fault
from faultbench.harness.scenario import Outcome, run_scenario


def _pairs(check=None, *, crash_is_evidence: bool = False):
    """Lift a per-seed check (clean, faulty, **params) -> (ok, evidence) to all seeds: every seed must pass.

    A clean run that crashed or went NaN fails the proof (the recipe is broken, not the fault shown); so
    does a faulty run that crashed, unless the crash is the evidence the check looks for.
    """

    def lift(check):
        def per_seed(clean, faulty, **params):
            if (bad := _clean_ok(clean)):
                return False, bad
            if faulty.crash and not crash_is_evidence:
                return False, f"faulty crashed instead: {faulty.crash['type']}"
            return check(clean, faulty, **params)

        def over_seeds(cleans: list[Outcome], faultys: list[Outcome], **params):
            results = [per_seed(c, f, **params) for c, f in zip(cleans, faultys, strict=True)]
            return all(ok for ok, _ in results), "; ".join(ev for _, ev in results)

        over_seeds.__doc__ = check.__doc__
        return over_seeds

    return lift(check) if check is not None else lift


def _clean_ok(clean: Outcome) -> str | None:
    if clean.crash:
        return f"the CLEAN run crashed: {clean.crash['type']}: {clean.crash['message']}"
    if clean.nan_step is not None:
        return f"the CLEAN run went NaN at step {clean.nan_step}"
    return None


@_pairs(crash_is_evidence=True)
def crash(clean, faulty, types=("RuntimeError",), seam=None, min_step=0):
    """The faulty run raises one of ``types`` (from ``seam`` if given) at step >= ``min_step``."""
    c = faulty.crash
    if c is None:
        return False, "no crash"
    ok = c["type"] in types and (seam is None or seam in c["seams"]) and (c["step"] or 0) >= min_step
    return ok, f"{c['type']} at step {c['step']} in {c['seams'][-1] if c['seams'] else '?'}: {c['message'][:120]}"


@_pairs(crash_is_evidence=True)
def nan(clean, faulty, by_step=30):
    """The faulty run's loss (or a crash-free metric) turns non-finite by ``by_step``; clean stays finite."""
    step = faulty.nan_step
    if step is None and faulty.grad_norms:
        step = next((i for i, g in enumerate(faulty.grad_norms) if not math.isfinite(g) and not faulty.skipped[i]),
                    None)
    return step is not None and step <= by_step, f"first non-finite step {step} (clean: finite)"


@_pairs
def loss_above(clean, faulty, min_gap=0.2, metric="train"):
    """Faulty loss exceeds clean by ``min_gap`` nats (metric: final train loss, or val)."""
    a, b = (faulty.val_loss, clean.val_loss) if metric == "val" else (faulty.final_loss(), clean.final_loss())
    return (not math.isfinite(a)) or a - b >= min_gap, f"{metric} loss {a:.3f} vs clean {b:.3f}"


@_pairs
def loss_below(clean, faulty, min_gap=0.2, metric="train"):
    """Faulty loss is BELOW clean by ``min_gap`` (information leak: e.g. the model sees the future)."""
    a, b = (faulty.val_loss, clean.val_loss) if metric == "val" else (faulty.final_loss(), clean.final_loss())
    return b - a >= min_gap, f"{metric} loss {a:.3f} vs clean {b:.3f}"


@_pairs
def metric_differs(clean, faulty, metric="val_loss", min_gap=0.05):
    """``metric`` (val_loss or a scenario extra) differs from clean by at least ``min_gap``."""
    a = faulty.val_loss if metric == "val_loss" else faulty.extra.get(metric)
    b = clean.val_loss if metric == "val_loss" else clean.extra.get(metric)
    return a is not None and b is not None and abs(a - b) >= min_gap, f"{metric} {a} vs clean {b}"


@_pairs
def extra_at_least(clean, faulty, key, faulty_min, clean_max):
    """Scenario measurement ``key`` is >= ``faulty_min`` when faulty and <= ``clean_max`` when clean."""
    a, b = faulty.extra.get(key), clean.extra.get(key)
    return a is not None and b is not None and a >= faulty_min and b <= clean_max, f"{key} {a} vs clean {b}"


@_pairs
def extra_at_most(clean, faulty, key, faulty_max, clean_min):
    """Scenario measurement ``key`` is <= ``faulty_max`` when faulty and >= ``clean_min`` when clean."""
    a, b = faulty.extra.get(key), clean.extra.get(key)
    return a is not None and b is not None and a <= faulty_max and b >= clean_min, f"{key} {a} vs clean {b}"


@_pairs
def stall(clean, faulty, max_drop=0.3, min_clean_drop=1.0):
    """The faulty loss barely moves from its start while the clean one drops by ``min_clean_drop``."""
    f_drop = faulty.losses[0] - faulty.final_loss()
    c_drop = clean.losses[0] - clean.final_loss()
    return f_drop <= max_drop and c_drop >= min_clean_drop, f"loss drop {f_drop:.3f} vs clean {c_drop:.3f}"


@_pairs
def same_loss_more_compute(clean, faulty, min_ratio=2.0, loss_tol=1e-4):
    """Training numbers unchanged but the model processes ``min_ratio`` x the positions (waste)."""
    positions = lambda o: sum(b * t for b, t in o.batch_shapes)  # noqa: E731
    ratio = positions(faulty) / max(positions(clean), 1)
    same = max(abs(a - b) for a, b in zip(clean.losses, faulty.losses, strict=True)) <= loss_tol
    return ratio >= min_ratio and same, f"{ratio:.2f}x positions per run, losses equal: {same}"


@_pairs(crash_is_evidence=True)
def same_loss_graphs_retained(clean, faulty, min_tensors=10, loss_tol=1e-6):
    """Training numbers unchanged but autograd graphs survive every step (memory grows)."""
    a, b = faulty.extra.get("live_graph_tensors", 0), clean.extra.get("live_graph_tensors", 0)
    same = not faulty.crash and max(abs(x - y) for x, y in zip(clean.losses, faulty.losses, strict=True)) <= loss_tol
    return a >= min_tensors and b <= 0 and same, f"{a} graph tensors alive after training vs clean {b}; same: {same}"


@_pairs
def grad_norm_ratio(clean, faulty, min_ratio, max_ratio, step=0):
    """The pre-clip gradient norm at ``step`` is ``min_ratio``..``max_ratio`` times the clean one."""
    ratio = faulty.grad_norms[step] / clean.grad_norms[step]
    return min_ratio <= ratio <= max_ratio, f"grad norm x{ratio:.3f} of clean at step {step}"


@_pairs
def lr_ratio(clean, faulty, min_ratio, max_ratio, step=0):
    """The learning rate used at ``step`` is ``min_ratio``..``max_ratio`` times the clean one."""
    ratio = faulty.lrs[step] / clean.lrs[step]
    return min_ratio <= ratio <= max_ratio, f"lr x{ratio:.3f} of clean at step {step} ({faulty.lrs[step]:.2e})"


@_pairs
def skipped_steps(clean, faulty, faulty_min, clean_max=0):
    """The scaler skips at least ``faulty_min`` optimizer steps in the faulty run, at most ``clean_max`` clean."""
    a, b = sum(faulty.skipped), sum(clean.skipped)
    return a >= faulty_min and b <= clean_max, f"{a}/{len(faulty.skipped)} steps skipped vs clean {b}"


@_pairs(crash_is_evidence=True)
def crash_after_gap(clean, faulty, types=("RuntimeError",), seam=None, min_step=1, min_gap=0.2, window=10):
    """Two symptoms of one cause: over the ``window`` steps before it crashes, the faulty train loss runs
    ``min_gap`` above the clean one (same steps), then it raises one of ``types`` (from ``seam`` if given)
    at step >= ``min_step``."""
    c = faulty.crash
    if c is None:
        return False, "no crash"
    k = min(len(faulty.losses), len(clean.losses))
    if k == 0:
        return False, f"{c['type']} at step {c['step']}, before any step to compare"
    lo = max(0, k - window)
    gap = statistics.fmean(faulty.losses[lo:k]) - statistics.fmean(clean.losses[lo:k])
    crashed = c["type"] in types and (seam is None or seam in c["seams"]) and (c["step"] or 0) >= min_step
    return crashed and gap >= min_gap, (f"train loss {gap:+.3f} vs clean over steps {lo}-{k - 1}, then {c['type']} "
                                        f"at step {c['step']} in {c['seams'][-1] if c['seams'] else '?'}: "
                                        f"{c['message'][:100]}")


@_pairs(crash_is_evidence=True)
def nan_then_crash(clean, faulty, types=("RuntimeError",), min_step=1):
    """Two symptoms of one cause: the loss turns non-finite on ordinary batches, then a rare batch raises
    one of ``types`` at step >= ``min_step``."""
    c, nan_step = faulty.crash, faulty.nan_step
    if c is None:
        return False, f"no crash (first non-finite step {nan_step})"
    ok = nan_step is not None and c["type"] in types and (c["step"] or 0) >= max(min_step, nan_step + 1)
    return ok, (f"loss non-finite from step {nan_step}, then {c['type']} at step {c['step']} in "
                f"{c['seams'][-1] if c['seams'] else '?'}: {c['message'][:100]}")


# one-sided 5% critical values of Student's t for n - 1 degrees of freedom
_T_CRIT = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}


def paired_gap(cleans, faultys, metric="val_loss", min_effect=0.5):
    """Across seeds, faulty ``metric`` exceeds clean: paired t-test p < 0.05 and Cohen's d >= ``min_effect``."""
    for c in cleans:
        if (bad := _clean_ok(c)):
            return False, bad
    if any(f.crash for f in faultys):
        return False, "faulty crashed instead"
    get = (lambda o: o.val_loss) if metric == "val_loss" else (lambda o: o.final_loss())
    diffs = [get(f) - get(c) for c, f in zip(cleans, faultys, strict=True)]
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    if sd == 0:
        return mean > 0, f"{metric} gap {mean:.4f} on every seed"
    t = mean / (sd / math.sqrt(len(diffs)))
    d = mean / sd
    ok = t > _T_CRIT[len(diffs) - 1] and d >= min_effect
    return ok, f"{metric} gap {mean:.4f} +- {sd:.4f} over {len(diffs)} seeds, t={t:.2f}, d={d:.2f}"


CHECKS = {
    "crash": crash, "nan": nan, "loss_above": loss_above, "loss_below": loss_below,
    "metric_differs": metric_differs, "extra_at_least": extra_at_least, "extra_at_most": extra_at_most,
    "stall": stall, "same_loss_more_compute": same_loss_more_compute,
    "same_loss_graphs_retained": same_loss_graphs_retained, "paired_gap": paired_gap,
    "grad_norm_ratio": grad_norm_ratio, "nan_then_crash": nan_then_crash, "lr_ratio": lr_ratio,
    "skipped_steps": skipped_steps,
    "crash_after_gap": crash_after_gap,
}


def prove(fault_id: str, pool=None, plugins=(), clean_cache: dict | None = None) -> tuple[bool, str]:
    """Run the fault's manifest scenario clean and faulty on its seeds; return (manifests, evidence)."""
    spec = get_fault(fault_id)
    m = spec.manifest
    cleans, faultys = [], []
    for seed in m.seeds:
        key = (spec.target, m.scenario, repr(sorted(m.variant.items())), m.steps, seed)
        if clean_cache is not None and key in clean_cache:
            clean = clean_cache[key]
        else:
            clean = run_scenario(m.scenario, m.variant, m.steps, seed, pool=pool, target=spec.target)
            if clean_cache is not None:
                clean_cache[key] = clean
        cleans.append(clean)
        faultys.append(run_scenario(m.scenario, m.variant, m.steps, seed, (fault_id,), plugins, pool=pool,
                                    target=spec.target))
    return CHECKS[m.check](cleans, faultys, **m.params)
