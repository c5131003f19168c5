"""The model starts as declared (black-box track): ``blocks.numerics.init-scale`` and, for the tables a model
derives from its config (rotary frequencies, causal masks kept as buffers), ``positions.state.derived-tables``.

The watch reads each parameter and floating buffer once, as it finds them at the start of a fresh run
(``WatchContext.initial``: std, mean, size); ``faultbench.record_golden`` spans them over the known-good runs
(``golden["init"]``). ``bb_golden_init`` compares, in the model's own order:

- a tensor every known-good run started identical (a constant, or a table derived from the config): equal within
  float rounding;
- a random tensor: its std inside the known-good span widened by ``MARGIN`` plus the sampling error of a std over
  its elements (about 1/sqrt(2n)), and its mean inside the span widened by ``MEAN_SIGMAS`` standard errors.

A tensor outside names its module. A resumed watch (its weights come from a checkpoint) is not judged.
"""

from __future__ import annotations

import math

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, WatchContext

EXACT = 1e-5  # relative: the same computation in the same dtype, on another seed


def _outside(now: list, golden: dict, margin: float, mean_sigmas: float) -> str | None:
    """Why ``now`` ([std, mean, numel]) lies outside ``golden``'s spans, or None."""
    std, mean, n = now
    (slo, shi), (mlo, mhi) = golden["std"], golden["mean"]
    scale = max(abs(shi), abs(mhi), abs(mlo), 1e-12)
    if shi - slo <= EXACT * scale and mhi - mlo <= EXACT * scale:  # identical in every known-good run
        if abs(std - shi) > EXACT * scale or abs(mean - mhi) > EXACT * scale:
            return f"std {std:.4g} and mean {mean:.4g} where every known-good run started with {shi:.4g} and {mhi:.4g}"
        return None
    wide = margin + 3 / math.sqrt(2 * n)
    if not slo * (1 - wide) <= std <= shi * (1 + wide):
        return f"std {std:.4g} where the known-good runs started with {slo:.4g}-{shi:.4g}"
    error = mean_sigmas * max(std, shi) / math.sqrt(n)
    if not mlo - error <= mean <= mhi + error:
        return f"mean {mean:.4g} where the known-good runs started with {mlo:.4g}-{mhi:.4g}"
    return None


@register
class GoldenInit(BlackBoxDetector):
    """See the module's docstring: the weights and derived tables as the run starts vs the known-good runs'."""

    id = "bb_golden_init"
    against_golden = True
    family = "model"
    description = "parameters and derived buffers at the start vs the known-good runs' (initialization as declared)"
    MARGIN = 0.1
    MEAN_SIGMAS = 6.0

    def on_start(self, ctx: WatchContext) -> None:
        golden = (ctx.golden or {}).get("init")
        if not golden:
            raise NotApplicable("no golden envelope of fresh runs' initial weights (faultbench.record_golden)")
        if ctx.initial is None:
            raise NotApplicable("a resumed run: its weights come from a checkpoint, not from initialization")
        off = []
        for name, now in ctx.initial.items():
            g = golden.get(name)
            why = _outside(now, g, self.MARGIN, self.MEAN_SIGMAS) if g and g["numel"] == now[2] else None
            if why:
                off.append({"tensor": name, "why": why})
        if off:
            first = off[0]
            module = first["tensor"].rpartition(".")[0] or first["tensor"]
            more = f" (and {len(off) - 1} more tensors)" if len(off) > 1 else ""
            self.report(ctx, "model", module,
                        f"the model starts unlike the known-good runs: {first['tensor']} has {first['why']}{more}: "
                        "it is not initialized as declared (another std or mean, a scaling left out, an init not "
                        "applied or applied twice, a table derived from other settings)",
                        {"tensors": off[:5], "count": len(off)}, confidence=0.65)
