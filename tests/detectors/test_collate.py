"""Collate detectors: the collate contract probe on hand-broken collates; silent on the reference."""

import pytest
import torch

from detectors.collate import CollateContract, collate_violations, crafted_batches
from model.data import collate
from model.run import build_run
from tests.detectors.helpers import context


@pytest.fixture(scope="module")
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}))


BATCHES = crafted_batches(1, 2, list(range(10, 60)))


def violations(fn, side):
    found = {}
    for docs in BATCHES.values():
        found.update(collate_violations(fn, docs, 0, side, 256, -100))
    return found


def test_reference_keeps_the_contract():
    for side in ("right", "left"):
        assert violations(collate, side) == {}


def test_inverted_mask_and_pad_labels_and_width():
    def inverted(docs, pad_id, pad_side="right", ignore_index=-100):
        batch = collate(docs, pad_id, pad_side, ignore_index)
        return {**batch, "attention_mask": 1 - batch["attention_mask"]}

    def pad_labels(docs, pad_id, pad_side="right", ignore_index=-100):
        batch = collate(docs, pad_id, pad_side, ignore_index)
        labels = torch.where(batch["attention_mask"].bool(), batch["labels"], pad_id)
        return {**batch, "labels": labels}

    def unpadded_none(docs, pad_id, pad_side="right", ignore_index=-100):
        batch = collate(docs, pad_id, pad_side, ignore_index)
        return {**batch, "attention_mask": None} if bool(batch["attention_mask"].all()) else batch

    assert "mask" in violations(inverted, "right")
    assert "labels" in violations(pad_labels, "right")
    assert "mask" in violations(unpadded_none, "left")


def test_labels_at_the_right_padding_offset_break_left_padding():
    def right_offset(docs, pad_id, pad_side="right", ignore_index=-100):
        batch = collate(docs, pad_id, pad_side, ignore_index)
        labels = torch.full_like(batch["labels"], ignore_index)
        for row, ids in enumerate(docs):
            labels[row, 1 : len(ids)] = torch.tensor(ids[1:])
        return {**batch, "labels": labels}

    assert violations(right_offset, "right") == {}
    assert "labels" in violations(right_offset, "left")


def test_detector_reports_collate(run):
    det = CollateContract()
    det.on_start(context(run))
    assert not det.findings

    def wide(docs, pad_id, pad_side="right", ignore_index=-100):
        batch = collate([*docs, [1] + [5] * 62 + [2]], pad_id, pad_side, ignore_index)
        return {k: v[: len(docs)] for k, v in batch.items()}

    det = CollateContract()
    det.on_start(context(run, **{"model.data.collate": wide}))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("collate", "model.data.collate")]
    assert "width" in det.findings[0].evidence["problems"]
