"""Behavioural probes of the causal-LM contract, on any model a ``CausalLM`` wraps, with variants crafted
from one of the user's own batches (its shape, its tokens, its pad id): causality, padding invariance, cache
consistency, position-shift invariance, and label alignment of the loop's loss.

Each probe returns None when the property holds, a ``ProbeResult`` when it breaks, and raises
``NotApplicable`` when the model does not take the call the probe needs. Localization: forward hooks on every
submodule record the two runs being compared; the culprit is the FIRST module (completion order) whose
residual-stream output (a float output shaped like one of its float inputs) moves while those inputs do not:
the module where the difference is born, not one that merely carries it (an ``o_proj`` fed by a leaking
attention, the block around it). Failing that, the first module whose output moves at all.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from detectors.api import NotApplicable, register
from detectors.blackbox.api import BlackBoxDetector
from detectors.blackbox.lm import CausalLM

MAX_ROWS, MAX_LEN = 4, 64  # a probe costs a few forwards of at most this batch
DECODE_LEN = 16  # tokens decoded one by one in the cache probe: each is a forward
PAD_LEN = 3  # pads added on each side in the padding probe
SHIFT = 3  # positions added in the position-shift probe


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
def traced(model: torch.nn.Module):
    """Yields the list of ``_Call``s of every submodule's forward (completion order) while the block runs."""
    calls: list[_Call] = []

    def record(name, module, args, kwargs, output):
        calls.append(_Call(name, _tensors((args, kwargs)), _tensors(output)))

    handles = [m.register_forward_hook(functools.partial(record, name), with_kwargs=True)
               for name, m in model.named_modules() if name]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def tolerance(calls: list[_Call]) -> float:
    """Relative logit change allowed by rounding in the dtype the traced forward computed in: the least precise
    of its modules' float outputs (bf16 under an autocast that wraps the model's forward). fp32: 1e-4, bf16: 0.03."""
    dtypes = {t.dtype for c in calls for t in c.outputs if t.is_floating_point()} or {torch.float32}
    return max(1e-4, 4 * max(torch.finfo(d).eps for d in dtypes))


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


def real_block(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B', L) real tokens of the user's batch, pads dropped wherever they were: its longest rows (up to
    MAX_ROWS, none shorter than half the longest), all cut to the shortest of them (at most MAX_LEN)."""
    rows = [input_ids[i] if attention_mask is None else input_ids[i][attention_mask[i].bool()]
            for i in range(input_ids.shape[0])]
    rows = sorted(rows, key=len, reverse=True)[:MAX_ROWS]
    rows = [r for r in rows if len(r) >= len(rows[0]) // 2]
    length = min(MAX_LEN, len(rows[-1]))
    if length < 4:
        raise ShortBatch(f"the batch's longest rows hold {length} real tokens: too few to probe")
    return torch.stack([r[:length] for r in rows])


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


def _compare(lm: CausalLM, run_a: Callable[[], torch.Tensor], run_b: Callable[[], torch.Tensor]):
    """Both runs traced: (logits a, logits b, calls a, calls b)."""
    with traced(lm.model) as calls_a:
        a = run_a()
    with traced(lm.model) as calls_b:
        b = run_b()
    return a, b, calls_a, calls_b


# ---- the probes ----

def causality(lm: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
              ) -> ProbeResult | None:
    """Tokens at positions >= t replaced: logits at < t must not move. Run unpadded, and left-padded with a
    mask when the model takes one (many models build an explicit mask only for padded batches)."""
    ids = real_block(input_ids, attention_mask)
    cut = ids.shape[1] // 2
    changed = ids.clone()
    changed[:, cut:] = other_tokens(ids[:, cut:], ids)
    variants = {"unpadded": (ids, changed, None, 0)}
    if lm.takes_attention_mask:
        (padded, mask), (padded_changed, _) = pad(ids, int(ids[0, 0]), "left"), pad(changed, int(ids[0, 0]), "left")
        variants["left_padded"] = (padded, padded_changed, mask, PAD_LEN)
    tol, gaps, worst = math.inf, {}, None
    for name, (a_ids, b_ids, mask, offset) in variants.items():
        a, b, calls_a, calls_b = _compare(lm, functools.partial(lm.logits, a_ids, mask),
                                          functools.partial(lm.logits, b_ids, mask))
        tol = min(tol, tolerance(calls_a))
        gaps[name] = relative_gap(a[:, offset: offset + cut], b[:, offset: offset + cut])
        if gaps[name] > tol and worst is None:
            region = _rows(tuple(a_ids.shape), lambda t, o=offset: t[:, o: o + cut])
            worst = first_broken(calls_a, calls_b, region, region, tol)
    if max(gaps.values()) <= tol:
        return None
    return ProbeResult("causality", max(gaps.values()), worst, "mask",
                       f"changing tokens at positions >= {cut} moves the logits before them "
                       f"(relative change {max(gaps.values()):.3g}); first at {worst}",
                       {"relative_logit_change": gaps, "cut": cut, "tolerance": tol})


def left_padded(attention_mask: torch.Tensor | None) -> bool:
    """Does some row of the batch start with pads and hold real tokens after them?"""
    if attention_mask is None:
        return False
    return bool(((attention_mask[:, 0] == 0) & (attention_mask.sum(-1) > 0)).any())


def padding_invariance(lm: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       pad_id: int | None = None, position_ids: torch.Tensor | None = None) -> ProbeResult | None:
    """Each row alone vs padded on the left and on the right (masked): real-token logits must match.
    A left-pad difference that explicit mask-derived positions remove is the model's convention (GPT-2 counts
    positions from the first column): a bug only where the loop left-pads without passing positions
    (``position_ids``: the loop's own, if any) -> "position"; a difference positions do not remove -> "mask"."""
    if not lm.takes_attention_mask:
        raise NotApplicable("the model takes no attention_mask: padding cannot be masked")
    ids = real_block(input_ids, attention_mask)
    pad_id = int(ids[0, 0]) if pad_id is None else pad_id
    length, gaps, traces = ids.shape[1], {}, {}
    with traced(lm.model) as calls_alone:
        alone = lm.logits(ids)
    tol = tolerance(calls_alone)
    for side in ("left", "right"):
        padded, mask = pad(ids, pad_id, side)
        start = PAD_LEN if side == "left" else 0
        with traced(lm.model) as calls_padded:
            got = lm.logits(padded, mask)
        gaps[side] = relative_gap(alone, got[:, start: start + length])
        traces[side] = (calls_padded, tuple(padded.shape), start)
    subsystem, broken = "mask", [side for side in ("left", "right") if gaps[side] > tol]
    if "left" in broken and lm.takes_position_ids:
        padded, mask = pad(ids, pad_id, "left")
        with_positions = lm.logits(padded, mask, positions_from_mask(mask))
        gaps["left_with_positions"] = relative_gap(alone, with_positions[:, PAD_LEN:])
        if gaps["left_with_positions"] <= tol:  # positions carry the difference, not the mask
            if not left_padded(attention_mask) or position_ids is not None:
                broken.remove("left")  # the loop never feeds that case
            elif broken == ["left"]:
                subsystem = "position"
    if not broken:
        return None
    side = max(broken, key=gaps.get)
    calls_padded, shape, start = traces[side]
    where = first_broken(calls_alone, calls_padded, _rows(tuple(ids.shape), lambda t: t),
                         _rows(shape, lambda t: t[:, start: start + length]), tol)
    cause = ("the loop left-pads without position_ids and positions shift with the pads" if subsystem == "position"
             else "the mask lets real tokens see pads")
    return ProbeResult("padding_invariance", gaps[side], where, subsystem,
                       f"real-token logits change when the row is {side}-padded (relative change {gaps[side]:.3g}): "
                       f"{cause}; first at {where}", {"relative_logit_gap": gaps, "tolerance": tol})


@dataclass
class _Decode:
    """One cached-decode variant traced against its full forward: per-position gaps and the regions that align
    the full forward's last compared position with the decode's last call (one token)."""

    gaps: list[float]
    calls_full: list[_Call]
    calls_decode: list[_Call]
    shape: tuple[int, int]  # (B, T) of the full forward
    last: int  # the full forward's position the decode's last call computes
    tol: float

    def where(self) -> str | None:
        """The module where the decode's last call first departs from the full forward at that position."""
        last = self.last
        return first_broken(self.calls_full, self.calls_decode, _rows(self.shape, lambda t: t[:, last: last + 1]),
                            _rows((self.shape[0], 1), lambda t: t), self.tol)


def _teacher_forced(lm: CausalLM, ids: torch.Tensor, mask: torch.Tensor | None, start: int) -> _Decode:
    """``ids`` through the cache (``decode_with_cache``: the real tokens' first half in one call, then one token
    at a time) vs one forward; ``start``: the first real position."""
    prefill = start + (ids.shape[1] - start) // 2
    full, decoded, calls_a, calls_b = _compare(lm, functools.partial(lm.logits, ids, mask),
                                               functools.partial(lm.decode_with_cache, ids, mask, prefill))
    if decoded is None:
        raise NotApplicable("the model accepts cache arguments but hands no cache back")
    gaps = [relative_gap(full[:, t], decoded[:, t]) for t in range(start, ids.shape[1])]
    return _Decode(gaps, calls_a, calls_b, tuple(ids.shape), ids.shape[1] - 1, tolerance(calls_a))


def _generated(lm: CausalLM, prompt: torch.Tensor, mask: torch.Tensor | None, new: int) -> _Decode | None:
    """Greedy ``generate`` from ``prompt`` vs one forward over the generated sequence (positions from the mask
    when the model takes them, as a left-padded decode must use). None when the model has no ``generate``."""
    with traced(lm.model) as calls_b:
        generated = lm.generate(prompt, mask, new)
    if generated is None:
        return None
    sequences, logits = generated
    full_mask = None if mask is None else torch.cat([mask, torch.ones_like(sequences[:, prompt.shape[1]:])], 1)
    positions = positions_from_mask(full_mask) if full_mask is not None and lm.takes_position_ids else None
    with traced(lm.model) as calls_a:
        full = lm.logits(sequences, full_mask, positions)
    first = prompt.shape[1] - 1  # the prompt's last position predicts the first new token
    gaps = [relative_gap(full[:, first + k], logits[:, k]) for k in range(new)]
    return _Decode(gaps, calls_a, calls_b, tuple(sequences.shape), first + new - 1, tolerance(calls_a))


def cache_consistency(lm: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      new_tokens: int = 4) -> ProbeResult | None:
    """Decoding through the model's own cache must give the full forward's logits: token by token through
    ``forward`` (teacher-forced), then through the model's own ``generate`` (its decode positions), each unpadded
    and (when the model takes a mask) left-padded, where cached keys must stay aligned with the mask.
    A teacher-forced gap that grows with the cache length points at positions, a flat one at the model; a gap
    only ``generate`` shows points at the positions / cache offsets its decode loop feeds the forward."""
    if not lm.takes_cache:
        raise NotApplicable("the model takes no KV cache")
    ids = real_block(input_ids, attention_mask)[:, :DECODE_LEN]
    pad_id, prompt = int(ids[0, 0]), ids[:, : ids.shape[1] // 2]
    variants = [("forward", functools.partial(_teacher_forced, lm, ids, None, 0)),
                ("generate", functools.partial(_generated, lm, prompt, None, new_tokens))]
    if lm.takes_attention_mask:
        variants.insert(1, ("forward_left_padded",
                            functools.partial(_teacher_forced, lm, *pad(ids, pad_id, "left"), PAD_LEN)))
        variants.append(("generate_left_padded",
                         functools.partial(_generated, lm, *pad(prompt, pad_id, "left"), new_tokens)))
    measured = {}
    for name, run in variants:
        decode = run()
        if decode is None:
            continue
        measured[name] = decode.gaps
        if max(decode.gaps) > decode.tol:
            break
    else:
        return None
    gap, where = max(decode.gaps), decode.where()
    if name.startswith("generate"):
        subsystem = "position"
        trend = "while token-by-token forwards through the cache agree: its decode steps feed wrong positions"
    else:
        grows = _grows(decode.gaps, decode.tol)
        subsystem = "position" if grows else "model"
        trend = "growing with the cache length" if grows else "not growing with the cache length"
    return ProbeResult("cache_consistency", gap, where, subsystem,
                       f"cached decode ({name}) disagrees with the full forward (relative gap {gap:.3g}), {trend}; "
                       f"first at {where}", {"per_position_gap": measured, "tolerance": decode.tol})


def _grows(per_position: list[float], tol: float) -> bool:
    """The gap rises along the sequence: the later half's mean is over twice the earlier half's (past the
    first broken position), as when an offset error accumulates with every cached token."""
    broken = [i for i, g in enumerate(per_position) if g > tol]
    tail = per_position[broken[0]:]
    if len(tail) < 4:
        return False
    half = len(tail) // 2
    early, late = sum(tail[:half]) / half, sum(tail[half:]) / (len(tail) - half)
    return late > 2 * early


def position_shift(lm: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   shift: int = SHIFT) -> ProbeResult | None:
    """All positions + ``shift``: a model with relative (rotary) positions gives the same logits. A model whose
    position ids index a learned table (an embedding lookup of the position tensor) is not applicable."""
    if not lm.takes_position_ids:
        raise NotApplicable("the model takes no position_ids")
    ids = real_block(input_ids, attention_mask)
    base = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    moved = base + shift
    try:
        a, b, calls_a, calls_b = _compare(lm, lambda: lm.logits(ids, position_ids=base),
                                          lambda: lm.logits(ids, position_ids=moved))
    except IndexError as exc:  # a learned table shorter than the shifted positions
        raise NotApplicable(f"shifted positions fall outside the model's position table ({exc})") from exc
    looked_up = [c.inputs for c in calls_b if isinstance(lm.model.get_submodule(c.name), torch.nn.Embedding)]
    if any(t.shape[-1] == moved.shape[-1] and torch.equal(t.reshape(-1, t.shape[-1])[0], moved[0])
           for inputs in looked_up for t in inputs):
        raise NotApplicable("the model looks its position ids up in a learned table (absolute positions)")
    gap, tol = relative_gap(a, b), tolerance(calls_a)
    if gap <= 10 * tol:  # rotary tables are recomputed at other angles: rounding grows a little
        return None
    region = _rows(tuple(ids.shape), lambda t: t)
    where = first_broken(calls_a, calls_b, region, region, tol)  # the gap is real: find where it is born
    return ProbeResult("position_shift", gap, where, "position",
                       f"shifting every position by {shift} changes the logits (relative change {gap:.3g}) although "
                       f"no position is looked up in a table: attention depends on absolute positions; "
                       f"first at {where}",
                       {"relative_logit_change": gap, "shift": shift, "tolerance": 10 * tol})


# ---- label alignment: the loop's loss vs next-token NLL from the same logits ----

IGNORE = -100


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    """(sum of token NLLs, count) of logits (B, T, V) against targets (B, T), ignoring -100 and -1."""
    keep = targets >= 0
    if not keep.any():
        return 0.0, 0
    losses = F.cross_entropy(logits[keep].double(), targets[keep], reduction="sum")
    return float(losses), int(keep.sum())


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
    logits = logits.detach()
    mask = labels != IGNORE
    if torch.equal(labels[mask], ids[mask]):  # aligned with the inputs: the next token is one further
        right, wrong = _nll(logits[:, :-1], labels[:, 1:]), _nll(logits, labels)
    else:  # the loop shifted already: position i's target is labels[i]; its own token is ids[i]
        right, wrong = _nll(logits, labels), _nll(logits, torch.where(mask, ids, IGNORE))
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

class _ActiveProbe(BlackBoxDetector):
    """Runs ``PROBE`` on the loop's latest batch after the first optimizer step and, if silent then, again at
    the end (a trained model leans on context more: a faint leak at init shows then), inside ``ctx.probe()``."""

    passive = False
    PROBE: Callable[..., ProbeResult | None]
    CONFIDENCE = 0.7

    def on_after_step(self, ctx, record) -> None:
        if record.step == 1:
            with contextlib.suppress(ShortBatch):  # the end's batch may be longer
                self._run(ctx)

    def on_end(self, ctx) -> None:
        if not self.findings:
            self._run(ctx)

    def _run(self, ctx) -> None:
        batch = ctx.last_batch
        if not batch or "input_ids" not in batch:
            return
        try:
            ctx.lm  # noqa: B018 - the model seen as a causal LM, built on first use
        except ValueError as exc:  # no per-position logits to probe
            raise NotApplicable(str(exc)) from exc
        with ctx.probe():
            result = self.probe(ctx, batch)
        if result is not None:
            self.report(ctx, result.subsystem, result.where, result.message,
                        {"gap": result.gap, **result.evidence}, confidence=self.CONFIDENCE)

    def probe(self, ctx, batch: dict) -> ProbeResult | None:
        return type(self).PROBE(ctx.lm, batch["input_ids"], batch.get("attention_mask"))


@register
class BlackBoxCausality(_ActiveProbe):
    id = "bb_causality"
    family = "mask"
    description = "tokens after t changed in a copy of the loop's batch: logits before t must not move"
    PROBE = staticmethod(causality)
    CONFIDENCE = 0.85


@register
class BlackBoxPadding(_ActiveProbe):
    id = "bb_padding_invariance"
    family = "mask"
    description = "each row of the loop's batch alone vs left-/right-padded with a mask: real-token logits match"
    CONFIDENCE = 0.75

    def probe(self, ctx, batch: dict) -> ProbeResult | None:
        pad_id = getattr(ctx.tokenizer, "pad_token_id", None)
        return padding_invariance(ctx.lm, batch["input_ids"], batch.get("attention_mask"), pad_id,
                                  batch.get("position_ids"))


@register
class BlackBoxCache(_ActiveProbe):
    id = "bb_cache_consistency"
    family = "position"
    description = "decode through the model's own KV cache vs a full forward on the loop's batch"
    PROBE = staticmethod(cache_consistency)


@register
class BlackBoxPositionShift(_ActiveProbe):
    id = "bb_position_shift"
    family = "position"
    description = "every position id + 3: a model with relative (rotary) positions gives the same logits"
    PROBE = staticmethod(position_shift)


@register
class BlackBoxLabelAlignment(BlackBoxDetector):
    id = "bb_label_alignment"
    family = "loss"
    description = "the loop's loss vs the next-token and the own-token NLL computed from the same forward's logits"
    CHECKS = 6  # training forwards compared at most
    CONFIRM = 2  # forwards whose loss must read as own-token NLL: one integer coincidence does not fire

    def __init__(self) -> None:
        super().__init__()
        self.checked, self.verdicts = 0, []

    def on_forward(self, ctx, batch, logits, loss) -> None:
        if self.checked >= self.CHECKS or loss is None or logits is None or "input_ids" not in batch:
            return
        self.checked += 1
        with torch.no_grad():
            result = label_alignment(batch, logits, loss)
        if result is not None:
            self.verdicts.append(result)
        if len(self.verdicts) == self.CONFIRM:
            self.checked = self.CHECKS
            self.report(ctx, result.subsystem, result.where, result.message, {"gap": result.gap, **result.evidence},
                        confidence=0.85)
