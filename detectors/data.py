"""Data detectors: the tokenized corpus, the tokenizer, truncation and the ids of the real batches.

Contracts checked (from the reference's documented conventions, reached only through the run):
- every example is one document ``[bos, ..., eos]`` of at most ``data.seq_len`` ids, all inside the
  model's vocabulary, with no special id inside it;
- ``truncate(ids, max_len, eos)`` returns short lists unchanged and cuts long ones to exactly
  ``max_len`` ids ending with EOS (the prefix kept);
- the tokenizer's ``encode`` wraps a text as ``[bos, ..., eos]``, ``encode_batch`` agrees with it,
  ``decode`` inverts it, and its special ids are distinct;
- the real batches are padded with ``tokenizer.pad_id`` and hold only ids the embedding has.

Localization is differential: a corpus that breaks the example convention is blamed on the seam whose
probe fails (truncate, encode_batch, encode), and a batch padded with a wrong id is blamed on collate
only if collate, given the tokenizer's pad id, pads wrongly too; otherwise on its caller.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, NotApplicable, register
from faultbench.detectors.blackbox.batches import batch_hash, row_hashes

ENCODE = "model.tokenizer.Tokenizer.encode"
ENCODE_BATCH = "model.tokenizer.Tokenizer.encode_batch"
DECODE = "model.tokenizer.Tokenizer.decode"

def special_ids(tok) -> dict[str, int]:
    return {"pad": tok.pad_id, "bos": tok.bos_id, "eos": tok.eos_id, "unk": tok.unk_id}


def ordinary_ids(specials, vocab: int, count: int, offset: int = 0) -> list[int]:
    """``count`` ids that are not special tokens (``specials``: their ids), cycling deterministically through the
    vocabulary."""
    specials = set(specials)
    pool = [i for i in range(vocab) if i not in specials]
    return [pool[(offset + 7 * k) % len(pool)] for k in range(count)]


# ----------------------------------------------------------------------------------------------
# corpus, truncation and tokenizer contracts (pure functions, unit-testable)


def corpus_violations(docs, specials: dict[str, int], seq_len: int, vocab: int, split: str) -> dict:
    """Counts (and a few examples) of documents that break the ``[bos, ..., eos]``, <= seq_len convention
    (``specials``: the pad, bos and eos ids).

    Vectorized over the concatenated split (tens of thousands of documents cost a few milliseconds)."""
    bos, eos, pad = specials["bos"], specials["eos"], specials["pad"]
    lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    nonempty = lengths > 0
    flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64, count=int(lengths.sum()))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first = np.full(len(docs), -1, dtype=np.int64)
    last = np.full(len(docs), -1, dtype=np.int64)
    first[nonempty], last[nonempty] = flat[starts[nonempty]], flat[ends[nonempty] - 1]
    doc_of = np.repeat(np.arange(len(docs)), lengths)  # the document of every token

    def per_doc(token_flags: np.ndarray) -> np.ndarray:
        return np.bincount(doc_of[token_flags], minlength=len(docs)) > 0

    bos_count = np.bincount(doc_of[flat == bos], minlength=len(docs))
    eos_count = np.bincount(doc_of[flat == eos], minlength=len(docs))
    flags = {
        "no_bos": first != bos,
        "no_eos": last != eos,
        "too_long": lengths > seq_len,
        "out_of_vocab": per_doc((flat < 0) | (flat >= vocab)),
        "pad_inside": per_doc(flat == pad),
        "special_inside": (bos_count > (first == bos)) | (eos_count > (last == eos)),
    }
    counts, examples = {}, {}
    for kind, bad in flags.items():
        where = np.flatnonzero(bad)
        if where.size:
            counts[kind] = int(where.size)
            examples[kind] = [{"split": split, "index": int(i), "len": int(lengths[i]), "head": list(docs[i][:6]),
                               "tail": list(docs[i][-4:])} for i in where[:2]]
    return {"counts": counts, "examples": examples, "docs": len(docs)}


def truncate_violations(truncate, max_len: int, bos: int, eos: int, words: list[int]) -> list[str]:
    """Problems of ``truncate`` against its contract on document-like lists around ``max_len``."""
    problems = []
    for n in sorted({max(3, max_len - 1), max_len, max_len + 1, max_len + 2, 2 * max_len}):
        ids = [bos, *(words[k % len(words)] for k in range(n - 2)), eos]
        try:
            out = list(truncate(list(ids), max_len, eos))
        except Exception as exc:  # noqa: BLE001 - raising is itself a contract violation
            problems.append(f"truncate(len {n}, max_len {max_len}) raised {type(exc).__name__}: {exc}")
            continue
        if n <= max_len:
            if out != ids:
                problems.append(f"truncate changed a document of {n} <= max_len {max_len} ids (now {len(out)})")
            continue
        if len(out) != max_len:
            problems.append(f"truncate(len {n}, max_len {max_len}) returned {len(out)} ids, expected {max_len}")
        if not out or out[-1] != eos:
            problems.append(f"truncate(len {n}, max_len {max_len}) does not end with EOS {eos} "
                            f"(last id {out[-1] if out else None})")
        elif out[:-1] != ids[: max_len - 1]:
            problems.append(f"truncate(len {n}, max_len {max_len}) does not keep the document's prefix")
    return problems


def sample_texts(ctx, count: int = 32) -> list[str]:
    """Texts of untruncated training documents (decoded with the run's tokenizer), deterministic."""
    tok, seq_len = ctx.run.tokenizer, ctx.config.data.seq_len
    texts: list[str] = []
    seen: set[str] = set()
    for doc in ctx.run.corpus.train[:4000]:
        if 3 <= len(doc) < seq_len:
            text = tok.decode(doc)
            if text and text not in seen:
                seen.add(text)
                texts.append(text)
                if len(texts) >= count:
                    break
    return texts


def tokenizer_violations(tok, texts: list[str]) -> dict[str, list[str]]:
    """Problems per seam (encode, encode_batch, decode, specials) of the tokenizer on ``texts``."""
    out: dict[str, list[str]] = {}

    def add(seam: str, message: str) -> None:
        if len(out.setdefault(seam, [])) < 4:
            out[seam].append(message)

    ids = special_ids(tok)
    if len(set(ids.values())) != len(ids):
        add("specials", f"special ids are not distinct: {ids}")
    if any(not 0 <= v < tok.vocab_size for v in ids.values()):
        add("specials", f"special ids outside the vocabulary of {tok.vocab_size}: {ids}")
    if not texts:
        return out
    singles = [list(tok.encode(t)) for t in texts]
    encode_ok = True
    for text, e in zip(texts, singles, strict=True):
        if len(e) < 2 or e[0] != tok.bos_id or e[-1] != tok.eos_id:
            encode_ok = False
            add(ENCODE, f"encode({text[:30]!r}) is not wrapped as [bos, ..., eos]: head {e[:3]}, tail {e[-2:]}")
        elif any(i in (tok.bos_id, tok.eos_id, tok.pad_id) for i in e[1:-1]):
            encode_ok = False
            add(ENCODE, f"encode({text[:30]!r}) has a special id inside the document")
    batch = [list(e) for e in tok.encode_batch(list(texts))]
    if len(batch) != len(texts):
        add(ENCODE_BATCH, f"encode_batch returned {len(batch)} documents for {len(texts)} texts")
    else:
        for text, e, b in zip(texts, singles, batch, strict=True):
            if b != e:
                wrapped = len(b) >= 2 and b[0] == tok.bos_id and b[-1] == tok.eos_id
                add(ENCODE_BATCH if encode_ok or not wrapped else ENCODE,
                    f"encode_batch and encode disagree on {text[:30]!r}: head {b[:3]} vs {e[:3]}, "
                    f"tail {b[-2:]} vs {e[-2:]}")
        lone = [list(tok.encode_batch([t])[0]) for t in texts[:4]]
        if lone != batch[:4]:
            add(ENCODE_BATCH, "encode_batch gives a text different ids alone and within a batch")
    for text, e in zip(texts, singles, strict=True):
        back = tok.decode(e)
        if back != text:
            add(DECODE, f"decode(encode(text)) != text: {text[:30]!r} -> {back[:30]!r}")
    return out


def _tokenizer_finding(problems: dict[str, list[str]]) -> tuple[str, str, float] | None:
    """(seam, message, confidence) of the most specific tokenizer problem, or None."""
    for seam, conf in ((ENCODE_BATCH, 0.9), (ENCODE, 0.9), (DECODE, 0.7)):
        if seam in problems:
            return seam, "; ".join(problems[seam]), conf
    if "specials" in problems:
        return "model.tokenizer.train_tokenizer", "; ".join(problems["specials"]), 0.7
    return None


@register
class CorpusInvariants(Detector):
    id = "corpus_invariants"
    needs_facts = ("train_docs", "val_docs", "pad_id", "bos_id", "eos_id", "unk_id", "seq_len", "vocab_size")
    family = "data"
    passive = False
    description = ("every train/val example is [bos, ..., eos], <= seq_len, in the model's vocabulary; localized "
                   "by probing truncate's and the tokenizer's contracts")

    def on_start(self, ctx) -> None:
        seq_len, vocab = ctx.fact("seq_len"), ctx.fact("vocab_size")
        specials = {k: ctx.fact(f"{k}_id") for k in ("pad", "bos", "eos", "unk")}
        found = {}
        for split in ("train", "val"):
            v = corpus_violations(ctx.fact(f"{split}_docs"), specials, seq_len, vocab, split)
            if v["counts"]:
                found[split] = v
        with ctx.probe():
            trunc = []
            if "truncate" in ctx.roles:
                words = ordinary_ids(specials.values(), vocab, 2 * seq_len + 4)
                for max_len in dict.fromkeys((seq_len, 8)):
                    trunc += truncate_violations(ctx.role("truncate"), max_len, specials["bos"], specials["eos"],
                                                 words)
            tok_problems = self._tokenizer_problems(ctx) if found else {}
        evidence = {split: v for split, v in found.items()}
        if trunc:
            self.report(ctx, "data", ctx.role_seam("truncate"), f"truncate breaks its contract: {'; '.join(trunc[:3])}",
                        {"truncate": trunc[:6], "corpus": evidence}, confidence=0.9)
        if not found:
            return
        kinds = sorted({k for v in found.values() for k in v["counts"]})
        summary = ", ".join(f"{split}: {v['counts']} of {v['docs']}" for split, v in found.items())
        tokenizer = _tokenizer_finding(tok_problems)
        if tokenizer is not None:
            seam, message, conf = tokenizer
            self.report(ctx, "data", seam, f"corpus examples break [bos, ..., eos] ({summary}); {message}",
                        {"corpus": evidence, "tokenizer": tok_problems}, confidence=conf)
        elif (wrapping := self._encode_problem(ctx, specials)) and set(kinds) & {"no_bos", "no_eos", "special_inside"}:
            self.report(ctx, "data", ctx.role_seam("encode"), f"corpus examples break [bos, ..., eos] ({summary}); "
                        f"{wrapping}", {"corpus": evidence}, confidence=0.8)
        elif not trunc or set(kinds) - {"no_eos", "too_long"}:
            checked = " although truncate and the tokenizer pass their probes" if "truncate" in ctx.roles else ""
            self.report(ctx, "data", ctx.role_seam("documents"),
                        f"corpus examples break the [bos, ..., eos] <= seq_len={seq_len} convention ({summary})"
                        f"{checked}", {"corpus": evidence}, confidence=0.6)

    # texts of any kind: what a tokenizer adds around a document does not depend on it
    ENCODE_PROBES = ("a short document", "another one, with more words in it")

    def _encode_problem(self, ctx, specials: dict[str, int]) -> str | None:
        """How the run's encode role wraps a text, where not as [bos, ..., eos] (None: it does, or no role)."""
        if "encode" not in ctx.roles:
            return None
        with ctx.probe():
            for text in self.ENCODE_PROBES:
                try:
                    ids = list(ctx.role("encode")(text))
                except Exception as exc:  # noqa: BLE001 - raising on a text breaks the contract
                    return f"the tokenizer raises on a text ({type(exc).__name__})"
                inner = set(ids[1:-1]) & {specials["bos"], specials["eos"], specials["pad"]}
                if len(ids) < 2 or ids[0] != specials["bos"] or ids[-1] != specials["eos"] or inner:
                    return (f"the tokenizer itself wraps {text!r} as head {ids[:2]}, tail {ids[-2:]} (bos "
                            f"{specials['bos']}, eos {specials['eos']})")
        return None

    def _tokenizer_problems(self, ctx) -> dict[str, list[str]]:
        """The reference tokenizer's contracts (encode, encode_batch, decode), where the run has that tokenizer."""
        try:
            self.require(ctx, run=("tokenizer.encode_batch",), seams=(ENCODE, ENCODE_BATCH, DECODE))
        except NotApplicable:
            return {}
        return tokenizer_violations(ctx.run.tokenizer, sample_texts(ctx))


@register
class TokenizerRoundtrip(Detector):
    id = "tokenizer_roundtrip"
    needs_run = ("corpus.train", "tokenizer.encode_batch", "tokenizer.pad_id", "tokenizer.bos_id",
                 "tokenizer.eos_id", "tokenizer.unk_id")
    needs_config = ("data.seq_len",)
    needs_seams = (ENCODE, ENCODE_BATCH, DECODE)
    family = "data"
    passive = False
    description = ("decode(encode(text)) == text, encode wraps [bos, ..., eos], encode_batch == encode, "
                   "specials distinct")

    def on_start(self, ctx) -> None:
        tok = ctx.run.tokenizer
        with ctx.probe():
            problems = tokenizer_violations(tok, sample_texts(ctx))
        finding = _tokenizer_finding(problems)
        if finding is not None:
            seam, message, conf = finding
            self.report(ctx, "data", seam, f"the tokenizer breaks its contract: {message}", {"problems": problems},
                        confidence=conf)


@register
class BatchSpecialIds(probes.BatchWatch):
    id = "batch_special_ids"
    family = "data"
    passive = True
    description = ("the real batches are padded with tokenizer.pad_id and hold only ids < model vocab; the run's "
                   "collate with tokenizer.pad_id decides whether collate or its caller is at fault")

    def check_batch(self, ctx, batch) -> bool:
        pad_id, vocab = ctx.fact("pad_id"), ctx.fact("vocab_size")
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        if not isinstance(ids, torch.Tensor):
            return False
        out_of_range = (ids < 0) | (ids >= vocab)
        masked = isinstance(mask, torch.Tensor) and mask.shape == ids.shape
        suspect = out_of_range | ((ids != pad_id) & (mask == 0)) if masked else out_of_range
        if not bool(suspect.any()):  # the one sync of a healthy batch
            return False
        bad_pad = None
        if masked:
            pads = ids[mask == 0]
            values = torch.unique(pads)
            if values.numel() == 1 and int(values[0]) != pad_id:  # one consistent wrong pad id
                bad_pad = int(values[0])  # (varied "pad" values mean an inverted mask: collate's problem)
        if bad_pad is None and not bool(out_of_range.any()):
            return False
        self._localize(ctx, batch, bad_pad, out_of_range, pad_id, vocab)
        return True

    def _localize(self, ctx, batch, bad_pad, out_of_range, pad_id: int, vocab: int) -> None:
        ids = batch["input_ids"]
        evidence = {"pad_id": pad_id, "batch_pad_value": bad_pad, "model_vocab": vocab,
                    "max_id": int(ids.max()), "ids_out_of_range": int(out_of_range.sum()), "shape": list(ids.shape)}
        what = (f"batch padded with id {bad_pad}, not tokenizer.pad_id {pad_id}" if bad_pad is not None
                else f"batch holds {evidence['ids_out_of_range']} ids outside [0, {vocab})")
        if bad_pad is not None and not 0 <= bad_pad < vocab:
            what += f" (id {bad_pad} is past the embedding table of {vocab} rows)"
        side = ctx.fact("pad_side")
        docs = probes.documents(batch, side)
        mask = batch.get("attention_mask")
        real_bad = bool(out_of_range[mask.bool()].any()) if isinstance(mask, torch.Tensor) else True
        if docs is None or real_bad:
            seam = ctx.role_seam("documents") if real_bad and docs is not None else None
            self.report(ctx, "data", seam, f"{what}; the offending ids sit on real tokens", evidence, confidence=0.5)
            return
        if "collate" not in ctx.roles:  # no collate of the run to tell it from its caller
            self.report(ctx, "collate", None, what, evidence, confidence=0.4)
            return

        def pads_right(ref: dict) -> bool:
            ref_ids, ref_mask = ref["input_ids"], ref["attention_mask"].bool()
            return bool((ref_ids[~ref_mask] == pad_id).all()) and bool((ref_ids < vocab).all())

        collate_ok, error = probes.recollate(ctx, docs, side, pads_right)
        if error is not None:
            collate_ok, evidence["collate_error"] = False, error
        evidence["collate_with_pad_id_ok"] = collate_ok
        if collate_ok:
            self.report(ctx, "data", ctx.role_seam("batches"),
                        f"{what}; the run's collate called with tokenizer.pad_id pads correctly, so its caller "
                        "passed the wrong pad id", evidence, confidence=0.8)
        else:
            self.report(ctx, "collate", ctx.role_seam("collate"),
                        f"{what}; the run's collate pads wrongly even when given tokenizer.pad_id", evidence,
                        confidence=0.8)


@register
class BatchOrder(Detector):
    id = "batch_order"
    needs_roles = ("batches",)
    family = "data"
    passive = True
    description = ("no training micro-batch repeats an earlier one exactly: a shuffled loader draws each example once "
                   "per epoch and a new permutation every epoch, and a resume continues where the saved run stopped")

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[int, int] = {}  # micro-batch fingerprint -> the step that drew it
        self._loaded_at: int | None = None

    def on_checkpoint_load(self, ctx, path) -> None:
        self._loaded_at = ctx.step

    def on_batch(self, ctx, micro_batches) -> None:
        if self.findings:
            return
        for batch in micro_batches:
            ids, mask = batch.get("input_ids"), batch.get("attention_mask")
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
                return
            key = batch_hash(row_hashes(ids, mask if isinstance(mask, torch.Tensor) else None))
            first = self._seen.setdefault(key, ctx.step)
            if first != ctx.step:
                self._report_replay(ctx, first)
                return

    def _report_replay(self, ctx, first: int) -> None:
        evidence = {"step": ctx.step, "first_drawn_at": first, "resumed_at": self._loaded_at}
        if ctx.step == self._loaded_at and first < ctx.step:  # the resumed run's first step replays
            seam, why = ctx.role_seam("restore_position"), (
                f"the resumed run (from step {self._loaded_at}) draws a micro-batch the saved run drew at step "
                f"{first}: the loader did not resume where it stopped")
        else:
            seam, why = ctx.role_seam("epoch_order"), (
                f"step {ctx.step} draws exactly the micro-batch of step {first}: the loader replays an earlier order "
                "(a new epoch must draw a new permutation)")
        self.report(ctx, ctx.seams.get(seam, "data"), seam, why, evidence, confidence=0.5)
