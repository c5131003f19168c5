"""Every registered fault of every target is real: its scenario, clean vs faulty on the same seeds, shows the symptom.

Parametrized over (target, fault id), e.g. ``ref/label_permute`` and ``hf/hf_label_shift_off_by_one``. The
session's clean runs are shared per (target, scenario, variant, steps, seed) by all workers (``clean_cache``). The
HF proofs are spread over the workers like the reference's: each worker pays the transformers import once
(seconds), while one xdist group would leave the other worker idle for minutes. The data-parallel proofs run on
the worker of the session's 2-rank pool (``rank_pool``), with the suite's data-parallel cases.
Plugin faults too: ``pytest tests/faults/test_manifest.py --fault-plugin FILE -k FAULT_ID`` proves one."""

import pytest

from faultbench.faults.registry import all_faults
from faultbench.harness.manifest import prove

FAULTS = all_faults(None)


@pytest.mark.parametrize("fault_id", [
    pytest.param(f, id=f"{FAULTS[f].target}/{f}",
                 marks=[pytest.mark.xdist_group("rank_pool")] if FAULTS[f].manifest.scenario.startswith("ddp") else [])
    for f in sorted(FAULTS, key=lambda f: (FAULTS[f].target, f))])
def test_fault_manifests(fault_id, clean_cache, fault_plugins, request):
    spec = FAULTS[fault_id]
    pool = request.getfixturevalue("rank_pool") if spec.manifest.scenario.startswith("ddp") else None
    ok, evidence = prove(fault_id, pool=pool, plugins=fault_plugins, clean_cache=clean_cache)
    assert ok, f"{spec.target}/{fault_id} did not manifest: {evidence}"
