"""`faultbench run`: train with faults injected next to the clean run and say what happened."""

from __future__ import annotations

import math

from faultbench.harness.scenario import Outcome, run_scenario


def compare(fault_ids, variant: dict, steps: int, seed: int, world_size: int = 1, plugins=(),
            preset: str = "tiny") -> tuple[Outcome, Outcome, dict]:
    """Run clean and faulty on the same seed; return both outcomes and a JSON-able report."""
    scenario = "ddp" if world_size > 1 else "train"
    clean = run_scenario(scenario, variant, steps, seed, preset=preset)
    faulty = run_scenario(scenario, variant, steps, seed, fault_ids, plugins, preset=preset)
    return clean, faulty, report_of(clean, faulty, fault_ids, variant, steps, seed)


def compare_target(target: str, fault_ids, scenario: str, variant: dict, steps: int, seed: int,
                   plugins=()) -> tuple[Outcome, Outcome, dict]:
    """Clean and faulty on ``target`` in one of its proof scenarios (``harness.scenario.run_scenario``)."""
    clean = run_scenario(scenario, variant, steps, seed, plugins=plugins, target=target)
    faulty = run_scenario(scenario, variant, steps, seed, fault_ids, plugins, target=target)
    report = report_of(clean, faulty, fault_ids, variant, steps, seed)
    report.update(target=target, scenario=scenario, extra=faulty.extra, clean_extra=clean.extra)
    return clean, faulty, report


def report_of(clean: Outcome, faulty: Outcome, fault_ids, variant: dict, steps: int, seed: int) -> dict:
    """What the faulty run did against the clean one, JSON-able."""
    return {
        "faults": list(fault_ids),
        "steps": steps,
        "seed": seed,
        "variant": variant,
        "crash": None if faulty.crash is None else {k: v for k, v in faulty.crash.items() if k != "traceback"},
        "crash_frame": faulty.crash["seams"][-1] if faulty.crash and faulty.crash["seams"] else None,
        "nan_step": faulty.nan_step,
        "final_loss": faulty.final_loss() if faulty.losses else None,
        "clean_final_loss": clean.final_loss() if clean.losses else None,
        "val_loss": faulty.val_loss,
        "clean_val_loss": clean.val_loss,
        "eval_gap": None if faulty.val_loss is None or clean.val_loss is None else faulty.val_loss - clean.val_loss,
        "grad_norm_ratio": _median_ratio(faulty.grad_norms, clean.grad_norms),
        "skipped_steps": sum(faulty.skipped),
        "clean_skipped_steps": sum(clean.skipped),
    }


def _median_ratio(a: list[float], b: list[float]) -> float | None:
    """Median over steps of a/b (pre-clip grad norms): a reduction or scaling factor shows as its value."""
    ratios = sorted(x / y for x, y in zip(a, b, strict=False) if y > 0 and math.isfinite(x) and math.isfinite(y))
    return ratios[len(ratios) // 2] if ratios else None


def describe(report: dict) -> str:
    """Plain-language summary of a report, the way a colleague would describe the run."""
    where = f"target {report['target']}, scenario {report['scenario']}, " if "target" in report else ""
    lines = [f"faults: {', '.join(report['faults'])}  ({where}{report['steps']} steps, seed {report['seed']})"]
    if report["crash"]:
        c = report["crash"]
        lines.append(f"CRASH at step {c['step']}: {c['type']}: {c['message'][:200]}")
        lines.append(f"  innermost frame of the stack on the traceback: {report['crash_frame']}")
    if report["nan_step"] is not None:
        lines.append(f"loss became non-finite at step {report['nan_step']}")
    if report["final_loss"] is not None:
        lines.append(f"final train loss {report['final_loss']:.4f} vs clean {report['clean_final_loss']:.4f}")
    if report["eval_gap"] is not None and math.isfinite(report["eval_gap"]):
        lines.append(f"val loss {report['val_loss']:.4f} vs clean {report['clean_val_loss']:.4f} "
                     f"(gap {report['eval_gap']:+.4f})")
    ratio = report["grad_norm_ratio"]
    if ratio is not None and abs(ratio - 1) > 0.05:
        lines.append(f"pre-clip grad norm {ratio:.3g}x the clean run's (median over steps)")
    if report["skipped_steps"] or report["clean_skipped_steps"]:
        lines.append(f"skipped steps {report['skipped_steps']} vs clean {report['clean_skipped_steps']}")
    for key, value in sorted(report.get("extra", {}).items()):  # a target scenario's probes (gaps, shares)
        clean = report["clean_extra"].get(key)
        if value != clean:
            lines.append(f"{key} {value:.4g} vs clean {clean:.4g}" if isinstance(value, float) and
                         isinstance(clean, float) else f"{key} {value} vs clean {clean}")
    return "\n".join(lines)
