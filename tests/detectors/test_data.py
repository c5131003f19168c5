"""Data detectors: truncation, tokenizer and batch-id contracts on hand-broken functions; silent on the reference."""

import pytest
import torch

from faultbench.detectors.data import (
    BatchOrder,
    BatchSpecialIds,
    CorpusInvariants,
    TokenizerRoundtrip,
    corpus_violations,
    special_ids,
    tokenizer_violations,
    truncate_violations,
)
from faultbench.model.data import collate, truncate
from faultbench.model.run import build_run
from tests.detectors.helpers import context


@pytest.fixture(scope="module")
def run(tiny_cfg):
    return build_run(tiny_cfg.replace(train={"steps": 2, "warmup_steps": 0}))


WORDS = list(range(10, 200))


def test_reference_truncate_keeps_its_contract():
    assert truncate_violations(truncate, 64, 1, 2, WORDS) == []
    assert truncate_violations(truncate, 8, 1, 2, WORDS) == []


def test_truncate_contract_flags_a_kept_suffix_and_one_short():
    def keeps_suffix(ids, max_len, eos_id):
        return ids if len(ids) <= max_len else ids[-max_len:]

    def one_short(ids, max_len, eos_id):
        return ids if len(ids) <= max_len else ids[: max_len - 2] + [eos_id]

    assert truncate_violations(keeps_suffix, 64, 1, 2, WORDS)
    assert any("returned 63 ids" in p for p in truncate_violations(one_short, 64, 1, 2, WORDS))


def test_reference_corpus_and_tokenizer_are_clean(run):
    tok = run.tokenizer
    assert corpus_violations(run.corpus.val, special_ids(tok), 64, 256, "val")["counts"] == {}
    texts = [tok.decode(d) for d in run.corpus.train[:20]]
    assert tokenizer_violations(tok, texts) == {}
    for det in (CorpusInvariants(), TokenizerRoundtrip()):
        det.on_start(context(run))
        assert not det.findings, det.findings


class NoEosBatch:
    """The run's tokenizer, except that encode_batch drops each text's EOS."""

    def __init__(self, tok):
        self._tok = tok
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id
        self.vocab_size = tok.vocab_size

    def encode(self, text):
        return self._tok.encode(text)

    def encode_batch(self, texts):
        return [e[:-1] for e in self._tok.encode_batch(texts)]

    def decode(self, ids):
        return self._tok.decode(ids)


def test_tokenizer_contract_blames_encode_batch(run):
    tok = NoEosBatch(run.tokenizer)
    texts = [tok.decode(d) for d in run.corpus.train[:10]]
    assert "model.tokenizer.Tokenizer.encode_batch" in tokenizer_violations(tok, texts)


def test_wrong_pad_id_is_blamed_on_the_caller(run):
    docs = [list(d) for d in run.corpus.train[:8]]
    batch = collate(docs, run.tokenizer.eos_id, "right")  # the caller passes EOS as the pad id
    det = BatchSpecialIds()
    det.on_batch(context(run), [batch])
    assert [(f.subsystem, f.seam) for f in det.findings] == [("data", "model.train.next_micro_batches")]
    clean = BatchSpecialIds()
    clean.on_batch(context(run), [collate(docs, run.tokenizer.pad_id, "right")])
    assert not clean.findings


def _micro(rows) -> dict:
    ids = torch.tensor(rows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_batch_order_finds_a_replayed_micro_batch_and_tells_a_resume_from_an_epoch(run):
    """A micro-batch drawn again exactly: on the resumed run's first step it is the resume position; later, the
    epoch's permutation. Distinct batches (the same documents in another order included) are silent."""
    a, b = [[1, 5, 6, 2], [1, 7, 2, 0]], [[1, 8, 9, 2], [1, 10, 2, 0]]
    det, ctx = BatchOrder(), context(run)
    for step, batches in enumerate(([a], [b], [a[::-1]])):
        run.step = step
        det.on_batch(ctx, [_micro(x) for x in batches])
    assert det.findings == []
    run.step = 3
    det.on_batch(ctx, [_micro(b)])
    assert [(f.subsystem, f.seam) for f in det.findings] == [("data", "model.sampler.ResumableSampler.next_indices")]
    resumed, resumed_ctx = BatchOrder(), context(run)
    run.step = 0
    resumed.on_batch(resumed_ctx, [_micro(a)])
    run.step = 1
    resumed.on_checkpoint_load(resumed_ctx, "checkpoint")
    resumed.on_batch(resumed_ctx, [_micro(a)])
    assert [(f.subsystem, f.seam) for f in resumed.findings] == [("checkpoint", "model.checkpoint.load_checkpoint")]
