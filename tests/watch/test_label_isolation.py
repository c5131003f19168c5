"""bb_label_isolation (head.isolation.labels-not-inputs): the logits of a forward handed labels never depend on them.
Silent on HF's Llama and GPT-2 (their loss is computed beside the logits) and on nanoGPT's targets; found when the
labels reach the model's computation (a module's output changes) or when the loss changes the returned logits in
place (no module's output changes, the logits do)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import faultbench
from faultbench.detectors.blackbox import probes
from faultbench.detectors.blackbox.lm import CausalLM
from tests.watch.test_lm import ids, llama

VOCAB, WIDTH = 32, 16


class Labelled(torch.nn.Module):
    """An embedding, a causal mixing layer and a head; ``forward(input_ids, labels=None) -> (loss, logits)``.
    ``bug``: "reads_labels" adds the labels' embeddings to the hidden states; "in_place" smooths the labels'
    logits in place while computing the loss."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.mix, self.head = (torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, WIDTH),
                                         torch.nn.Linear(WIDTH, VOCAB))
        self.bug = bug

    def forward(self, input_ids, labels=None):
        h = self.wte(input_ids)
        if self.bug == "reads_labels" and labels is not None:
            h = h + 0.5 * self.wte(labels)
        h = h + self.mix(h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[:, None])  # causal: a running mean
        logits = self.head(h)
        loss = None
        if labels is not None:
            if self.bug == "in_place":
                logits.scatter_add_(-1, labels[..., None], torch.full_like(logits[..., :1], 0.1))
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return loss, logits


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_models_whose_loss_leaves_the_logits_alone(seed):
    with torch.no_grad():
        assert probes.label_isolation(CausalLM.wrap(llama(seed).eval()), ids(64, (2, 16), seed)) is None
        assert probes.label_isolation(CausalLM.wrap(Labelled().eval()), ids(VOCAB, (2, 16), seed)) is None


@pytest.mark.parametrize(("bug", "expected"), [("reads_labels", ("model", "wte")), ("in_place", ("loss", "loss"))])
def test_logits_that_depend_on_the_labels_are_found_where_they_change(bug, expected):
    with torch.no_grad():
        result = probes.label_isolation(CausalLM.wrap(Labelled(bug).eval()), ids(VOCAB, (2, 16)))
    assert result is not None and (result.subsystem, result.where) == expected, result


def test_found_through_the_watch_before_the_first_step():
    model = Labelled("reads_labels")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with faultbench.watch(model, optimizer, report=False, detectors=["bb_label_isolation"]) as w:
        x = ids(VOCAB, (4, 16))
        model(x, labels=x)[0].backward()
        optimizer.step()
    assert [(f.detector, f.subsystem, f.step) for f in w.findings] == [("bb_label_isolation", "model", 0)]
