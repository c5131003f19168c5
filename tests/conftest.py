"""Shared fixtures for the reference-stack tests.

Single-threaded torch (the suite runs under pytest-xdist on a 2-core machine; more threads per
worker only oversubscribe). Expensive objects (the corpus, a briefly trained model) are built once
per worker and treated as read-only by the tests that share them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # plain `pytest` (not `python -m pytest`) does not add the repo root
    sys.path.insert(0, str(ROOT))

if os.environ.get("FAULTBENCH_STUB_DETECTOR"):  # one detector made a no-op: tests/detector_stub/ (mutation test)
    sys.path.insert(0, str(ROOT / "tests" / "detector_stub"))
    import faultbench_detector_stub  # noqa: E402

    faultbench_detector_stub.activate()

from faultbench.model.config import RunConfig, get_preset  # noqa: E402
from faultbench.model.data import Corpus, load_corpus  # noqa: E402
from faultbench.model.gpt import GPT  # noqa: E402
from faultbench.model.run import build_run  # noqa: E402
from faultbench.model.train import train  # noqa: E402

# Steps of the shared "briefly trained" model: enough that attention and greedy decoding are not
# trivial, cheap (~1.3 s). Measured: after 100 steps, greedy continuations of 4-token prompts of the
# long documents have 8-12 distinct tokens in 20 and no EOS; after 60 steps half of them hit EOS
# within 1-6 tokens and then repeat it.
TRAINED_STEPS = 100


@pytest.fixture(scope="session")
def rank_pool():
    """The worker's 2-rank pool (a forkserver and two ranks: seconds to start). Its users carry
    ``xdist_group("rank_pool")`` so that one worker starts it once."""
    from faultbench.harness.launch import RankPool

    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def tiny_cfg() -> RunConfig:
    return get_preset("tiny")


@pytest.fixture(scope="session")
def corpus(tiny_cfg) -> Corpus:
    return load_corpus(tiny_cfg.data)


@pytest.fixture(scope="session")
def pad_id(corpus) -> int:
    return corpus.tokenizer.pad_id


@pytest.fixture(scope="session")
def trained_model(tiny_cfg) -> GPT:
    """The tiny model after TRAINED_STEPS steps, in eval mode with frozen parameters.

    Shared by every test of a worker: parameters are frozen so no test can train it by accident.
    """
    run = build_run(tiny_cfg.replace(train={"steps": TRAINED_STEPS}, seed=0))
    train(run)
    model = run.model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.fixture
def eval_model(trained_model) -> GPT:
    """The shared trained model, checked to still be in eval mode for every test."""
    trained_model.eval()
    yield trained_model
    assert not trained_model.training, "a test left the shared model in train mode"


@pytest.fixture(scope="session")
def long_docs(corpus) -> list[tuple[int, ...]]:
    """Train documents cut to the full seq_len (the rare long documents), for long-context checks."""
    seq_len = max(len(d) for d in corpus.train)
    docs = [d for d in corpus.train if len(d) == seq_len]
    assert len(docs) >= 8, "expected some truncated long documents in the tiny corpus"
    return docs
