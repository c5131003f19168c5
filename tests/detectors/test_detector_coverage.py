"""Every registered detector is named by some test file: a cheap proxy of its having a positive test.

The real check is ``python -m benchmarks.detector_mutation`` (each detector made a no-op: its tests must go red,
results/detector_mutation.md). This guard only catches a detector added (or renamed) with no test naming its id
or its class, which that table would then list as a survivor.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from faultbench.detectors.api import all_detectors

TESTS = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()


def named(names, text: str) -> list[str]:
    """Those of ``names`` that ``text`` holds as a whole word (not as part of a longer id or a dotted path)."""
    return [n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", text)]


def _test_text() -> str:
    return "\n".join(p.read_text() for p in sorted(TESTS.rglob("test_*.py")) if p.resolve() != HERE)


@pytest.fixture(scope="module")
def text() -> str:
    return _test_text()


def test_the_registry_is_read(text):
    registry = all_detectors()
    assert len(registry) > 20 and {"white-box", "black-box"} <= {cls.track for cls in registry.values()}
    assert text and "def test_" in text


@pytest.mark.parametrize("det_id", sorted(all_detectors()))
def test_every_detector_is_named_by_a_test(det_id, text):
    cls = all_detectors()[det_id]
    assert named((det_id, cls.__name__), text), (
        f"no test file under tests/ names detector {det_id!r} ({cls.__module__}.{cls.__name__}): add a positive test "
        f"that fails when it is a no-op (check: python -m benchmarks.detector_mutation --only {det_id})")


def test_a_name_counts_only_as_a_whole_word():
    text = 'ids = ["bb_lr_shape_x", "x.bb_eval"]\nfrom m import (LRShape,)\nw(detectors=["bb_grads_cleared"])'
    assert named(["bb_lr_shape", "bb_eval", "LRShape", "bb_grads_cleared", "bb_grads"], text) == [
        "LRShape", "bb_grads_cleared"]
