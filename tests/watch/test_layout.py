"""What the training rows look like, against the user's known-good runs (batches.layout, bb_golden_layout) and
against the tokenizer (bb_pad_ids, evaluation batches included).

A toy loop of "BOS text EOS" documents cut at LIMIT tokens and padded to the longest row of each batch; its two
classic data bugs (a cut that slices the EOS off, every batch padded to LIMIT) leave the loss as it was, so only the
rows' layout shows them. Each run takes a few milliseconds.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import faultbench
from faultbench.detectors.blackbox.batches import batch_hash, layout, row_hashes
from tests.watch.test_gradients import Toy

PAD, EOS, BOS, VOCAB, LIMIT, ROWS, STEPS = 0, 1, 2, 24, 16, 4, 8
DETECTORS = ["bb_golden_layout", "bb_pad_ids"]
SEEDS = (1, 2)  # runs that cut a document (at steps 3 and 4), not at the first step


class Tok:
    pad_token_id, eos_token_id, bos_token_id = PAD, EOS, BOS


def _documents(rng: torch.Generator) -> list[list[int]]:
    """ROWS documents "BOS text EOS" of 4 to 17 tokens: one in 14 longer than LIMIT."""
    return [[BOS] + torch.randint(3, VOCAB, (int(torch.randint(2, 16, (1,), generator=rng)),), generator=rng).tolist()
            + [EOS] for _ in range(ROWS)]


def _cut(doc: list[int], bug: str | None) -> list[int]:
    if len(doc) <= LIMIT:
        return doc
    return doc[:LIMIT] if bug == "drop_eos" else doc[:LIMIT - 1] + [EOS]


def _collate(docs: list[list[int]], width: int | None = None, side: str = "right") -> dict:
    """Pads to ``width`` (the longest row by default) on ``side``; labels -100 at the pads."""
    width = width or max(len(d) for d in docs)
    ids, mask = torch.full((len(docs), width), PAD), torch.zeros((len(docs), width), dtype=torch.long)
    for row, doc in enumerate(docs):
        cols = slice(0, len(doc)) if side == "right" else slice(width - len(doc), width)
        ids[row, cols], mask[row, cols] = torch.tensor(doc), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _run(bug: str | None = None, seed: int = 1, golden: dict | None = None, fixed_width: bool = False):
    """The loop for STEPS steps under a watch; ``fixed_width``: the loop's own convention pads to LIMIT."""
    torch.manual_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    model = Toy(VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    width = LIMIT if fixed_width or bug == "fixed_width" else None
    with faultbench.watch(model, opt, tokenizer=Tok(), golden=golden, detectors=DETECTORS, report=False) as w:
        for _ in range(STEPS):
            batch = _collate([_cut(d, bug) for d in _documents(rng)], width)
            logits = model(batch["input_ids"], batch["attention_mask"])
            F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return w


@functools.cache
def _golden(fixed_width: bool = False) -> dict:
    return faultbench.record_golden([_run(seed=s, fixed_width=fixed_width) for s in (100, 101)])


def test_layout_counts_the_rows_ends_and_the_padding_past_the_longest_row():
    special = {"bos": BOS, "eos": EOS}
    docs = [[BOS, 5, 6, EOS], [BOS, 5, EOS], [BOS, 5, 6, 7]]  # the last one fills the batch and was cut
    right = layout(**_ids_mask(_collate(docs)), special=special)
    assert right == {"rows": 3, "len": 4, "cells": 12, "idle": 0, "bos": 3, "bos2": 0, "eos": 2, "full": 2,
                     "full_eos": 1}
    assert layout(**_ids_mask(_collate(docs, side="left")), special=special) == right
    # padded to 6: two columns no row uses, and no row fills the batch
    wide = layout(**_ids_mask(_collate(docs, width=6, side="left")), special=special)
    assert wide == {**right, "len": 6, "cells": 18, "idle": 6, "full": 0, "full_eos": 0}
    assert layout(**_ids_mask(_collate(docs, width=6)), special={}) == {"rows": 3, "len": 6, "cells": 18, "idle": 6}
    unpadded = layout(torch.tensor([[BOS, BOS, 5, EOS], [BOS, 5, 6, 7]]), None, special)
    assert unpadded == {"rows": 2, "len": 4, "cells": 8, "idle": 0, "bos": 2, "bos2": 1, "eos": 1, "full": 2,
                        "full_eos": 1}


def test_a_rows_hash_is_its_real_tokens_whatever_the_padding_and_the_same_in_every_process():
    docs = [[BOS, 5, 6, EOS], [BOS, 5, EOS], [BOS, 7, 6, 5, EOS]]
    right = row_hashes(**_ids_mask(_collate(docs)))
    for side, width in (("left", None), ("right", 9), ("left", 9)):
        assert torch.equal(row_hashes(**_ids_mask(_collate(docs, width=width, side=side))), right), (side, width)
    assert torch.equal(row_hashes(torch.tensor(docs[0]), None), right[:1])  # one unpadded row
    changed = row_hashes(**_ids_mask(_collate([[BOS, 5, 6, EOS], [BOS, 6, EOS], docs[2]])))
    assert [bool(a == b) for a, b in zip(changed, right, strict=True)] == [True, False, True]
    assert batch_hash(right) != batch_hash(right.flip(0))  # a batch's hash depends on its rows' order
    # ranks compare hashes: another process (another str-hash seed) computes the same ones
    code = ("import torch; from faultbench.detectors.blackbox.batches import row_hashes; "
            f"print(row_hashes(torch.tensor({_collate(docs)['input_ids'].tolist()}), "
            f"torch.tensor({_collate(docs)['attention_mask'].tolist()})).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert json.loads(out) == right.tolist()


def _ids_mask(batch: dict) -> dict:
    return {"ids": batch["input_ids"], "mask": batch["attention_mask"]}


def test_the_golden_holds_the_known_good_runs_layout_fractions():
    assert _golden()["layout"] == {"bos": [1.0, 1.0], "bos2": [0.0, 0.0], "full_eos": [1.0, 1.0], "eos": [1.0, 1.0],
                                   "idle": [0.0, 0.0]}
    low, high = _golden(fixed_width=True)["layout"]["idle"]  # a loop padding to a fixed length: no invariant
    assert 0 < low < high < 0.5


@pytest.mark.parametrize("seed", SEEDS)
def test_the_correct_loop_is_silent_with_its_golden(seed):
    for fixed_width in (False, True):  # padding to a fixed length is fine where the known-good runs did too
        w = _run(seed=seed, golden=_golden(fixed_width), fixed_width=fixed_width)
        assert w.findings == [] and w.errors == {} and not w.not_applicable, [f.message for f in w.findings]


# bug -> (subsystem, where, layout key) of the finding
BUGS = {"drop_eos": ("data", "tokenizer", "full_eos"), "fixed_width": ("collate", "batch", "idle")}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_cut_that_drops_eos_and_padding_to_the_limit_are_found_at_their_first_step(bug, seed):
    w = _run(bug, seed, golden=_golden())
    top = w.findings[0]
    assert (top.detector, top.subsystem, top.where, top.evidence["key"]) == ("bb_golden_layout", *BUGS[bug])
    clean = _run(seed=seed)
    first = next(r.step for r, c in zip(w.ctx.history, clean.ctx.history, strict=True)
                 if r.layout[BUGS[bug][2]] != c.layout[BUGS[bug][2]])  # the first step the bug changed the rows
    assert top.step == first


def test_an_evaluation_batch_whose_mask_is_padded_on_the_other_side_is_a_collate_finding():
    """Batched generation pads on the left: a mask padded on the right marks pads as real and real tokens as pads."""
    prompts = [[BOS, 5, 6, 7], [BOS, 5]]
    good = _collate(prompts, side="left")
    w = _run()
    model = w.ctx.model
    w.watch_evaluations()
    with torch.no_grad():
        model(good["input_ids"], good["attention_mask"])
        assert w.findings == []
        model(good["input_ids"], _collate(prompts)["attention_mask"])  # the mask of the right padding
    w.stop_watching_evaluations()
    assert {(f.detector, f.subsystem, f.where) for f in w.findings} == {("bb_pad_ids", "collate", "batch")}
    assert {f.evidence["positions"] for f in w.findings} == {2}


@pytest.mark.parametrize(("side", "mask_given", "found"), [("left", False, [("mask", "batch")]), ("right", False, []),
                                                           ("left", True, [])])
def test_left_padding_given_to_the_model_without_its_mask_is_attended_padding(side, mask_given, found):
    """The model called with the ids alone: left padding is attended to by every real token of its rows; right
    padding is never seen by a causal model's real tokens (its targets are bb_loss_padding's to judge); with the mask
    the contract holds."""
    torch.manual_seed(1)
    rng = torch.Generator().manual_seed(1)
    model = Toy(VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with faultbench.watch(model, opt, tokenizer=Tok(), detectors=["bb_pad_ids"], report=False) as w:
        for _ in range(3):
            batch = _collate(_documents(rng), side=side)
            logits = model(batch["input_ids"], batch["attention_mask"] if mask_given else None)
            F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert [(f.subsystem, f.where) for f in w.findings] == found


def _marks_pads_real(docs: list[list[int]]) -> dict:
    """A collate function whose mask marks the padding as real (all ones)."""
    batch = _collate(docs)
    return {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}


class _LibraryCollator:
    """The same collation as an object of a library's (its ``__call__`` compiled as if from site-packages)."""

    scope: dict = {"_marks_pads_real": _marks_pads_real}
    exec(compile("def __call__(self, docs):\n    return _marks_pads_real(docs)\n",  # noqa: S102
                 "/env/site-packages/collators/collate.py", "exec"), scope)
    __call__ = scope["__call__"]


@pytest.mark.parametrize(("collate", "named"), [(_marks_pads_real, "test_layout._marks_pads_real"),
                                                (_LibraryCollator(), None)])
def test_a_batch_finding_names_the_loops_own_collate_function(collate, named):
    """``watch(collate=...)``: a finding about a batch names the function that built it when it is the user's code;
    a library's collator only carries the user's data, so it is not named."""
    rng = torch.Generator().manual_seed(1)
    model = Toy(VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with faultbench.watch(model, opt, tokenizer=Tok(), detectors=["bb_pad_ids"], report=False, collate=collate) as w:
        for _ in range(2):
            batch = collate(_documents(rng))
            logits = model(batch["input_ids"], batch["attention_mask"])
            F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    (finding,) = w.findings
    assert (finding.subsystem, finding.where) == ("collate", "batch")
    code = finding.evidence.get("code")
    assert (code["qualname"].endswith(named) and code["library"] is None) if named else code is None
