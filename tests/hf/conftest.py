"""Shared fixtures of the HF target's tests: the target imported once, runs built and trained on demand.

Every test here runs in one xdist group: the transformers import (~7 s) and the 2-rank pool are paid
once per session, not once per worker.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from faultbench import targets

torch.set_num_threads(1)
targets.get("hf")  # sets HF_HUB_OFFLINE before transformers is imported anywhere in the session

from faultbench.targets.hf.hooks import train  # noqa: E402
from faultbench.targets.hf.recipes import RECIPES  # noqa: E402
from faultbench.targets.hf.run import build_run  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/hf/" in str(item.fspath):
            item.add_marker(pytest.mark.xdist_group("hf"))


@pytest.fixture
def trained(tmp_path):
    """``trained(recipe_name, seed=0, **recipe_overrides)``: a run of that recipe after ``trainer.train()``."""
    def make(name: str, seed: int = 0, **overrides):
        run = build_run(dataclasses.replace(RECIPES[name], **overrides), seed, tmp_path / f"{name}-{seed}")
        train(run)
        return run

    return make


@pytest.fixture(scope="session")
def fresh_model(tmp_path_factory):
    """A freshly initialized model of the fp32 recipe (eval mode, frozen) and its tokenizer."""
    run = build_run(RECIPES["fp32"], 0, tmp_path_factory.mktemp("fresh"))
    for p in run.model.parameters():
        p.requires_grad_(False)
    return run.model.eval(), run.tokenizer, run


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_gap(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)
