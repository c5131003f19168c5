"""Every fault of the third blind set manifests: its manifest's scenario, clean and faulty on one seed, differs.

Kept outside ``tests/`` so that ``make test`` never prints a blind id. Run it with
``.venv/bin/python -m pytest -q benchmarks/blind3/test_manifest.py``. As ``tests/faults/test_manifest.py`` does,
each fault's scenario (``Manifest.scenario``/``variant``/``steps``, on its target) runs once clean and once with the
fault injected; the clean runs are shared. The assertion is the bench's own notion of "manifested": the faulty run
behaves differently (its per-step losses, learning rates or gradient norms, its validation loss, its crash, or a
scenario measurement), by more than rounding, and where the manifest's check is a crash, it crashes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from faultbench.faults.registry import FAULTS, load_plugin
from faultbench.harness.scenario import run_scenario

PLUGIN = str(Path(__file__).with_name("blind_faults.py"))
load_plugin(PLUGIN)
IDS = sorted((k for k in FAULTS if k.startswith("blind3_")), key=lambda k: (FAULTS[k].target, k))
TOL = 1e-7

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def clean_runs() -> dict:
    return {}


@pytest.fixture(scope="module")
def pool():
    from faultbench.harness.launch import RankPool

    with RankPool(2) as p:
        yield p


def _values(o) -> dict:
    d = {"loss": o.losses, "grad_norm": o.grad_norms, "lr": o.lrs, "val_loss": [o.val_loss]}
    for k, v in o.extra.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            d[f"extra.{k}"] = [v]
    return d


def differences(clean, faulty) -> list[str]:
    """What the faulty outcome does differently from the clean one (empty: nothing beyond rounding)."""
    if faulty.crash or clean.crash:
        a, b = (clean.crash or {}).get("type"), (faulty.crash or {}).get("type")
        return [f"crash {b} (clean: {a})"] if a != b else []
    out = []
    c, f = _values(clean), _values(faulty)
    for key in c.keys() & f.keys():
        x, y = c[key], f[key]
        if len(x) != len(y):
            out.append(f"{key}: {len(y)} values vs {len(x)}")
            continue
        gaps = [abs(a - b) for a, b in zip(x, y, strict=True) if a is not None and b is not None
                and math.isfinite(a) and math.isfinite(b)]
        if gaps and max(gaps) > TOL:
            out.append(f"{key}: max gap {max(gaps):.3g}")
    return out


@pytest.mark.parametrize("fault_id", [pytest.param(f, id=f"{FAULTS[f].target}/{f}") for f in IDS])
def test_blind_fault_manifests(fault_id, clean_runs, request):
    spec = FAULTS[fault_id]
    m = spec.manifest
    use_pool = request.getfixturevalue("pool") if m.scenario.startswith("ddp") else None
    seed = m.seeds[0]
    key = (spec.target, m.scenario, repr(sorted(m.variant.items())), m.steps, seed)
    if key not in clean_runs:
        clean_runs[key] = run_scenario(m.scenario, m.variant, m.steps, seed, pool=use_pool, target=spec.target)
    clean = clean_runs[key]
    assert clean.crash is None, f"the clean run crashed: {clean.crash}"
    faulty = run_scenario(m.scenario, m.variant, m.steps, seed, (fault_id,), (PLUGIN,), pool=use_pool,
                          target=spec.target)
    if m.check == "crash":
        assert faulty.crash is not None and faulty.crash["type"] in m.params["types"], \
            f"{fault_id} did not crash as its manifest says: {faulty.crash}"
        return
    diff = differences(clean, faulty)
    print(f"\n{fault_id}: {'; '.join(diff)}")
    assert diff, f"{spec.target}/{fault_id} did not manifest: faulty run identical to the clean one"
