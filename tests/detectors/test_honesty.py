"""Honesty: detectors never see which fault is injected and cannot reach the answer or the clean reference."""

import ast
from pathlib import Path

import pytest

from detectors.api import Detector, RunContext, all_detectors, register, resolve_ids
from faults.registry import all_faults
from harness.case import Case, run_case

ROOT = Path(__file__).resolve().parents[2]
DETECTORS_DIR = ROOT / "detectors"
# our detectors and the peer tools' detector adapters (the TrainCheck runner is not a detector: it runs cases)
SOURCES = sorted(DETECTORS_DIR.glob("*.py")) + [ROOT / "peers" / f for f in ("torcheck_peer.py", "smdebug_peer.py")]
# ways around the import rule: the module table, code swapping, the injection's env and line cache
FORBIDDEN_TEXT = ("sys.modules", "__code__", "linecache", "FAULTBENCH_", "importlib.import_module(\"faults",
                  "__import__")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_detector_modules_import_neither_faults_nor_the_reference(path):
    assert not _imports(path) & {"faults", "model", "harness"}, _imports(path)


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name != "api.py"], ids=lambda p: p.name)
def test_detector_modules_do_not_reach_around_the_rule(path):
    text = path.read_text()
    assert not [t for t in FORBIDDEN_TEXT if t in text]


def test_every_detector_is_registered_with_a_known_family_and_description():
    registry = all_detectors()
    assert len([d for d, c in registry.items() if not c.baseline]) >= 20
    for det_id, cls in registry.items():
        assert cls.description, det_id


def test_unknown_detector_ids_get_a_suggestion():
    some = next(iter(all_detectors()))
    with pytest.raises(ValueError, match="did you mean"):
        resolve_ids([some[:-1] + "x"])


def _strings(obj, depth=0, seen=None):
    """Every string reachable from obj's attributes (a few levels deep): what a detector could read."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k, depth + 1, seen)
            yield from _strings(v, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in list(obj)[:50]:
            yield from _strings(v, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not callable(obj):
        yield from _strings(vars(obj), depth + 1, seen)


def test_the_run_context_carries_no_fault_id_or_metadata():
    spec = all_faults()["label_permute"]
    seen: list[str] = []

    @register
    class Spy(Detector):
        id = "test_context_spy"
        baseline = True
        description = "collects every string the context exposes"

        def on_start(self, ctx: RunContext):
            seen.extend(_strings(ctx))
            seen.extend(_strings(ctx.run.config.to_dict()))

    try:
        record = run_case(Case("fp32", 0, (spec.id,), ("test_context_spy",)))
    finally:
        from detectors.api import DETECTORS

        DETECTORS.pop("test_context_spy")
    assert record["crash"] is None and seen
    text = "\n".join(seen)
    for secret in (spec.id, spec.title, spec.explanation[:40], "faults."):
        assert secret not in text
