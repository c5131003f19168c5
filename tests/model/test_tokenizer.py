"""Tokenizer and example construction: round trip, special ids, padding id, vocab fit, truncation."""

from __future__ import annotations

import pytest

import faultbench.model.tokenizer as tokenizer_module
from faultbench.model.config import DataConfig
from faultbench.model.corpus import MarkovSource
from faultbench.model.data import collate, load_corpus, truncate
from faultbench.model.run import build_run
from faultbench.model.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer
from faultbench.model.train import next_micro_batches


@pytest.fixture(scope="module")
def texts(tiny_cfg) -> list[str]:
    # fresh documents from the same source (seed 7, not the corpus seed): mostly unseen text
    return MarkovSource.from_config(tiny_cfg.data).sample(200, seed=7)


@pytest.fixture(scope="module")
def tok(corpus) -> Tokenizer:
    return corpus.tokenizer


def test_round_trip(tok, texts):
    for text in texts:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.unk_id not in ids  # every byte of corpus text is in the alphabet
        assert tok.decode(ids) == text


def test_encode_batch_equals_encode(tok, texts):
    assert tok.encode_batch(texts[:50]) == [tok.encode(t) for t in texts[:50]]


def test_special_ids_are_distinct_and_fixed(tok):
    specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id]
    assert specials == [0, 1, 2, 3]  # fixed by SPECIAL_TOKENS order
    assert len(set(specials)) == len(SPECIAL_TOKENS)


def test_special_ids_never_appear_inside_documents(corpus, tok):
    specials = {tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}
    for doc in corpus.train[:3000] + corpus.val:
        assert not specials & set(doc[1:-1])


def test_json_round_trip_preserves_identity(tok, texts):
    again = Tokenizer.from_json(tok.to_json())
    assert again.sha256 == tok.sha256
    assert [again.encode(t) for t in texts[:20]] == [tok.encode(t) for t in texts[:20]]


def test_training_is_deterministic(texts):
    a = train_tokenizer(texts, 256)
    b = train_tokenizer(texts, 256)
    assert a.to_json() == b.to_json()
    assert a.sha256 == b.sha256


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_collate_uses_the_given_pad_id(corpus, pad_side):
    docs = list(corpus.val[:6])
    batch = collate(docs, 99, pad_side)
    pads = batch["attention_mask"] == 0
    assert pads.any()
    assert (batch["input_ids"][pads] == 99).all()


def test_training_batches_pad_with_the_tokenizers_pad_id(tiny_cfg):
    run = build_run(tiny_cfg.replace(seed=0))
    batch = next_micro_batches(run)[0]
    pads = batch["attention_mask"] == 0
    assert pads.any()
    assert (batch["input_ids"][pads] == run.tokenizer.pad_id).all()
    assert (batch["input_ids"][~pads] != run.tokenizer.pad_id).all()


def test_model_embedding_covers_the_vocabulary(tiny_cfg, corpus, tok):
    run = build_run(tiny_cfg)
    assert run.model.wte.num_embeddings >= tok.vocab_size
    assert run.model.lm_head.out_features >= tok.vocab_size
    assert max(max(d) for d in corpus.train) < tok.vocab_size


@pytest.mark.parametrize(
    ("length", "max_len"), [(3, 10), (10, 10), (11, 10), (100, 10), (5, 3)],
    ids=["short", "exact", "one-over", "long", "minimal"],
)
def test_truncate_keeps_eos(length, max_len):
    eos = 2
    ids = [1, *range(10, 10 + length - 2), eos]
    out = truncate(ids, max_len, eos)
    assert len(out) == min(length, max_len)
    assert out[-1] == eos and out[0] == 1
    assert out[:-1] == ids[: len(out) - 1]  # a prefix of the document, then EOS


def test_corpus_documents_are_well_formed(tiny_cfg, corpus, tok):
    seq_len = tiny_cfg.data.seq_len
    for split in (corpus.train, corpus.val):
        for doc in split:
            assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
            assert 3 <= len(doc) <= seq_len
    # truncation really happened (long documents exist), so the EOS check above covers it
    assert corpus.truncated_fraction > 0
    assert sum(len(d) == seq_len for d in corpus.train) > 0


def test_tokenizer_does_not_depend_on_what_was_cached_before(monkeypatch, tmp_path):
    # Isolated caches (cache_dir itself is replaced, so the shared cache is never written). A corpus's
    # tokenizer must be the same whether or not another config's corpus was loaded first. Regression
    # guard: the cache was once keyed by the Markov source alone, so num_docs=300 and num_docs=600
    # (different training texts) shared one cache file and the second load got the first's tokenizer.
    small, large = DataConfig(num_docs=300), DataConfig(num_docs=600)
    uncached_load = load_corpus.__wrapped__  # bypass the in-process lru_cache
    monkeypatch.setattr(tokenizer_module, "cache_dir", lambda: tmp_path / "alone")
    alone = uncached_load(large).tokenizer.sha256
    monkeypatch.setattr(tokenizer_module, "cache_dir", lambda: tmp_path / "after-small")
    uncached_load(small)
    after_small = uncached_load(large).tokenizer.sha256
    assert after_small == alone
