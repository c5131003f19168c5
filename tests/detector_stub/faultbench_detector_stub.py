"""``FAULTBENCH_STUB_DETECTOR=<id> pytest ...``: the registered detector ``<id>`` records no finding.

The mutation test over detectors (benchmarks/detector_mutation.py): with one detector made a no-op, the tests
that exercise it must fail; if they all pass, the detector has no positive test. Its source is not edited: every
detector records findings only through ``Detector.findings`` (``report``/``report_once`` of detectors/api.py and
detectors/blackbox/api.py append to it), so a detector whose id is ``<id>`` gets a ``findings`` list that drops
everything appended to it. Its hooks still run (their errors, time and side effects are unchanged).

How it reaches every process: tests/conftest.py imports this module in the pytest process (and xdist workers),
and ``activate`` puts this folder on PYTHONPATH. The folder holds a dist-info declaring this module an entry
point of the ``faultbench.detectors`` group, the group ``all_detectors()`` loads (detectors/api.py): so every
process that builds a suite or a watch (RankPool ranks, spawned watches, ``python -m faultbench``) imports it
too, before it instantiates a detector. A process that builds a detector class directly without ever calling
``all_detectors()`` is not reached (none of the tests' worker functions does).

``FAULTBENCH_STUB_DETECTOR=-``: the machinery on, no detector stubbed (the script's control run).
"""

from __future__ import annotations

import os
from pathlib import Path

from faultbench.detectors.api import Detector

ENV = "FAULTBENCH_STUB_DETECTOR"
NOTHING = "-"
HERE = str(Path(__file__).resolve().parent)


class NoFindings(list):
    """A findings list that stays empty."""

    def append(self, item) -> None:
        pass

    def extend(self, items) -> None:
        pass

    def insert(self, index, item) -> None:
        pass

    def __iadd__(self, other):
        return self


def _patch(stub_id: str) -> None:
    if getattr(Detector.__init__, "stubbed", None) is not None:
        return
    original = Detector.__init__

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if self.id == stub_id:
            self.findings = NoFindings()

    __init__.stubbed = stub_id
    Detector.__init__ = __init__


def stubbed() -> str | None:
    """The id stubbed in this process, or None."""
    return getattr(Detector.__init__, "stubbed", None)


def activate() -> str | None:
    """Called by tests/conftest.py: check the id, stub it here and export the entry point to child processes."""
    stub_id = os.environ.get(ENV, "")
    if not stub_id:
        return None
    from faultbench.detectors.api import all_detectors

    if stub_id != NOTHING and stub_id not in all_detectors():
        raise ValueError(f"{ENV}={stub_id!r} is not a registered detector id")
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if HERE not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *parts])
    return stub_id


if os.environ.get(ENV, "") not in ("", NOTHING):
    _patch(os.environ[ENV])
