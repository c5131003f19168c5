"""A spy detector for the honesty test: it implements every hook and collects every string it can reach.

Loaded as a plugin (``Case.plugins``) so that the ranks of a data-parallel case register it too; what it
saw comes back in the case record's summaries.
"""

from __future__ import annotations

from faultbench.detectors.api import HOOKS, Detector, RunContext, register
from tests.detectors.reach import reachable_strings


@register
class Spy(Detector):
    """Implements every hook; the first call of each walks the whole context, every call walks its arguments."""

    id = "test_context_spy"
    family = "baseline"
    baseline = True
    description = "collects every string the context and the hooks' arguments expose"

    def __init__(self) -> None:
        super().__init__()
        self.strings: set[str] = set()
        self.calls: set[str] = set()

    def _see(self, hook: str, ctx: RunContext, *args) -> None:
        self.strings |= reachable_strings(*args, ctx.config.to_dict(), ctx.step, ctx.phase)
        if hook not in self.calls:
            self.strings |= reachable_strings(ctx)
        self.calls.add(hook)

    def summary(self) -> dict:
        return {"hooks": sorted(self.calls), "strings": sorted(self.strings)}


for _hook in HOOKS:  # one method per hook, each recording its own name
    setattr(Spy, _hook, lambda self, ctx, *args, _h=_hook: self._see(_h, ctx, *args))


