"""Collate detectors: the collate contract probe on hand-broken collates; silent on the reference."""

import pytest
import torch

from faultbench.detectors.collate import CollateContract, collate_violations, crafted_batches
from faultbench.model.data import collate
from faultbench.model.run import build_run
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


def test_fixed_length_padding_keeps_the_contract():
    """Padding every batch to a fixed width is a legitimate design, not a violation."""
    def fixed(docs, pad_id, pad_side="right", ignore_index=-100):
        batch = collate([*docs, [1] + [5] * 30 + [2]], pad_id, pad_side, ignore_index)
        return {k: v[: len(docs)] for k, v in batch.items()}

    for side in ("right", "left"):
        assert violations(fixed, side) == {}


def _edit(key, change):
    """A collate whose ``key`` tensor is passed through ``change(tensor, batch, docs)``: a hand-broken variant."""
    def broken(docs, pad_id, pad_side="right", ignore_index=-100):
        batch = collate(docs, pad_id, pad_side, ignore_index)
        return {**batch, key: change(batch[key].clone(), batch, docs)}
    return broken


def _mask_bos(mask, batch, docs):
    mask[torch.arange(mask.shape[0]), mask.argmax(1)] = 0  # each row's first real token (BOS) hidden
    return mask


def _labels_pre_shifted(labels, batch, docs):
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)


def _positions_from_column_0(positions, batch, docs):
    return torch.arange(positions.shape[1]).expand_as(positions).clone()


def _rows_reversed(ids, batch, docs):
    return ids.flip(0)


@pytest.mark.parametrize("change, side, kind", [
    (_mask_bos, "right", "mask"),
    (_labels_pre_shifted, "right", "labels"),
    (_positions_from_column_0, "left", "positions"),
    (_rows_reversed, "right", "input_ids"),
], ids=["mask_hides_bos", "labels_pre_shifted", "positions_from_column_0", "rows_reversed"])
def test_hand_broken_collates_are_flagged(change, side, kind):
    key = {"mask": "attention_mask", "labels": "labels", "positions": "position_ids", "input_ids": "input_ids"}[kind]
    assert kind in violations(_edit(key, change), side)


def test_collate_that_cuts_documents_is_flagged():
    def cut(docs, pad_id, pad_side="right", ignore_index=-100):
        return collate([d[:5] for d in docs], pad_id, pad_side, ignore_index)

    assert "width" in violations(cut, "right")


def test_labels_that_ignore_the_padding_side_break_left_padding():
    def labels_of_right_padding(docs, pad_id, pad_side="right", ignore_index=-100):
        return {**collate(docs, pad_id, pad_side, ignore_index),
                "labels": collate(docs, pad_id, "right", ignore_index)["labels"]}

    assert violations(labels_of_right_padding, "right") == {}
    assert "labels" in violations(labels_of_right_padding, "left")


def test_detector_reports_collate(run):
    det = CollateContract()
    det.on_start(context(run))
    assert not det.findings
    det = CollateContract()
    det.on_start(context(run, **{"model.data.collate": _edit("attention_mask", _mask_bos)}))
    assert [(f.subsystem, f.seam) for f in det.findings] == [("collate", "model.data.collate")]
    assert "mask" in det.findings[0].evidence["problems"]
