"""Building a detector's context in unit tests: the run, with some seams swapped for hand-broken functions."""

from faultbench import targets
from faultbench.detectors.api import RunContext
from faultbench.model.seams import SEAMS, resolve

REF_ROLES = targets.get("ref").roles()


def context(run, golden=None, **replaced) -> RunContext:
    """The context a detector gets on ``run``; ``replaced`` maps seam names to the functions to use instead
    (pass them as ``**{"model.data.collate": broken}``)."""
    return RunContext(run=run, seam_resolver=lambda name: replaced.get(name) or resolve(name), seams=dict(SEAMS),
                      golden=golden, roles=REF_ROLES)


def start_findings(detector_cls, run, **replaced) -> list:
    """What a fresh detector reports at on_start with those seams replaced."""
    detector = detector_cls()
    detector.on_start(context(run, **replaced))
    return detector.findings
