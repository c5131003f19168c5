"""Every module's output at the start of training stays within the known-good runs' scale (black-box track):
``blocks.numerics.activation-envelope``, its envelope half (``bb_first_nonfinite`` checks the finite half).

On a fresh watch's first training forward the watch reads each submodule's output once, in the order the modules
ran (``ActivationRecorder``: std, mean and size of the output, the first tensor of a tuple; a module called twice
counts its first call) into ``StepRecord.activations``; ``faultbench.record_golden`` spans them over the known-good
runs (``golden["activations"]``). At that point every run holds freshly initialized weights of the same
distribution and a batch of the same kind, so a module computing otherwise than the known-good runs' (another
norm, activation, scaling, residual or mixing) moves its output's scale where seeds barely do.
``bb_golden_activations`` names the FIRST module, in execution order, whose output std leaves the span by more
than ``MARGIN`` or whose mean leaves it by more than ``MEAN_MARGIN`` of the std (exactly, where every known-good
run read the same values): the modules before it computed as known-good, so the break is in it, or, where the break
moved the scale less than the margins, in a module shortly before it.
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, StepRecord, WatchContext

EXACT = 1e-5  # relative: where every known-good run read the same value


def _first_tensor(output) -> torch.Tensor | None:
    """The module's output tensor: itself, the first tensor of a tuple or list, or of a mapping's values."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if hasattr(output, "values") else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


class ActivationRecorder:
    """Reads one forward's submodule outputs: ``start()`` before it, ``stop()`` after; ``stats`` is then
    {module name: [std, mean, numel]} in the order the modules ran."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.stats: dict[str, list] = {}
        self._handles: list = []

    def start(self) -> None:
        names = {m: n for n, m in self.model.named_modules() if n}

        @torch.no_grad()
        def read(module, args, output) -> None:
            name, t = names[module], _first_tensor(output)
            if name in self.stats or t is None or not t.is_floating_point() or t.numel() < 2:
                return
            std, mean = torch.std_mean(t.detach().float())
            self.stats[name] = [float(std), float(mean), t.numel()]

        self._handles = [m.register_forward_hook(read) for m in names]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@register
class GoldenActivations(BlackBoxDetector):
    """See the module's docstring: the first module whose output at the first training forward leaves the
    known-good runs' scale."""

    id = "bb_golden_activations"
    family = "model"
    description = "each module's output scale at the first training forward vs the known-good runs' (in run order)"
    MARGIN = 0.3  # relative, beyond the span: other seeds' weights and batches move a healthy module's std less
    MEAN_MARGIN = 0.5  # the mean may leave its span by this share of the output's std (a layer's output mean is
    # its weights' row sums times the input's mean: it moves with the seed far more than the std does)

    def on_start(self, ctx: WatchContext) -> None:
        if not (ctx.golden or {}).get("activations"):
            raise NotApplicable("no golden envelope of fresh runs' first forward (faultbench.record_golden)")
        if ctx.initial is None:
            raise NotApplicable("a resumed run: its first forward runs trained weights")

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        self.retire("on_after_step")
        golden = ctx.golden["activations"]
        for name, (std, mean, n) in (record.activations or {}).items():
            g = golden.get(name)  # the batch's shape may differ from the known-good runs': sizes are not compared
            if not g or not (math.isfinite(std) and math.isfinite(mean)):
                continue
            why = self._outside(std, mean, n, g)
            if why:
                self.report(ctx, "model", name,
                            f"at the first training forward {name} put out values of {why} (the modules before it "
                            "agreed): it computes otherwise than declared (another normalization, activation, "
                            "scaling, residual or mixing)",
                            {"module": name, "std": std, "mean": mean, "golden": g}, confidence=0.4)
                return

    def _outside(self, std: float, mean: float, numel: int, golden: dict) -> str | None:
        (lo, hi), (mlo, mhi) = golden["std"], golden["mean"]
        scale = max(abs(hi), abs(mlo), abs(mhi), 1e-12)
        if hi - lo <= EXACT * scale and mhi - mlo <= EXACT * scale:  # every known-good run read the same values
            if numel != golden["numel"]:  # of another batch shape: nothing to compare exactly
                return None
            same = abs(std - hi) <= EXACT * scale and abs(mean - mhi) <= EXACT * scale
            return None if same else f"std {std:.4g} and mean {mean:.4g} where every known-good run's were {hi:.4g} " \
                                     f"and {mhi:.4g}"
        if not lo / (1 + self.MARGIN) <= std <= hi * (1 + self.MARGIN):
            return f"std {std:.4g} where the known-good runs' were {lo:.4g}-{hi:.4g}"
        if not mlo - self.MEAN_MARGIN * hi <= mean <= mhi + self.MEAN_MARGIN * hi:
            return f"mean {mean:.4g} where the known-good runs' were {mlo:.4g}-{mhi:.4g} (std {lo:.4g}-{hi:.4g})"
        return None
