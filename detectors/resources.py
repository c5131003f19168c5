"""Resource detectors: wasted compute from padding, and memory kept alive by the step records.

``padding_waste`` watches the real batches (sampled steps): a batch must be exactly as wide as its
longest real row (dynamic padding). A wider batch is blamed on collate if the run's collate, called on
the batch's own documents, pads too wide as well, and on its caller otherwise.

``graph_retention`` checks after every step that the step record (and the last entry of
``run.history``) holds no tensor attached to an autograd graph: such a record keeps the step's whole
graph, activations included, alive for the rest of the run.
"""

from __future__ import annotations

import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, register

COLLATE = "model.data.collate"
NEXT_MICRO_BATCHES = "model.train.next_micro_batches"
TRAIN_STEP = "model.train.train_step"


@register
class PaddingWaste(probes.BatchWatch):
    id = "padding_waste"
    family = "resources"
    passive = True
    description = "each batch is as wide as its longest real row (no padding beyond it); collate vs its caller"

    def check_batch(self, ctx, batch) -> bool:
        side = ctx.fact("pad_side")
        mask = batch.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return False
        width = mask.shape[1]
        longest = int(mask.long().sum(1).max())
        if longest >= width:
            return False
        docs = probes.documents(batch, side)  # None: a mask collate_contract judges
        if docs is None:
            return False
        evidence = {"width": width, "longest_row": longest, "real_tokens": int(mask.long().sum()),
                    "positions": mask.numel(), "step": ctx.step}
        if COLLATE not in ctx.seams:  # no collate to re-run: the waste is found, its place is not
            self.report(ctx, "collate", None, f"batch padded to {width} columns but its longest document has "
                        f"{longest} tokens", evidence, confidence=0.4)
            return True
        ref_width, error = probes.recollate(ctx, docs, side, lambda ref: int(ref["input_ids"].shape[1]))
        if error is not None:
            evidence["collate_error"] = error
        evidence["collate_width_on_these_docs"] = ref_width
        waste = 1 - evidence["real_tokens"] / evidence["positions"]
        what = (f"batch padded to {width} columns but its longest document has {longest} tokens "
                f"({waste:.0%} of the positions are pads)")
        if ref_width == longest:
            self.report(ctx, "data", NEXT_MICRO_BATCHES,
                        f"{what}; the run's collate on the same documents pads to {longest}, so its caller "
                        "widens the batch", evidence, confidence=0.7)
        else:
            self.report(ctx, "collate", COLLATE,
                        f"{what}; the run's collate pads the same documents to {ref_width}", evidence,
                        confidence=0.85)
        return True


def _graph_tensors(obj) -> list[str]:
    """Names of the fields of a record that hold a tensor attached to an autograd graph."""
    fields = getattr(obj, "__dict__", None)
    if fields is None and isinstance(obj, dict):
        fields = obj
    if not isinstance(fields, dict):
        return []
    out = []
    for name, value in fields.items():
        values = value if isinstance(value, (list, tuple)) else (value,)
        for v in values:
            if isinstance(v, torch.Tensor) and (v.requires_grad or v.grad_fn is not None):
                out.append(f"{name}: tensor{tuple(v.shape)} grad_fn={type(v.grad_fn).__name__}")
                break
    return out


@register
class GraphRetention(Detector):
    id = "graph_retention"
    family = "resources"
    passive = True
    description = "the step record and run.history hold no tensor attached to an autograd graph (memory growth)"

    def on_after_step(self, ctx, record) -> None:
        if self.findings:
            return
        held = _graph_tensors(record)
        history = getattr(ctx.run, "history", None)
        if history and history[-1] is not record:
            held += [f"run.history[-1].{h}" for h in _graph_tensors(history[-1])]
        if held:
            self.report(ctx, "optimizer", ctx.known_seam(TRAIN_STEP),
                        "the step record keeps a tensor attached to the autograd graph (every step's graph, "
                        f"activations included, stays alive): {', '.join(held)}",
                        {"fields": held, "history_len": len(history) if history is not None else None},
                        confidence=0.9)
