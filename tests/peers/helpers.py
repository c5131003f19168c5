"""Shared by the peers' end-to-end tests."""

from faultbench.harness.case import run_target_case
from faultbench.harness.record import Case


def run_with_peer(detector: str, faults: tuple[str, ...]) -> dict:
    """One fp32 case (seed 0) with a peer's plugin detector alone."""
    return run_target_case(Case("fp32", 0, faults, (detector,), (f"faultbench.peers.{detector}_peer",)))
