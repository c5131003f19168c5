"""Bad input fails loudly and early, with a message that names the problem."""

from __future__ import annotations

import copy
import json
import random
import shutil

import numpy as np
import pytest
import torch

from faultbench.model.checkpoint import CheckpointError, capture_rng_state, load_checkpoint, save_checkpoint
from faultbench.model.config import DataConfig, ModelConfig, TrainConfig, get_preset
from faultbench.model.data import collate, load_corpus
from faultbench.model.run import build_run
from faultbench.model.train import train

CONFIG_CASES = [
    pytest.param(lambda: ModelConfig(n_embd=64, n_head=6), "does not divide", id="heads-not-dividing-width"),
    pytest.param(lambda: ModelConfig(n_embd=12, n_head=4), "head_dim .* must be even", id="odd-head-dim"),
    pytest.param(lambda: ModelConfig(dropout=1.0), "dropout must be in", id="dropout-1"),
    pytest.param(lambda: TrainConfig(precision="fp8"), "unknown precision 'fp8'", id="unknown-precision"),
    pytest.param(lambda: DataConfig(pad_side="middle"), "unknown pad_side 'middle'", id="unknown-pad-side"),
    pytest.param(lambda: TrainConfig(batch_size=16, accum=3), "divisible by accum=3", id="batch-not-divisible"),
    pytest.param(lambda: TrainConfig(lr=1e-3, min_lr=1e-2), "min_lr <= lr", id="min-lr-above-lr"),
    pytest.param(lambda: TrainConfig(steps=10, warmup_steps=20), "warmup_steps", id="warmup-longer-than-run"),
    pytest.param(
        lambda: get_preset("tiny").replace(data={"seq_len": 128}), "longer than the position table",
        id="seq-len-over-max-positions",
    ),
    pytest.param(
        lambda: get_preset("tiny").replace(data={"vocab_size": 512}), "exceeds the model's embedding",
        id="tokenizer-vocab-over-embedding",
    ),
    pytest.param(
        lambda: get_preset("tiny").replace(data={"truncate": False}), "truncate=False",
        id="no-truncation-with-long-docs",
    ),
    pytest.param(lambda: get_preset("smal"), "unknown preset 'smal'; did you mean 'small'", id="unknown-preset"),
    pytest.param(lambda: get_preset("Tiny"), "did you mean 'tiny'", id="unknown-preset-case"),
    # nothing close: no suggestion, but the known names are listed
    pytest.param(
        lambda: get_preset("huge"), r"unknown preset 'huge' \(known: tiny, small, gpu\)", id="unknown-preset-far"
    ),
]


@pytest.mark.parametrize(("make", "match"), CONFIG_CASES)
def test_invalid_config_raises(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: ModelConfig(n_embd=12, n_head=3),  # head_dim 4: divides and is even
        lambda: TrainConfig(batch_size=16, accum=16),
        lambda: TrainConfig(lr=1e-3, min_lr=1e-3, warmup_steps=0),  # constant lr
        lambda: TrainConfig(precision="bf16"),
        lambda: DataConfig(pad_side="left"),
        lambda: get_preset("tiny").replace(data={"seq_len": 64}),  # exactly max_positions
        lambda: get_preset("tiny").replace(data={"truncate": False, "max_words": 8}),  # short docs fit
        lambda: get_preset("small"),
        lambda: get_preset("gpu"),
    ],
    ids=["head-dim-4", "accum-equals-batch", "constant-lr", "bf16", "left-pad", "seq-len-at-limit",
         "no-truncation-short-docs", "preset-small", "preset-gpu"],
)
def test_boundary_configs_are_accepted(make):
    # the checks above reject what is wrong, not what is merely at the edge
    make()


def test_untruncated_long_documents_rejected_by_the_data_loader():
    # DataConfig alone (no RunConfig bound check): the loader itself refuses over-long documents
    with pytest.raises(ValueError, match="exceed seq_len=64 tokens and truncation is off"):
        load_corpus(DataConfig(truncate=False))


def test_collate_rejects_unknown_pad_side():
    with pytest.raises(ValueError, match="pad_side must be 'left' or 'right'"):
        collate([[1, 5, 2]], 0, "center")


def test_generate_beyond_max_positions_raises(trained_model):
    prompt = torch.ones(1, 60, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds max_positions=64"):
        trained_model.generate(prompt, max_new_tokens=5)
    trained_model.generate(prompt, max_new_tokens=4)  # exactly at the limit is fine


def test_forward_beyond_max_positions_raises(trained_model):
    with pytest.raises(ValueError, match="exceeds the position table"):
        trained_model(torch.ones(1, 65, dtype=torch.long))


# --- checkpoints -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    # fp16 (a live GradScaler) and dropout (training draws from the RNG): no part of the state is trivial
    return tiny_cfg.replace(model={"dropout": 0.1}, train={"precision": "fp16"}, seed=3)


def full_state(run) -> dict:
    """A deep copy of everything a checkpoint must carry: model, optimizer, scheduler, scaler, sampler,
    step, step history and the global RNG states."""
    return copy.deepcopy({
        "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
        "sampler": run.sampler.state_dict(), "step": run.step, "history": [r.to_dict() for r in run.history],
        "rng": capture_rng_state(),
    })


def differences(a, b, path: str = "") -> list[str]:
    """Where two nested states (dicts, lists, tuples, tensors, numbers) differ, as dotted paths."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(a.keys() ^ b.keys(), key=str)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b) or not any(isinstance(x, (dict, list, tuple, torch.Tensor)) for x in a):
            return [] if list(a) == list(b) else [path]  # a sequence of plain values differs as a whole
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


@pytest.fixture(scope="module")
def saved(cfg, tmp_path_factory):
    """(checkpoint directory, the run's full state when it was saved)."""
    run = build_run(cfg)
    train(run, until=2)
    return save_checkpoint(run, tmp_path_factory.mktemp("bad") / "ckpt"), full_state(run)


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of the saved checkpoint that a test may damage."""
    return shutil.copytree(saved[0], tmp_path / "ckpt")


@pytest.fixture
def fresh_run(cfg):
    return build_run(cfg)


def refused(run, directory, match: str) -> None:
    """Loading ``directory`` raises CheckpointError matching ``match`` and leaves the run exactly as it was
    (loading verifies before it writes)."""
    before = full_state(run)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(run, directory)
    assert differences(full_state(run), before) == []


def test_good_checkpoint_restores_the_whole_state(saved, ckpt, fresh_run):
    # the resuming process drew random numbers of its own before loading: the load must replace them
    random.random(), np.random.rand(), torch.rand(1)
    before = full_state(fresh_run)
    load_checkpoint(fresh_run, ckpt)
    after = full_state(fresh_run)
    assert differences(after, saved[1]) == []
    # and every part was really restored, not equal by chance: a fresh run differs from the saved one in each
    assert [k for k in after if not differences(before[k], saved[1][k])] == []


def test_corrupted_state_raises(ckpt, fresh_run):
    data = bytearray((ckpt / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "state.pt").write_bytes(bytes(data))
    refused(fresh_run, ckpt, "corrupted")


def test_other_config_raises_naming_the_field(ckpt, cfg):
    refused(build_run(cfg.replace(model={"n_embd": 32})), ckpt, r"model\.n_embd: checkpoint 64 vs run 32$")


def test_other_training_config_raises(ckpt, cfg):
    refused(build_run(cfg.replace(train={"lr": 1e-3, "min_lr": 1e-4})), ckpt, r"train\.lr")


def test_missing_checkpoint_raises(tmp_path, fresh_run):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(fresh_run, tmp_path / "does-not-exist")


def test_missing_state_file_raises(ckpt, fresh_run):
    (ckpt / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="no state.pt"):
        load_checkpoint(fresh_run, ckpt)


def test_unparseable_meta_raises(ckpt, fresh_run):
    (ckpt / "meta.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(fresh_run, ckpt)


def test_tokenizer_mismatch_raises(ckpt, fresh_run):
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["tokenizer_sha256"] = "0" * 64
    (ckpt / "meta.json").write_text(json.dumps(meta))
    refused(fresh_run, ckpt, "another tokenizer")


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


@pytest.mark.parametrize("meta", ["[]", '{"format": 1}', '{"format": 1, "sha256": 3, "config": {}, '
                                                          '"tokenizer_sha256": "x"}'])
def test_a_meta_json_of_another_shape_is_refused_naming_what_it_lacks(ckpt, fresh_run, meta):
    (ckpt / "meta.json").write_text(meta)
    refused(fresh_run, ckpt, "lacks \\(or mistypes\\)")

