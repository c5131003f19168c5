"""Collate detectors: the run's collate role probed with crafted documents against its contract.

The contract (the collate role of ``detectors.api.ROLES`` and the data conventions): a dict of (B, T) int64
tensors with T at least the longest document (padding to a fixed length is a legitimate design);
``input_ids`` hold each document, in order, at the padding side's edge and ``pad_id`` elsewhere;
``attention_mask`` is 1 exactly on real tokens (also when nothing is padded);
``labels`` equal the input ids on real tokens after BOS and carry one ignore value, outside the
vocabulary, on every pad and on BOS (or BOS's own id: a shifted loss never scores a row's first label from a real
position); ``position_ids``, where the stack collates them, count 0, 1, ... from
each row's first real token.
The probe runs at start on a padded batch and an unpadded one, with both padding sides, so the bugs
that show only on the rare unpadded batch or only under left padding are found before step 0.
"""

from __future__ import annotations

import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, register

KEYS = ("input_ids", "attention_mask", "labels")  # and position_ids, where the stack collates them


def crafted_batches(bos: int, eos: int, words: list[int]) -> dict[str, list[list[int]]]:
    """Document batches of the shapes collate must handle: mixed lengths, all the same length, one doc."""
    def doc(n: int, offset: int) -> list[int]:
        return [bos, *(words[(offset + k) % len(words)] for k in range(n - 2)), eos]

    return {
        "mixed lengths": [doc(5, 0), doc(9, 3), doc(3, 7), doc(12, 11)],
        "unpadded": [doc(6, 2), doc(6, 5), doc(6, 13)],
        "single": [doc(4, 17)],
    }


def collate_violations(collate, docs: list[list[int]], pad_id: int, side: str, vocab: int,
                       ignore_default: int | None = None) -> dict[str, list[str]]:
    """Contract violations of ``collate(docs, pad_id, side)``, grouped by what they concern
    (call, structure, width, input_ids, mask, labels, positions)."""
    out: dict[str, list[str]] = {}

    def add(kind: str, message: str) -> None:
        if len(out.setdefault(kind, [])) < 3:
            out[kind].append(message)

    try:
        batch = collate([list(d) for d in docs], pad_id, side)
    except Exception as exc:  # noqa: BLE001 - raising on a valid batch is itself a violation
        add("call", f"raised {type(exc).__name__}: {exc}")
        return out
    if not isinstance(batch, dict):
        add("structure", f"returned {type(batch).__name__}, not a dict")
        return out
    B, T = len(docs), max(len(d) for d in docs)
    tensors = {}
    for key in (*KEYS, *(("position_ids",) if "position_ids" in batch else ())):
        value = batch.get(key)
        if not isinstance(value, torch.Tensor):
            add("mask" if key == "attention_mask" else "structure",
                f"{key} is {type(value).__name__ if key in batch else 'missing'}, not a tensor")
            continue
        if value.dtype != torch.int64:
            add("mask" if key == "attention_mask" else "structure", f"{key} has dtype {value.dtype}, not int64")
        if value.dim() != 2 or value.shape[0] != B:
            add("structure", f"{key} has shape {tuple(value.shape)}, expected ({B}, {T})")
            continue
        tensors[key] = value.detach().cpu()
    widths = {tuple(v.shape) for v in tensors.values()}
    if len(widths) > 1:
        add("structure", f"the tensors disagree on their shape: {sorted(widths)}")
        return out
    if not widths:
        return out
    width = widths.pop()[1]
    if width < T:
        add("width", f"padded to T={width}, shorter than the longest document ({T}): tokens are lost")
        return out
    ignore_values: set[int] = set()
    for row, ids in enumerate(docs):
        n = len(ids)
        start = 0 if side == "right" else width - n
        real = torch.zeros(width, dtype=torch.bool)
        real[start : start + n] = True
        doc = torch.tensor(ids, dtype=torch.long)
        if "input_ids" in tensors:
            got = tensors["input_ids"][row]
            if not torch.equal(got[real], doc):
                add("input_ids", f"{side}-padded row {row}: the document is not at columns {start}..{start + n - 1}")
            elif bool((got[~real] != pad_id).any()):
                add("input_ids", f"{side}-padded row {row}: pads are {sorted(set(got[~real].tolist()))}, "
                    f"not pad_id {pad_id}")
        if "attention_mask" in tensors:
            m = tensors["attention_mask"][row].long()
            if not torch.equal(m, real.long()):
                add("mask", f"{side}-padded row {row}: attention_mask {m.tolist()} is not 1 exactly on the "
                    f"{n} real tokens")
        if "labels" in tensors:
            lab = tensors["labels"][row]
            if not torch.equal(lab[start + 1 : start + n], doc[1:]):
                add("labels", f"{side}-padded row {row}: labels on the real tokens after BOS are not the input ids "
                    f"(labels {lab.tolist()}, document at columns {start}..{start + n - 1})")
            ignore_values |= set(lab[~real].tolist())
            if int(lab[start]) != ids[0]:  # BOS is never a target: ignored, or (a stack's choice) itself
                ignore_values.add(int(lab[start]))
        if "position_ids" in tensors:
            pos = tensors["position_ids"][row][start : start + n]
            if not torch.equal(pos, torch.arange(n)):
                add("positions", f"{side}-padded row {row}: position ids of the real tokens are {pos.tolist()}, "
                    f"not 0..{n - 1}")
    if len(ignore_values) > 1:
        add("labels", f"BOS and pads carry different label values {sorted(ignore_values)}: not one ignore value")
    elif ignore_values:
        value = ignore_values.pop()
        if 0 <= value < vocab:
            add("labels", f"the label on BOS/pads is {value}, a real token id, so they are trained on")
        elif ignore_default is not None and value != ignore_default:
            add("labels", f"the label on BOS/pads is {value}, not collate's ignore_index {ignore_default}")
    return out


@register
class CollateContract(Detector):
    id = "collate_contract"
    needs_facts = ("pad_id", "bos_id", "eos_id", "unk_id", "vocab_size", "pad_side")
    needs_roles = ("collate",)
    family = "collate"
    passive = False
    description = ("the run's collate on crafted documents (mixed lengths, unpadded, single; both pad sides): "
                   "(B, T) int64, T >= longest, mask 1 on real tokens, labels aligned with ignore on BOS/pads, "
                   "positions 0..n-1")

    def on_start(self, ctx) -> None:
        pad, bos, eos, vocab, pad_side = (ctx.fact(f) for f in ("pad_id", "bos_id", "eos_id", "vocab_size",
                                                                 "pad_side"))
        specials = {pad, bos, eos, ctx.fact("unk_id")}
        words = [i for i in range(4, vocab) if i not in specials][:40]
        collate = ctx.role("collate")
        ignore_default = probes.default_ignore_index(collate)
        problems: dict[str, list[str]] = {}
        cases = []
        sides = [pad_side] + [s for s in ("right", "left") if s != pad_side]
        with ctx.probe():
            for side in sides:
                for name, docs in crafted_batches(bos, eos, words).items():
                    found = collate_violations(collate, docs, pad, side, vocab, ignore_default)
                    for kind, messages in found.items():
                        if kind not in problems:
                            cases.append(f"{name}/{side}")
                        if len(problems.setdefault(kind, [])) < 6:  # the first message of each failing case
                            problems[kind].append(f"[{name}, {side}] {messages[0]}")
            position_fault = self._positions_seam_at_fault(ctx, problems)
        if position_fault:
            self.report(ctx, "position", ctx.role_seam("position_ids"),
                        "collate's position ids are wrong and position_ids_from_mask gives the same wrong ids on a "
                        f"correct mask: {position_fault}", {"problems": problems}, confidence=0.8)
            problems.pop("positions")
        if not problems:
            return
        order = ("call", "structure", "mask", "width", "labels", "input_ids", "positions")
        kinds = [k for k in order if k in problems]
        first = problems[kinds[0]][0]
        seam, cause = ctx.role_seam("collate"), ""
        if set(kinds) & {"mask", "input_ids"} and (padding := self._padding_problem(ctx, bos, eos, words, pad)):
            seam, cause = ctx.role_seam("pad"), f"; its padding step alone: {padding}"
        elif "labels" in kinds and pad == eos and "encode" in ctx.roles:
            seam, cause = ctx.role_seam("encode"), (f"; the tokenizer's pad id is its EOS id ({eos}): labels ignored "
                                                    "on pads are ignored on every EOS too")
        self.report(ctx, "collate", seam, f"collate breaks its contract ({', '.join(kinds)}): {first}{cause}",
                    {"problems": problems, "config_pad_side": pad_side, "first_cases": cases[:4]},
                    confidence=0.9)

    @staticmethod
    def _padding_problem(ctx, bos: int, eos: int, words: list[int], pad: int) -> str | None:
        """Where the run offers collate's padding step as a role: its first violation on the crafted documents."""
        if "pad" not in ctx.roles:
            return None
        for side in ("right", "left"):
            for docs in crafted_batches(bos, eos, words).values():
                found = collate_violations(lambda d, p, s: {**ctx.role("pad")(d, p, s), "labels": None}, docs, pad,
                                           side, vocab=1 << 30)
                found = {k: v for k, v in found.items() if k in ("call", "width", "input_ids", "mask")}
                if found:
                    return next(iter(found.values()))[0]
        return None

    @staticmethod
    def _positions_seam_at_fault(ctx, problems) -> str | None:
        """If only the positions are wrong: does position_ids_from_mask itself miscount on a correct mask?"""
        if set(problems) != {"positions"} or "position_ids" not in ctx.roles:
            return None
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        expected = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]])
        try:
            got = ctx.role("position_ids")(mask).cpu()
            real = torch.stack([got[0, :4], got[1, 2:], got[2, :4]])
        except Exception as exc:  # noqa: BLE001
            return f"it raised {type(exc).__name__}: {exc}"
        return None if torch.equal(real, expected) else f"position_ids_from_mask({mask.tolist()}) = {got.tolist()}"
