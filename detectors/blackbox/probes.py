"""Behavioural probes of the causal-LM contract, on any model a ``CausalLM`` wraps, with variants crafted
from one of the user's own batches (its shape, its tokens, its pad id): causality, padding invariance, cache
consistency (the model's own generate), position-shift invariance, a repeated token under relative positions
(attention weights form a distribution), determinism in eval mode, row isolation (a row among two sets of other rows),
every declared layer run once per forward, the output contract (logits, not probabilities; a sane scale before
training), and label alignment of the loop's loss.

``ProbeRound`` runs them all on one row of the loop's batch in a few shared forwards (the variants are rows of
one batch), before the loop's first optimizer step. Each probe returns None when the property holds, a
``ProbeResult`` when it breaks, and raises ``NotApplicable`` when the model does not take the call the probe needs.
Localization (only once a property breaks): forward hooks on every submodule record the two runs being compared;
the culprit is the FIRST module (completion order) whose residual-stream output (a float output shaped like one
of its float inputs) moves while those inputs do not: the module where the difference is born, not one that
merely carries it (an ``o_proj`` fed by a leaking attention, the block around it). Failing that, the first module
whose output moves at all.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from faultbench.detectors.api import NotApplicable, register, traceless
from faultbench.detectors.blackbox.api import BlackBoxDetector, cuda_devices
from faultbench.detectors.blackbox.batches import shown_pad_id
from faultbench.detectors.blackbox.lm import CausalLM

ROWS, LENGTH, MIN_LEN = 1, 12, 8  # a round probes one row of the loop's batch: up to 12 real tokens, at least 8
PAD_LEN = 3  # pads added on each side in the padding probe
SHIFT = 3  # positions added in the position-shift probe
PROMPT_LEN, NEW_TOKENS = 8, 2  # the cache probe's prompt (real tokens) and the tokens generate decodes
GEN_TOKENS = 4  # the generation probe's new tokens (past the first decode step, where a stale step shows)
GEN_SEED = 1234  # the generation probe's torch seed (a generate that samples draws the same twice)
ARGMAX_MARGIN = 0.01  # a greedy token this far (a fraction of the logits' range) below the best one was not picked
SCALE_FACTOR = 2.0  # a next-token loss over this many times ln V before training: logits far too large
COARSE = 1e-3  # a round's tolerance above this: its forwards ran in bf16 / fp16


@dataclass(frozen=True)
class ProbeResult:
    """A broken property: the measured ``gap`` (relative logit change, or loss ratio), the module path (or
    "loss") where it breaks, the subsystem it points at, and the evidence."""

    probe: str
    gap: float
    where: str | None
    subsystem: str
    message: str
    evidence: dict = field(default_factory=dict)


def relative_gap(a: torch.Tensor, b: torch.Tensor, floor: float = 1.0) -> float:
    """max |a - b| relative to a's scale (at least ``floor``); inf when only one side is non-finite."""
    if a.numel() == 0:
        return 0.0
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return 0.0 if torch.equal(torch.isfinite(a), torch.isfinite(b)) else math.inf
    return float((a - b).abs().max() / max(floor, float(a.abs().max())))


# ---- tracing: what every submodule took and gave during one forward ----

@dataclass
class _Call:
    name: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in nested tuples / lists / dicts (HF outputs are dicts), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj.detach()]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    return []


@contextlib.contextmanager
def traced(model: torch.nn.Module, copies: bool = False):
    """Yields the list of ``_Call``s of every submodule's forward (completion order) while the block runs;
    ``copies``: the outputs as they were returned (a later in-place change to them is not recorded)."""
    calls: list[_Call] = []

    def record(name, module, args, kwargs, output):
        outputs = _tensors(output)
        calls.append(_Call(name, _tensors((args, kwargs)), [t.clone() for t in outputs] if copies else outputs))

    handles = [m.register_forward_hook(functools.partial(record, name), with_kwargs=True)
               for name, m in model.named_modules() if name]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


Region = Callable[[torch.Tensor], "torch.Tensor | None"]


def _pairs_gap(xs, ys, region_a: Region, region_b: Region) -> float:
    gaps = [0.0]
    for x, y in zip(xs, ys, strict=False):  # a module may return more tensors in one run (a cache)
        ra, rb = region_a(x), region_b(y)
        if ra is not None and rb is not None and ra.shape == rb.shape:
            # a module's own scale: a small attention output moves little in absolute terms
            gaps.append(relative_gap(ra, rb, 1e-6) if ra.is_floating_point() else float(not torch.equal(ra, rb)))
    return max(gaps)


def _stream(call: _Call) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The call's float outputs shaped like one of its float inputs, and those inputs (the residual stream)."""
    shapes = {t.shape for t in call.outputs if t.is_floating_point()}
    ins = [t for t in call.inputs if t.is_floating_point() and t.shape in shapes]
    outs = [t for t in call.outputs if t.is_floating_point() and t.shape in {i.shape for i in ins}]
    return ins, outs


def first_broken(calls_a: list[_Call], calls_b: list[_Call], region_a: Region, region_b: Region,
                 tol: float) -> str | None:
    """The module where runs a and b first differ on their compared regions (see the module docstring).
    Run b's calls of a module are matched to run a's from its last ones (a cached decode runs every module
    once per token: its last call is the one compared)."""
    by_name: dict[str, list[_Call]] = {}
    for c in calls_b:
        by_name.setdefault(c.name, []).append(c)
    counts, seen, pairs = Counter(c.name for c in calls_a), Counter(), []
    for ca in calls_a:
        bs, k = by_name.get(ca.name, []), seen[ca.name]
        seen[ca.name] += 1
        if len(bs) >= counts[ca.name]:
            pairs.append((ca, bs[len(bs) - counts[ca.name] + k]))
    for ca, cb in pairs:
        (ins_a, outs_a), (ins_b, outs_b) = _stream(ca), _stream(cb)
        if _pairs_gap(outs_a, outs_b, region_a, region_b) > tol >= _pairs_gap(ins_a, ins_b, region_a, region_b):
            return ca.name
    return next((ca.name for ca, cb in pairs if _pairs_gap(ca.outputs, cb.outputs, region_a, region_b) > tol), None)


def _rows(shape: tuple[int, int], take: Callable[[torch.Tensor], torch.Tensor]) -> Region:
    """A region function: ``take(t)`` for a tensor whose leading dims are ``shape`` (B, T), else None."""
    return lambda t: take(t) if t.dim() >= 2 and tuple(t.shape[:2]) == shape else None


# ---- crafting inputs from the user's batch ----

class ShortBatch(NotApplicable):
    """The batch at hand holds too few real tokens to probe; a later batch may do."""


def real_block(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, rows: int = ROWS,
               length: int = LENGTH, pad_id: int | None = None) -> torch.Tensor:
    """(B', L) real tokens of the user's batch, pads dropped wherever they were: its ``rows`` longest rows (none
    shorter than half the longest), all cut to the shortest of them (at most ``length``, at least MIN_LEN). A real
    token equal to the loop's ``pad_id`` (an EOS that also pads) is dropped from either end of its row: a row that
    starts or ends with the pad id looks padded, and a library warns when such a row comes without a mask."""
    real = [input_ids[i] if attention_mask is None else input_ids[i][attention_mask[i].bool()]
            for i in range(input_ids.shape[0])]
    if pad_id is not None:
        real = [_strip(r, pad_id) for r in real]
    real = sorted(real, key=len, reverse=True)[:rows]
    real = [r for r in real if len(r) >= len(real[0]) // 2]
    length = min(length, len(real[-1]))
    if length < MIN_LEN:
        raise ShortBatch(f"the batch's longest rows hold {length} real tokens: too few to probe")
    return torch.stack([r[:length] for r in real])


def _strip(row: torch.Tensor, token: int) -> torch.Tensor:
    """``row`` (T,) without its leading and trailing runs of ``token``."""
    keep = (row != token).nonzero()
    return row[int(keep[0]): int(keep[-1]) + 1] if len(keep) else row[:0]


def other_tokens(ids: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """``ids`` with every token replaced by the next distinct token of ``pool`` (cyclic): all differ."""
    vocab = torch.unique(pool)
    if len(vocab) < 2:
        raise NotApplicable("the batch holds a single distinct token: nothing to change tokens to")
    index = torch.searchsorted(vocab, ids.contiguous())
    return vocab[(index + 1) % len(vocab)]


def pad(ids: torch.Tensor, pad_id: int, side: str, count: int = PAD_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) -> ids and attention mask (B, L + count) padded on ``side`` with ``pad_id``."""
    pads = torch.full((ids.shape[0], count), pad_id, dtype=ids.dtype, device=ids.device)
    mask_pad, mask_real = torch.zeros_like(pads), torch.ones_like(ids)
    if side == "left":
        return torch.cat([pads, ids], 1), torch.cat([mask_pad, mask_real], 1)
    return torch.cat([ids, pads], 1), torch.cat([mask_real, mask_pad], 1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each real token's index among its row's real tokens (pads get 0): what positions should be."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def left_padded(attention_mask: torch.Tensor | None) -> bool:
    """Does some row of the batch start with pads and hold real tokens after them?"""
    if attention_mask is None:
        return False
    return bool(((attention_mask[:, 0] == 0) & (attention_mask.sum(-1) > 0)).any())


@contextlib.contextmanager
def glimpsed(model: torch.nn.Module):
    """A light trace of one forward: yields {"dtypes": float dtypes the modules gave, "looked_up": the inputs of
    every ``nn.Embedding``}; far cheaper than ``traced`` (nothing kept but dtypes and a few index tensors)."""
    seen: dict = {"dtypes": set(), "looked_up": []}

    def dtype(module, args, output):
        if isinstance(output, torch.Tensor):
            if output.is_floating_point():
                seen["dtypes"].add(output.dtype)
        elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            if output[0].is_floating_point():
                seen["dtypes"].add(output[0].dtype)

    def lookup(module, args):
        seen["looked_up"] += [a for a in args if isinstance(a, torch.Tensor)]

    handles = [m.register_forward_hook(dtype) for m in model.modules()]
    handles += [m.register_forward_pre_hook(lookup) for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def counted_layers(model: torch.nn.Module, shape: tuple[int, int]):
    """Yields {path of an ``nn.ModuleList`` of two or more modules of one class: [calls of each member]} for the
    block's forwards, a call counted where the member's first tensor argument leads with ``shape`` (B, T): a
    stack's layers take the residual stream; a mixture's experts, handed the tokens routed to them, count none."""
    lists = {name: list(m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1}
    calls = {name: [0] * len(members) for name, members in lists.items()}

    def count(name, i, module, args, kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and tuple(first.shape[:2]) == shape:
            calls[name][i] += 1

    handles = [member.register_forward_pre_hook(functools.partial(count, name, i),
                                                   with_kwargs=True)
               for name, members in lists.items() for i, member in enumerate(members)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def raised_in(model: torch.nn.Module, call: Callable[[], object], inputs: list | None = None) -> str | None:
    """The path of the innermost submodule of ``model`` still running when ``call()`` raised (module hooks: a
    pre-hook pushes the module, a completed forward pops it; "" when the model's own code raised), or None when it
    does not raise. ``inputs``: a list that gets that submodule's call (its positional and keyword arguments)."""
    stack: list[tuple[str, tuple, dict]] = []
    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, kw, name=name: stack.append((name, a, kw)) and None, with_kwargs=True))
            handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))  # output kept
    try:
        call()
    except Exception:  # noqa: BLE001 - the error is the caller's; only where it happened is asked
        if stack and inputs is not None:
            inputs.append(stack[-1][1:])
        return stack[-1][0] if stack else ""
    finally:
        for h in handles:
            h.remove()
    return None


def tolerance_of(dtypes: set) -> float:
    """Relative logit change allowed by rounding in the least precise float dtype a forward computed in
    (bf16 under an autocast that wraps the model's forward). fp32: 1e-4, bf16: 0.03."""
    return max(1e-4, 4 * max(torch.finfo(d).eps for d in (dtypes or {torch.float32})))


def _row(i: int, cols: slice = slice(None)) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[i: i + 1, cols]


# ---- one probe round: every model probe on one row of the loop's batch, sharing forwards ----

@dataclass
class _Forward:
    """One probe forward: its inputs, its float logits, the tolerance of the dtypes it ran in, the ids that
    ``nn.Embedding``s looked up."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    positions: torch.Tensor | None
    logits: torch.Tensor
    tol: float
    looked_up: list


class ProbeRound:
    """Every behavioural probe of the causal-LM contract on ONE row of the loop's batch (``length`` real tokens),
    with the variants batched as rows of a few forwards, traced only when a property breaks (to find the module
    where it is born):

    - forward "plain" (no mask): the row, the row again (eval mode is deterministic), the row with its tokens
      from ``cut`` on replaced (causality), the row at positions + SHIFT (relative positions) and one token
      repeated (attention weights form a distribution over keys); positions passed only when the model takes them;
    - forward "padded" (mask, when the model takes one): the row left-padded, the left-padded changed row, the
      row right-padded (padding invariance against the plain row, causality under an explicit mask);
    - forward "mixed": the row last in a batch of the plain forward's shape whose other rows hold other tokens (row
      isolation against the row first in the plain forward), the calls of each stack of layers counted (every layer
      once);
    - the model's own ``generate`` from an unpadded and a left-padded prompt (cache, decode positions) vs one
      forward over what it generated; a teacher-forced decode through ``past_key_values`` only when it disagrees.
    Each probe's result is None (holds), a ``ProbeResult`` (broken) or a ``NotApplicable`` (kept, raised by
    ``result``)."""

    def __init__(self, lm: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 pad_id: int | None = None, position_ids: torch.Tensor | None = None, length: int = LENGTH,
                 positions: str | None = None):
        self.lm, self.batch_mask, self.batch_positions = lm, attention_mask, position_ids
        self.positions = positions  # the loop's declared kind of positions (detectors.blackbox.conventions)
        # the id the loop pads with (declared, else the one its batch shows under the mask): no probe row starts or
        # ends with it
        padding = pad_id if pad_id is not None else shown_pad_id(input_ids, attention_mask)
        self.ids = real_block(input_ids, attention_mask, rows=1, length=length, pad_id=padding)
        self.pad_id = int(self.ids[0, 0]) if pad_id is None else int(pad_id)
        self.cut = self.ids.shape[1] // 2
        self.changed = self.ids.clone()  # tokens from ``cut`` on replaced: the causality probe's variant
        # replacements drawn from every real token of the batch but the pad id (a row ending with it looks padded): a
        # row of one repeated token is still probed
        pool = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
        if padding is not None and bool((pool != padding).any()):
            pool = pool[pool != padding]
        self.changed[:, self.cut:] = other_tokens(self.ids[:, self.cut:], pool)
        self._pool = pool
        self._results: dict[str, ProbeResult | None | NotApplicable] = {}
        self._plain: _Forward | None = None
        self._plain_rows: dict[str, int] = {}
        self._padded: _Forward | None = None
        self._mixed: _Forward | None = None
        self._layer_calls: dict[str, list[int]] = {}
        self._unmasked_error: tuple[Exception, str | None] | None = None

    # -- forwards
    def _forward(self, ids, mask=None, positions=None) -> _Forward:
        with glimpsed(self.lm.model) as seen:
            logits = self.lm.logits(ids, mask, positions)
        return _Forward(ids, mask, positions, logits, tolerance_of(seen["dtypes"]), seen["looked_up"])

    def _trace(self, fwd: _Forward) -> list[_Call]:
        with traced(self.lm.model) as calls:
            self.lm.logits(fwd.ids, fwd.mask, fwd.positions)
        return calls

    def plain(self) -> _Forward:
        if self._plain is None:
            ids, lm = self.ids, self.lm
            rows = {"base": ids, "again": ids, "changed": self.changed}
            if lm.takes_position_ids:
                rows |= {"shifted": ids, "repeated": ids[:, :1].expand_as(ids), "spread": ids}
            self._plain_rows = {name: i for i, name in enumerate(rows)}
            batch = torch.cat(list(rows.values()))
            positions = None
            if lm.takes_position_ids:
                positions = torch.arange(ids.shape[1], device=ids.device).expand_as(batch).clone()
                positions[self._plain_rows["shifted"]] += SHIFT
                positions[self._plain_rows["spread"], self.cut:] += SHIFT  # a gap in the positions at ``cut``
            if self._unmasked_error is None and self.lm.unpadded_error is not None:
                where = raised_in(self.lm.model, lambda: self.lm.logits(self.ids)) or None
                self._unmasked_error = (traceless(self.lm.unpadded_error), where)
            if self._unmasked_error is not None:
                raise NotApplicable(f"the model raises on an unpadded batch ({self._unmasked_error[0]})")
            try:
                self._plain = self._forward(batch, None, positions)
            except (NotApplicable, ShortBatch):
                raise
            except IndexError as exc:  # a learned table shorter than the shifted positions: probe without them
                if positions is None:
                    raise
                self._results["position_shift"] = NotApplicable(
                    f"shifted positions fall outside the model's position table ({exc})")
                self._results["attention_distribution"] = NotApplicable("the model's positions are absolute")
                self._results["positions_used"] = NotApplicable(
                    f"spread positions fall outside the model's position table ({exc})")
                rows = {k: v for k, v in rows.items() if k in ("base", "again", "changed")}
                self._plain_rows = {name: i for i, name in enumerate(rows)}
                batch = torch.cat(list(rows.values()))
                self._plain = self._forward(batch, None, positions[: len(rows)] if positions is not None else None)
            except Exception as exc:  # noqa: BLE001 - the model fails on the plainest call: causality says so
                where = raised_in(self.lm.model, lambda: self.lm.logits(self.ids)) or None
                self._unmasked_error = (traceless(exc), where)
                raise NotApplicable(f"the model raises on an unpadded batch ({exc})") from exc
        return self._plain

    def padded(self) -> _Forward:
        if self._padded is None:
            left, mask_left = pad(torch.cat([self.ids, self.changed]), self.pad_id, "left")
            right, mask_right = pad(self.ids, self.pad_id, "right")
            self._padded = self._forward(torch.cat([left, right]), torch.cat([mask_left, mask_right]))
        return self._padded

    def mixed(self) -> _Forward:
        """The row last in a batch of the plain forward's shape whose other rows hold other tokens, the plain
        forward's position rows moved with it (a stack may pick its mask path from the positions: the same rows of
        positions, the same path), with every call of the layers of the model's homogeneous ``nn.ModuleList``s
        counted (``layer_calls``)."""
        if self._mixed is None:
            plain = self.plain()
            rows, row = [], self.ids
            for _ in range(plain.ids.shape[0] - 1):
                row = other_tokens(row, self._pool)
                rows.append(row)
            batch = torch.cat([*rows, self.ids])
            base = self._plain_rows["base"]
            positions = None if plain.positions is None else torch.cat(
                [plain.positions[:base], plain.positions[base + 1:], plain.positions[base: base + 1]])
            with counted_layers(self.lm.model, tuple(batch.shape)) as calls:
                self._mixed = self._forward(batch, None, positions)
            self._layer_calls = calls
        return self._mixed

    def plain_row(self, name: str) -> torch.Tensor:
        fwd = self.plain()
        return fwd.ids[self._plain_rows[name]: self._plain_rows[name] + 1]

    @property
    def tol(self) -> float:
        """The plain forward's tolerance (its coarsest dtype); fp32's when it did not run."""
        return self._plain.tol if self._plain is not None else tolerance_of(set())

    def _logits(self, name: str) -> torch.Tensor:
        i = self._plain_rows[name]
        return self.plain().logits[i: i + 1]

    # -- results
    def result(self, probe: str) -> ProbeResult | None:
        """The probe's result: None, a ProbeResult; raises NotApplicable when the model does not take its call."""
        if probe not in self._results:
            try:
                gated = any(not self._quiet(gate) for gate in GATES.get(probe, ()))
                self._results[probe] = None if gated else getattr(self, f"_{probe}")()
            except NotApplicable as exc:
                self._results[probe] = traceless(exc)
        got = self._results[probe]
        if isinstance(got, NotApplicable):
            raise NotApplicable(str(got))  # a fresh one: raising the kept one would hang this traceback on it
        return got

    def _quiet(self, probe: str) -> bool:
        """Whether ``probe`` broke (a finding of its own)."""
        try:
            return self.result(probe) is None
        except NotApplicable:
            return True

    def _determinism(self) -> ProbeResult | None:
        fwd = self.plain()
        a, b = self._logits("base"), self._logits("again")
        gap = relative_gap(a, b)
        if gap <= fwd.tol:
            return None
        calls = self._trace(fwd)
        where = first_broken(calls, calls, _row(self._plain_rows["base"]), _row(self._plain_rows["again"]), fwd.tol)
        return ProbeResult("determinism", gap, where, "model",
                           f"two identical rows give different logits in eval mode (relative change {gap:.3g}): "
                           f"something random (dropout) still acts outside training; first at {where}",
                           {"relative_logit_change": gap, "tolerance": fwd.tol})

    def _row_isolation(self) -> ProbeResult | None:
        """No information crosses batch rows: the row gives the same logits first in the plain forward and last in a
        batch of the same shape whose other rows hold other tokens (a row sees the rows before it when a batch is
        attended as one flattened sequence; a normalization over the batch moves every row). Same shape, so the same
        code path: a kernel or mask choice that depends on the batch size is not this contract's."""
        plain, mixed = self.plain(), self.mixed()
        tol, base, last = min(plain.tol, mixed.tol), self._plain_rows["base"], mixed.ids.shape[0] - 1
        gap = relative_gap(self._logits("base"), mixed.logits[last:])
        if gap <= tol:
            return None
        again = self.lm.logits(plain.ids, plain.mask, plain.positions)[base: base + 1]
        if relative_gap(self._logits("base"), again) > tol:
            raise NotApplicable("the same forward twice gives other logits in eval mode (see the determinism probe)")
        where = first_broken(self._trace(plain), self._trace(mixed), _row(base), _row(last), tol)
        return ProbeResult("row_isolation", gap, where, "model",
                           f"the row's logits change with the other rows of its batch (relative change {gap:.3g} "
                           f"between two batches of {last + 1} rows of other tokens around it): information crosses "
                           f"batch rows (a reshape that mixes the batch into the sequence, a normalization or softmax "
                           f"over the batch); first at {where}", {"relative_logit_change": gap, "tolerance": tol})

    def _layers_once(self) -> ProbeResult | None:
        """Every declared layer runs exactly once per forward: in each ``nn.ModuleList`` of two or more modules of
        one class, one forward calls every member on the whole batch (its (B, T) leading shape) equally often."""
        self.mixed()
        uneven = {path: counts for path, counts in self._layer_calls.items() if len(set(counts)) > 1}
        if not uneven:
            return None
        path, counts = next(iter(uneven.items()))
        parent = path.rpartition(".")[0]
        return ProbeResult("layers_once", float(max(counts) - min(counts)), parent, "model",
                           f"one forward ran the {len(counts)} layers of {path} {counts} times (each once: a "
                           f"declared layer skipped or run again); in the forward of "
                           f"{parent or 'the model'}", {"layer_calls": uneven})

    def _output_contract(self) -> ProbeResult | None:
        """The logits are logits: finite, not probabilities (non-negative rows summing to 1), and a model that
        predicts the row's next tokens no worse than far above a uniform guess (ln V nats): a first loss many
        times ln V means logits at a scale no sane initialization gives."""
        logits = self._logits("base")[0]
        vocab = logits.shape[-1]
        if not torch.isfinite(logits).all():
            return None  # a non-finite forward is the first-non-finite monitor's finding
        if bool((logits >= 0).all()) and float((logits.sum(-1) - 1).abs().max()) < 0.02:
            return ProbeResult("output_contract", 1.0, "", "model",
                               "the model returns probabilities (non-negative, each row sums to 1), not logits: a "
                               "cross-entropy on them applies softmax twice", {"vocab": vocab})
        nll = float(F.cross_entropy(logits[:-1].double(), self.ids[0, 1:]))
        uniform = math.log(vocab)
        if nll > SCALE_FACTOR * uniform:
            return ProbeResult("output_contract", nll / uniform, "", "model",
                               f"the model's next-token loss on the loop's own tokens is {nll:.3g} nats, "
                               f"{nll / uniform:.1f}x a uniform guess's ln V = {uniform:.3g}: its logits are "
                               f"orders of magnitude too large (initialization scale)",
                               {"next_token_nll": nll, "uniform_nll": uniform})
        return None

    def _causality(self) -> ProbeResult | None:
        try:
            cut, fwd = self.cut, self.plain()
        except NotApplicable:
            if self._unmasked_error is None or not self.lm.takes_attention_mask:
                raise
            self.padded()  # the masked path runs (or its error is the probe's)
            exc, where = self._unmasked_error
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            return ProbeResult("causality", 1.0, where, "mask",
                               f"the model raises {error} on an unpadded batch, where no mask is "
                               f"needed, and runs on a padded one: its plain causal (no-padding) path is broken; "
                               f"in {where}", {"error": error})
        gaps, tol = {}, fwd.tol
        gaps["unpadded"] = relative_gap(self._logits("base")[:, :cut], self._logits("changed")[:, :cut])
        padded = None
        if self.lm.takes_attention_mask:
            padded = self.padded()
            tol = min(tol, padded.tol)
            gaps["left_padded"] = relative_gap(padded.logits[0:1, PAD_LEN: PAD_LEN + cut],
                                               padded.logits[1:2, PAD_LEN: PAD_LEN + cut])
        if max(gaps.values()) <= tol:
            return None
        if gaps["unpadded"] > tol:
            calls, a, b = self._trace(fwd), self._plain_rows["base"], self._plain_rows["changed"]
            where = first_broken(calls, calls, _row(a, slice(0, cut)), _row(b, slice(0, cut)), tol)
        else:
            calls = self._trace(padded)
            cols = slice(PAD_LEN, PAD_LEN + cut)
            where = first_broken(calls, calls, _row(0, cols), _row(1, cols), tol)
        gap = max(gaps.values())
        explained = not self._quiet("attention_distribution")
        message = (f"changing tokens at positions >= {cut} moves the logits before them (relative change {gap:.3g}); "
                   f"first at {where}")
        if explained:
            message += " (the attention weights are not a distribution over keys either: see that finding)"
        return ProbeResult("causality", gap, where, "model" if explained else "mask", message,
                           {"relative_logit_change": gaps, "cut": cut, "tolerance": tol})

    def _padding_invariance(self) -> ProbeResult | None:
        if not self.lm.takes_attention_mask:
            raise NotApplicable("the model takes no attention_mask: padding cannot be masked")
        plain, padded, length = self.plain(), self.padded(), self.ids.shape[1]
        alone, tol = self._logits("base"), min(plain.tol, padded.tol)
        starts = {"left": (0, PAD_LEN), "right": (2, 0)}
        gaps = {side: relative_gap(alone, padded.logits[r: r + 1, s: s + length]) for side, (r, s) in starts.items()}
        subsystem, broken = "mask", [side for side in ("left", "right") if gaps[side] > tol]
        if "left" in broken and self.lm.takes_position_ids:
            left, mask = pad(self.ids, self.pad_id, "left")
            with_positions = self.lm.logits(left, mask, positions_from_mask(mask))
            gaps["left_with_positions"] = relative_gap(alone, with_positions[:, PAD_LEN:])
            if gaps["left_with_positions"] <= tol:  # positions carry the difference, not the mask
                if not left_padded(self.batch_mask) or self.batch_positions is not None:
                    broken.remove("left")  # the loop never feeds that case
                elif broken == ["left"]:
                    subsystem = "position"
        if not broken:
            return None
        side = max(broken, key=gaps.get)
        (r, start), base = starts[side], self._plain_rows["base"]
        where = first_broken(self._trace(plain), self._trace(padded), _row(base),
                             _row(r, slice(start, start + length)), tol)
        cause = ("the loop left-pads without position_ids and positions shift with the pads" if subsystem == "position"
                 else "the mask lets real tokens see pads")
        return ProbeResult("padding_invariance", gaps[side], where, subsystem,
                           f"real-token logits change when the row is {side}-padded (relative change "
                           f"{gaps[side]:.3g}): {cause}; first at {where}",
                           {"relative_logit_gap": gaps, "tolerance": tol})

    def _absolute_positions(self) -> bool:
        """Does some ``nn.Embedding`` look the shifted positions up (a learned table of absolute positions)?"""
        fwd = self.plain()
        shifted = fwd.positions[self._plain_rows["shifted"]]
        return any(t.shape[-1] == shifted.shape[-1] and t.dim() >= 1 and
                   any(torch.equal(r, shifted) for r in t.reshape(-1, t.shape[-1])) for t in fwd.looked_up)

    def _shift_gap(self) -> float:
        """How much the logits move when every position id moves by SHIFT (relative change)."""
        return relative_gap(self._logits("base"), self._logits("shifted"))

    def _position_shift(self) -> ProbeResult | None:
        """Declared relative positions (rotary, ALiBi): the logits do not depend on where the row starts. Only a
        declaration says the positions are meant to be relative: sinusoidal or learned absolute positions computed
        from the same position ids are as correct, and shift-dependent."""
        if not self.lm.takes_position_ids:
            raise NotApplicable("the model takes no position_ids")
        if self.positions != "relative":
            raise NotApplicable("the loop did not declare its positions relative (declare={'positions': 'relative'})")
        fwd = self.plain()
        if "position_shift" in self._results:  # set while building the forward
            raise self._results["position_shift"]
        gap = self._shift_gap()
        if gap <= 10 * fwd.tol:  # rotary tables are recomputed at other angles: rounding grows a little
            return None
        calls = self._trace(fwd)
        where = first_broken(calls, calls, _row(self._plain_rows["base"]), _row(self._plain_rows["shifted"]), fwd.tol)
        return ProbeResult("position_shift", gap, where, "position",
                           f"shifting every position by {SHIFT} changes the logits (relative change {gap:.3g}) "
                           f"although the positions are declared relative: attention depends on absolute "
                           f"positions; first at {where}",
                           {"relative_logit_change": gap, "shift": SHIFT, "tolerance": 10 * fwd.tol})

    def _positions_used(self) -> ProbeResult | None:
        """The position ids a loop passes are the positions the model uses: the row with a gap of SHIFT in its
        positions from ``cut`` on must give other logits after ``cut`` (whatever the scheme: a table, sinusoids or
        rotary, the offsets across the gap change), differing from the row's logits by more than the same row again
        does. A model that ignores the ids it is given (recomputes them from 0) gives the row's logits exactly."""
        if not self.lm.takes_position_ids:
            raise NotApplicable("the model takes no position_ids")
        self.plain()
        if "positions_used" in self._results:  # set while building the forward
            raise self._results["positions_used"]
        base, cut = self._logits("base"), self.cut
        gap = relative_gap(base[:, cut:], self._logits("spread")[:, cut:])
        noise = relative_gap(base[:, cut:], self._logits("again")[:, cut:])
        if gap > noise:
            return None
        return ProbeResult("positions_used", gap, "", "position",
                           f"position ids with a gap of {SHIFT} from position {cut} on give the logits of the "
                           f"unbroken positions (relative change {gap:.3g}, the same row again: {noise:.3g}): the "
                           "model ignores the position ids it is given (recomputes them from 0, or drops them), so a "
                           "left-padded row or a packed row is positioned wrongly",
                           {"relative_logit_change": gap, "noise": noise, "cut": cut, "shift": SHIFT})

    def _attention_distribution(self) -> ProbeResult | None:
        """One token repeated, in a model whose positions are relative (shift-invariant): every position attends
        over identical values, so if the attention weights over the keys sum to 1 every position gives the same
        logits, whatever the mask and the positions do to the scores."""
        if not self.lm.takes_position_ids:
            raise NotApplicable("the model takes no position_ids: its positions may be absolute")
        fwd = self.plain()
        if "attention_distribution" in self._results:
            raise self._results["attention_distribution"]
        if self._absolute_positions() or self._shift_gap() > 10 * fwd.tol:  # measured, whatever was declared
            raise NotApplicable("the model's positions are not relative: a repeated token may differ by position")
        repeated = self._logits("repeated")[0]
        gap = relative_gap(repeated[:1].expand_as(repeated), repeated)
        if gap <= 10 * fwd.tol:
            return None
        calls, r = self._trace(fwd), self._plain_rows["repeated"]
        last = repeated.shape[0] - 1
        where = first_broken(calls, calls, _row(r, slice(0, 1)), _row(r, slice(last, last + 1)), fwd.tol)
        return ProbeResult("attention_distribution", gap, where, "model",
                           f"one token repeated gives different logits at different positions (relative change "
                           f"{gap:.3g}) in a model whose positions are relative: the attention weights over the keys "
                           f"do not sum to 1 (softmax over the wrong axis?); first at {where}",
                           {"relative_logit_change": gap, "tolerance": 10 * fwd.tol})

    def _cache_consistency(self) -> ProbeResult | None:
        lm = self.lm
        if not lm.has_generate:
            raise NotApplicable("the model has no generate of its own")
        ids = self.ids[:, :PROMPT_LEN]
        prompt = ids
        mask = None
        if lm.takes_attention_mask:  # row 0 unpadded, row 1 left-padded: the batch generation decodes
            short, short_mask = pad(ids[:, : PROMPT_LEN - PAD_LEN], self.pad_id, "left")
            prompt, mask = torch.cat([ids, short]), torch.cat([torch.ones_like(ids), short_mask])
        with glimpsed(lm.model) as seen:
            try:
                generated = lm.generate(prompt, mask, NEW_TOKENS)
            except Exception as exc:  # noqa: BLE001 - said once in the report, not as a finding of unknown place
                raise NotApplicable(f"the model's generate raises {type(exc).__name__}: {exc}") from exc
        if generated is None:
            raise NotApplicable("the model's generate gives no sequences of the asked length")
        sequences, decoded = generated
        full_mask = None if mask is None else torch.cat([mask, torch.ones_like(sequences[:, prompt.shape[1]:])], 1)
        positions = positions_from_mask(full_mask) if full_mask is not None and lm.takes_position_ids else None
        full = self._forward(sequences, full_mask, positions)
        tol = min(full.tol, tolerance_of(seen["dtypes"]))
        first = prompt.shape[1] - 1  # the prompt's last position predicts the first new token
        gaps = [[relative_gap(full.logits[r: r + 1, first + k], decoded[r: r + 1, k]) for k in range(NEW_TOKENS)]
                for r in range(prompt.shape[0])]
        broken = [r for r in range(len(gaps)) if max(gaps[r]) > tol]
        if not broken:
            return None
        gap = max(max(gaps[r]) for r in broken)
        if lm.takes_cache:  # the model's forward takes the cache: decode token by token through it ourselves
            if self._teacher_forced_agrees(sequences, full_mask, prompt.shape[1], tol):
                subsystem = "position"
                trend = "while token-by-token forwards through its cache agree: its decode steps feed wrong positions"
            else:
                subsystem = "model"
                trend = "and so do token-by-token forwards through its cache: the cache hands back wrong keys/values"
        elif broken == [1]:
            subsystem = "position"
            trend = "only on the left-padded row: the decode's positions / cache offsets count the pads"
        else:
            subsystem = "model"
            trend = "on the unpadded row too: its cache hands back other keys/values than the tokens gave"
        where = self._decode_where(prompt, mask, sequences, full, first, tol)
        return ProbeResult("cache_consistency", gap, where, subsystem,
                           f"the model's own generate disagrees with one forward over what it generated (relative gap "
                           f"{gap:.3g}) {trend}; first at {where}",
                           {"per_token_gap": dict(zip(("unpadded", "left_padded"), gaps, strict=False)),
                            "tolerance": tol})

    def _label_isolation(self) -> ProbeResult | None:
        """The logits of a forward that is handed labels do not depend on them: the row with its own next tokens as
        labels and with other tokens give the same logits."""
        lm = self.lm
        if lm.label_name is None:
            raise NotApplicable("the model's forward takes no labels")
        ids = self.ids
        with traced(lm.model, copies=True) as calls_own:  # copies: the loss may change the logits in place after
            own = lm.logits_given_labels(ids, ids)
        with traced(lm.model, copies=True) as calls_other:
            other = lm.logits_given_labels(ids, self.changed)
        tol = self.plain().tol
        gap = relative_gap(own, other)
        if gap <= tol:
            return None
        region = _rows(tuple(ids.shape), lambda t: t)
        where = first_broken(calls_own, calls_other, region, region, tol)
        inside = where is not None
        return ProbeResult("label_isolation", gap, where if inside else "loss", "model" if inside else "loss",
                           f"the logits change with the labels handed to the forward (relative gap {gap:.3g}): "
                           + (f"the labels reach the model's computation (first in {where})" if inside else
                              "no module's output changes, the logits returned do: the loss computed from them "
                              "changes them in place"), {"tolerance": tol})

    def _generation(self) -> ProbeResult | None:
        """Greedy generation from the unpadded prompt: twice under one seed, the same tokens (nothing carried from one
        call to the next); it returns the prompt unchanged and then the tokens asked for
        (exactly as many where transformers' ``min_new_tokens`` asks); a model's own decode loop (not transformers',
        whose generation config may process the logits) picks each the argmax of one forward over the sequence so
        far (its own next-token prediction)."""
        lm = self.lm
        if not lm.has_generate:
            raise NotApplicable("the model has no generate of its own")
        prompt = self.ids[:, :PROMPT_LEN]
        try:
            sequences, again = (self._generated_with_seed(prompt, GEN_SEED) for _ in range(2))
        except Exception as exc:  # noqa: BLE001 - said once in the report, not as a finding of unknown place
            raise NotApplicable(f"the model's generate raises {type(exc).__name__}: {exc}") from exc
        if sequences is None or again is None:
            raise NotApplicable("the model's generate returns no tensor of sequences")
        if not torch.equal(sequences, again):
            return ProbeResult("generation", 1.0, "generate", "model",
                               "the model's generate, called twice from the same prompt with the same seed, returned "
                               "other tokens the second time: state from one call reaches the next (a KV cache or a "
                               "position counter not reset between generations)",
                               {"first": sequences[0].tolist(), "second": again[0].tolist()})
        T, asked = prompt.shape[1], GEN_TOKENS
        got = sequences.shape[1] - T
        prompt_kept = torch.equal(sequences[:, :T].to(prompt.device), prompt)
        if not prompt_kept or got > asked or (got < asked and lm.greedy_declared):
            return ProbeResult("generation", float(abs(got - asked)), "generate", "model",
                               f"the model's generate was asked for {asked} new tokens after a {T}-token prompt "
                               f"and returned {sequences.shape[1]} tokens"
                               + ("" if prompt_kept else ", the prompt among them changed"),
                               {"asked": asked, "returned": got})
        if lm.greedy_declared:  # transformers' decode loop: its generation config's processors (a repetition
            return None  # penalty, suppressed tokens, EOS held back until min_new_tokens) may pick another token
        full = self._forward(sequences.to(prompt.device)).logits[0, T - 1: T - 1 + got].float()  # (got, V)
        chosen = sequences[0, T: T + got].to(full.device)
        best = full.max(-1).values
        margin = (best - full.gather(-1, chosen[:, None]).squeeze(-1)) / (best - full.min(-1).values).clamp_min(1e-9)
        wrong = [k for k in range(got) if float(margin[k]) > ARGMAX_MARGIN]
        if not wrong:
            return None
        other = self._generated_with_seed(prompt, GEN_SEED + 1)  # its own defaults: greedy if another seed agrees
        if other is None or not torch.equal(other, sequences):
            raise NotApplicable("the model's generate samples by default: its tokens need not be the argmax")
        k = wrong[0]
        return ProbeResult("generation", float(margin[k]), "generate", "model",
                           f"the model's greedy generate emitted, as new token {k + 1} of {got}, a token that is not "
                           f"the most likely next token of one forward over the same sequence (it trails the best by "
                           f"{float(margin[k]):.0%} of the logits' range; {len(wrong)} of {got} new tokens so): its "
                           "decode loop picks from the wrong logits or a stale step",
                           {"new_tokens": got, "not_argmax": wrong, "margin": float(margin[k])})

    def _generated_with_seed(self, prompt: torch.Tensor, seed: int) -> torch.Tensor | None:
        """``CausalLM.generated`` of GEN_TOKENS tokens under the global torch seed ``seed`` (the RNG restored)."""
        with torch.random.fork_rng(devices=cuda_devices(self.lm.model)):
            torch.manual_seed(seed)
            return self.lm.generated(prompt, None, GEN_TOKENS)

    def _teacher_forced_agrees(self, ids: torch.Tensor, mask: torch.Tensor | None, prompt: int, tol: float) -> bool:
        """The generated ``ids`` through ``past_key_values`` (the prompt in one call, then token by token, positions
        left to the model) give the logits of one forward in the same convention (mask, no positions)."""
        full = self.lm.logits(ids, mask)
        decoded = self.lm.decode_with_cache(ids, mask, prompt)
        return decoded is not None and relative_gap(full[:, prompt:], decoded[:, prompt:]) <= tol

    def _decode_where(self, prompt, mask, sequences, full: _Forward, first: int, tol: float) -> str | None:
        """The module where the decode's last call first departs from the full forward at that position."""
        with traced(self.lm.model) as calls_decode:
            self.lm.generate(prompt, mask, NEW_TOKENS)
        calls_full = self._trace(full)
        last = first + NEW_TOKENS - 1
        return first_broken(calls_full, calls_decode, _rows(tuple(sequences.shape), lambda t: t[:, last: last + 1]),
                            _rows((sequences.shape[0], 1), lambda t: t), tol)


# a probe whose reference another probe's broken property invalidates says nothing: rows that see each other make
# every comparison of two rows of one batch (or of two batches) the other rows' doing; a model random in eval mode
# makes every comparison noise; a full forward that is not causal is no reference for padding or cached decode,
# a left-padded generate shows again what padding invariance found, and a model that drops the position ids it is
# given looks shift-invariant and mispositions every padded row (its one finding is that)
GATES = {"determinism": ("row_isolation",), "output_contract": ("determinism",),
         "causality": ("determinism", "row_isolation"), "position_shift": ("determinism", "row_isolation"),
         "positions_used": ("determinism", "row_isolation"),
         "attention_distribution": ("determinism", "positions_used", "row_isolation"),
         "padding_invariance": ("determinism", "causality", "positions_used", "row_isolation"),
         "cache_consistency": ("determinism", "causality", "padding_invariance", "positions_used"),
         "generation": ("determinism", "causality"),
         "label_isolation": ("determinism",)}


# the single-probe API (one round per call): what tests and a user's own checks call
def _single(probe: str):
    def run(lm: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
            ) -> ProbeResult | None:
        return ProbeRound(lm, input_ids, attention_mask, **kwargs).result(probe)

    run.__name__ = run.__qualname__ = probe
    run.__doc__ = f"One round's ``{probe}`` result on ``input_ids`` (see ``ProbeRound``)."
    return run


PROBES = ("determinism", "row_isolation", "layers_once", "output_contract", "causality", "padding_invariance",
          "position_shift", "positions_used", "attention_distribution", "cache_consistency", "generation",
          "label_isolation")
(determinism, row_isolation, layers_once, output_contract, causality, padding_invariance, position_shift,
 positions_used, attention_distribution, cache_consistency, generation, label_isolation) = (_single(p) for p in PROBES)


# ---- label alignment: the loop's loss vs next-token NLL from the same logits ----

IGNORE = -100


def token_nlls(logits: torch.Tensor, *targets: torch.Tensor) -> list[tuple[float, int]]:
    """(sum of token NLLs, count) of the same logits (B, T, V) against each of ``targets`` (B, T), ignoring -100 and
    -1: one log-softmax for all, in float32 at least (each token's NLL exact to ~1e-7 relative), summed in float64."""
    logp = torch.log_softmax(logits.detach(), -1, dtype=torch.promote_types(logits.dtype, torch.float32))
    out = []
    for t in targets:
        keep = t >= 0
        nll = -logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        out.append((float(nll[keep].double().sum()), int(keep.sum())))
    return out


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    """``token_nlls`` against one target tensor."""
    return token_nlls(logits, targets)[0]


def _explains(loss: float, total: float, count: int, tol: float) -> bool:
    """The loop's ``loss`` is this NLL up to its usual normalizations: the mean divided by an integer
    accumulation factor (1..64), or the sum divided by an integer token count (a count over the whole
    accumulation window, or one the loop took from its own reading of the labels)."""
    if count == 0 or not (math.isfinite(loss) and math.isfinite(total)) or loss <= 0:
        return False  # a non-finite loss is another detector's finding
    factor = (total / count) / loss
    if round(factor) in range(1, 65) and abs(factor - round(factor)) <= tol * factor:
        return True
    tokens = total / loss
    return round(tokens) >= 1 and abs(tokens - round(tokens)) <= tol * tokens


def label_alignment(batch: dict, logits: torch.Tensor, loss: torch.Tensor | float | None,
                    tol: float = 1e-5) -> ProbeResult | None:
    """Does the loop's ``loss`` for ``batch`` score each position against the NEXT token? The targets are
    read from the batch: ``labels`` aligned with ``input_ids`` (HF: the model shifts) or already shifted
    (nanoGPT: the loop shifts), or ``input_ids`` when there are none. Fires only when the loss matches the
    unshifted NLL (every position scored against its own input token) and not the shifted one; a loss that
    matches neither (label smoothing, auxiliary losses) says nothing."""
    if loss is None or logits is None or logits.dim() != 3:
        return None
    ids, labels = batch["input_ids"], batch.get("labels")
    labels = ids if labels is None else labels
    if labels.shape != ids.shape or logits.shape[:2] != ids.shape:
        return None
    loss = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
    mask = labels != IGNORE
    if torch.equal(labels[mask], ids[mask]):  # aligned with the inputs: the next token is one further
        ignored = torch.full_like(labels[:, :1], IGNORE)
        right, wrong = token_nlls(logits, torch.cat([labels[:, 1:], ignored], 1), labels)
    else:  # the loop shifted already: position i's target is labels[i]; its own token is ids[i]
        right, wrong = token_nlls(logits, labels, torch.where(mask, ids, IGNORE))
    if abs(right[0] / max(right[1], 1) - wrong[0] / max(wrong[1], 1)) <= 10 * tol * abs(right[0] / max(right[1], 1)):
        return None  # the two readings are too close to tell apart on this batch
    if _explains(loss, *right, tol) or not _explains(loss, *wrong, tol):
        return None
    gap = loss / (wrong[0] / wrong[1])
    return ProbeResult("label_alignment", gap, "loss", "loss",
                       "the loop's loss is the NLL of each position's OWN input token, not the next one: the labels "
                       "are not shifted", {"loop_loss": loss, "next_token_nll": right[0] / right[1],
                                           "own_token_nll": wrong[0] / wrong[1]})


# ---- the probe detectors of the black-box track ----

_ROUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ctx -> (step, ProbeRound): one round per run
_FULL_ROUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the same, run in full precision


@contextlib.contextmanager
def full_precision(model: torch.nn.Module):
    """The model's float32 parameters and buffers (gradients too) as float64 for the block and float32 again after,
    both exact: autocast leaves float64 alone, so a forward the loop wrapped in a bf16 autocast runs in full
    precision."""
    model.double()
    try:
        yield
    finally:
        model.float()


def fits_full_precision(ctx) -> bool:
    """Whether the probes may run in full precision: one rank (no replica shares the tensors) and every floating
    parameter and buffer float32 (float32 -> float64 -> float32 restores them exactly)."""
    tensors = [*ctx.model.parameters(), *ctx.model.buffers()]
    return ctx.world_size == 1 and all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())


def round_result(ctx, probe: str, full: bool = False) -> ProbeResult | None:
    """``probe``'s result in the run's probe round, built on the loop's latest batch at the first call (raises
    ShortBatch when that batch is too short: a later one may do) and shared by every probe detector; ``full``: in
    the round whose forwards run in full precision (``full_precision``)."""
    rounds = _FULL_ROUNDS if full else _ROUNDS
    entry = rounds.get(ctx)
    if entry is None or entry[0] != ctx.step:
        batch = ctx.last_batch
        if not batch or "input_ids" not in batch:
            raise ShortBatch("no training batch seen yet")
        try:
            lm = ctx.lm
        except ValueError as exc:  # no per-position logits to probe
            raise NotApplicable(str(exc)) from exc
        entry = (ctx.step, ProbeRound(lm, batch["input_ids"], batch.get("attention_mask"), ctx.conventions.pad_id,
                                      batch.get("position_ids"), positions=ctx.conventions.positions))
        rounds[ctx] = entry
    with ctx.probe(), full_precision(ctx.model) if full else contextlib.nullcontext():
        return entry[1].result(probe)


class _ActiveProbe(BlackBoxDetector):
    """Runs its probe of the shared round once, before the loop's first optimizer step (findings carry step 0),
    on the batch that step trains on; if that batch is too short, before a later step, or at the end (a probe whose
    ``again_at_end`` says so, still silent: at the end again, on the trained model). A probe
    silent in a round whose forwards ran in a coarse dtype (bf16, fp16) runs again at once in full precision when the
    model's weights are float32 (``fits_full_precision``). A ``RECHECK`` probe still silent runs again at the end: an
    untrained model's faint position or context dependence stays under that rounding, a trained one's does not."""

    passive = False
    PROBE: str
    CONFIDENCE = 0.7
    RECHECK = False  # a faint dependence an untrained model hides under bf16 rounding: checked again at the end

    def again_at_end(self, ctx) -> bool:
        """Whether a silent probe runs again at the end, on the trained model (a property an untrained model may
        keep by chance)."""
        return False

    def __init__(self) -> None:
        super().__init__()
        self.done = self.coarse = False

    def on_before_step(self, ctx) -> None:
        if not self.done:
            with contextlib.suppress(ShortBatch):  # a later batch may be longer
                self._run(ctx)

    def on_end(self, ctx) -> None:
        if not self.done or ((self.again_at_end(ctx) or self.RECHECK and self.coarse) and not self.findings):
            with contextlib.suppress(ShortBatch):
                self._run(ctx)

    def _run(self, ctx) -> None:
        result = round_result(ctx, self.PROBE)
        self.done = True
        self.coarse = _ROUNDS[ctx][1].tol > COARSE
        if result is None and self.coarse and fits_full_precision(ctx):
            # the forwards ran in bf16/fp16 (an autocast around the model's forward): a contract holds in full
            # precision too, where a faint break is not lost in the rounding. A non-finite gap there, after a finite
            # silent coarse round, is float64's own doing (a mask's float64 minimum overflowing a float32 softmax)
            result = round_result(ctx, self.PROBE, full=True)
            if result is not None and not math.isfinite(result.gap):
                result = None
        if result is not None:
            self.report(ctx, result.subsystem, result.where, result.message,
                        {"gap": result.gap, **result.evidence}, confidence=self.CONFIDENCE)


@register
class BlackBoxDeterminism(_ActiveProbe):
    id = "bb_eval_determinism"
    family = "model"
    description = "the loop's row twice in one eval-mode forward: identical logits (nothing random outside training)"
    PROBE = "determinism"
    CONFIDENCE = 0.85


@register
class BlackBoxRowIsolation(_ActiveProbe):
    id = "bb_row_isolation"
    family = "model"
    description = "the loop's row in two eval-mode batches of other rows around it: identical logits (rows isolated)"
    PROBE = "row_isolation"
    CONFIDENCE = 0.85


@register
class BlackBoxLayersOnce(_ActiveProbe):
    id = "bb_layers_once"
    family = "model"
    description = "one forward calls every layer of each stack of same-class layers (an nn.ModuleList) equally often"
    PROBE = "layers_once"
    CONFIDENCE = 0.8


@register
class BlackBoxOutputContract(_ActiveProbe):
    id = "bb_output_contract"
    family = "model"
    description = "the model's outputs are logits: not probabilities, and no loss many times ln V before training"
    PROBE = "output_contract"
    CONFIDENCE = 0.8


@register
class BlackBoxCausality(_ActiveProbe):
    id = "bb_causality"
    family = "mask"
    description = "tokens after t changed in a copy of the loop's row: logits before t must not move"
    PROBE = "causality"
    RECHECK = True
    CONFIDENCE = 0.85


@register
class BlackBoxPadding(_ActiveProbe):
    id = "bb_padding_invariance"
    family = "mask"
    description = "the loop's row alone vs left-/right-padded with a mask: real-token logits match"
    PROBE = "padding_invariance"
    CONFIDENCE = 0.75


@register
class BlackBoxCache(_ActiveProbe):
    id = "bb_cache_consistency"
    family = "position"
    description = "the model's own generate (its KV cache, its decode positions) vs one forward over what it generated"
    PROBE = "cache_consistency"


@register
class BlackBoxGeneration(_ActiveProbe):
    id = "bb_generation"
    family = "model"
    description = ("the model's own greedy generate: the same tokens twice under one seed, the prompt kept, the "
                   "tokens asked for, each (its own decode loop) the argmax of one forward over the sequence so far")
    PROBE = "generation"

    def again_at_end(self, ctx) -> bool:
        """A model's own decode loop, whose tokens are judged against the argmax: an untrained tied model predicts
        its input token again, as a stale decode step repeats it, so the trained one is asked again."""
        return not ctx.lm.greedy_declared


@register
class BlackBoxLabelIsolation(_ActiveProbe):
    id = "bb_label_isolation"
    family = "loss"
    description = "the loop's row handed its own and other tokens as labels: the logits do not depend on the labels"
    PROBE = "label_isolation"
    CONFIDENCE = 0.8


@register
class BlackBoxPositionShift(_ActiveProbe):
    id = "bb_position_shift"
    family = "position"
    description = "every position id + 3: a model with declared relative (rotary) positions gives the same logits"
    PROBE = "position_shift"
    RECHECK = True


@register
class BlackBoxPositionsUsed(_ActiveProbe):
    id = "bb_positions_used"
    family = "position"
    description = "position ids with a gap: the logits after it change (the model uses the position ids it is given)"
    PROBE = "positions_used"


@register
class BlackBoxAttentionDistribution(_ActiveProbe):
    id = "bb_attention_distribution"
    family = "model"
    description = "one token repeated, relative positions: every position gives the same logits (weights sum to 1)"
    PROBE = "attention_distribution"
    RECHECK = True
    CONFIDENCE = 0.9


@register
class BlackBoxLabelAlignment(BlackBoxDetector):
    id = "bb_label_alignment"
    family = "loss"
    description = "the loop's loss vs the next-token and the own-token NLL computed from the same forward's logits"
    CHECKS = 2  # training forwards compared (a loop's labels do not change with training)
    CONFIRM = 2  # forwards whose loss must read as own-token NLL: one integer coincidence does not fire

    def __init__(self) -> None:
        super().__init__()
        self.checked, self.verdicts = 0, []

    def on_forward(self, ctx, batch, logits, loss) -> None:
        if loss is None or logits is None or "input_ids" not in batch:
            return
        self.checked += 1
        if self.checked >= self.CHECKS:
            self.retire("on_forward")
        with torch.no_grad():
            result = label_alignment(batch, logits, loss)
        if result is not None:
            self.verdicts.append(result)
        if len(self.verdicts) == self.CONFIRM:
            self.retire("on_forward")
            self.report(ctx, result.subsystem, result.where, result.message, {"gap": result.gap, **result.evidence},
                        confidence=0.85)
