"""The metrics panel a debugging engineer looks at first: faulty against clean on the same axes."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (
    ("losses", "loss (nats/token)", False),
    ("grad_norms", "pre-clip grad norm", True),
    ("lrs", "learning rate", False),
    ("scales", "loss scale (x: skipped)", True),
    ("tokens_per_s", "tokens / s", False),
)


def plot_runs(runs: dict, path, title: str = "") -> Path:
    """Draw each Outcome of ``runs`` ({label: Outcome}) on a row of metric panels; write a PNG."""
    fig, grid = plt.subplots(2, 3, figsize=(13, 6.5))
    axes = grid.flat
    grid[-1, -1].axis("off")  # five panels on a 2 x 3 grid
    for (attr, label, log), ax in zip(PANELS, axes, strict=False):
        for name, out in runs.items():
            values = [v if math.isfinite(v) else math.nan for v in getattr(out, attr)]
            ax.plot(range(len(values)), values, label=name, lw=1.2)
            if attr == "scales":
                skipped = [i for i, s in enumerate(out.skipped) if s]
                ax.scatter(skipped, [values[i] for i in skipped], marker="x", s=18)
            if out.crash and out.crash.get("step") is not None:
                ax.axvline(out.crash["step"], color="red", ls=":", lw=1)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if log and any(v > 0 for out in runs.values() for v in getattr(out, attr)):
            ax.set_yscale("log")
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
