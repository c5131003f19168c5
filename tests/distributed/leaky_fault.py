"""A plugin fault that leaves process-global state behind: the first time its seam runs, it rebinds
``torch.nn.functional.cross_entropy`` to a doubled loss and never restores it (a monkeypatch outside the
seam, as a careless bug fix or a test helper might leave). Only the rank pool's isolation keeps it out of
the cases that follow."""

import torch.nn.functional as F

from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import IGNORE_INDEX
from faultbench.model.loss import count_targets


@fault(
    "test_leaky_global_patch",
    seam="model.loss.lm_loss",
    title="The loss rebinds F.cross_entropy for the whole process",
    subsystem="loss",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="A test-only fault: its effect outlives the case that injected it.",
    fix="Restore what you patch.",
    references=("tests/distributed/test_pool.py: the pool's isolation between cases",),
    manifest=Manifest(check="loss_above", steps=5, params={"min_gap": 0.01}),
)
def leaky_lm_loss(logits, labels, num_targets=None, ignore_index=IGNORE_INDEX):
    """Doubles every later cross-entropy of the process, this case's and (unisolated) the next ones'."""
    if not getattr(F.cross_entropy, "leaked", False):
        inner = F.cross_entropy

        def doubled(*args, **kwargs):
            return 2 * inner(*args, **kwargs)

        doubled.leaked = True
        F.cross_entropy = doubled
    total = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    return total / max(num_targets if num_targets is not None else count_targets(labels, ignore_index), 1)
