"""Mutation operators: each one a class of real bug, applied to a seam's AST as a minimal text edit.

An operator walks a seam's ``def`` (the body after its docstring) and yields ``Site``s: every place where
its kind of bug can be written, each as the edits that write it. Edits replace spans of the seam's own
source (file lines and columns, as the AST gives them), so a mutant's diff is one or two changed lines, the
seam's comments and formatting kept; an expression put in a new context is parenthesised where precedence
could change its meaning.

Operators model classes of bugs, not known faults: each cites the real bug or documented pitfall of its
class (``reference``). They over-generate; ``faults.mutants.admit`` keeps the mutants that run, show and
behave unlike every other.
"""

from __future__ import annotations

import abc
import ast
import copy
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    """Replace the text from (line, col) to (end_line, end_col) of the module source (1-based lines, 0-based
    character columns, end exclusive) by ``text``."""

    line: int
    col: int
    end_line: int
    end_col: int
    text: str


@dataclass(frozen=True)
class Site:
    """One mutation: its edits (non-overlapping), the first and last source line it touches, a short label."""

    edits: tuple[Edit, ...]
    label: str

    @property
    def lines(self) -> tuple[int, int]:
        return min(e.line for e in self.edits), max(e.end_line for e in self.edits)


class Source:
    """A module's source lines, with the AST's byte columns turned into character columns."""

    def __init__(self, text: str):
        self.lines = text.splitlines()

    def col(self, line: int, byte_col: int) -> int:
        return len(self.lines[line - 1].encode()[:byte_col].decode(errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int, int, int]:
        return (node.lineno, self.col(node.lineno, node.col_offset), node.end_lineno,
                self.col(node.end_lineno, node.end_col_offset))

    def text(self, node: ast.AST) -> str:
        line, col, end_line, end_col = self.span(node)
        if line == end_line:
            return self.lines[line - 1][col:end_col]
        chunk = self.lines[line - 1 : end_line]
        return "\n".join([chunk[0][col:], *chunk[1:-1], chunk[-1][:end_col]])

    def replace(self, node: ast.AST, text: str) -> Edit:
        return Edit(*self.span(node), text)

    def indent(self, line: int) -> str:
        text = self.lines[line - 1]
        return text[: len(text) - len(text.lstrip())]

    def whole_lines(self, first: int, last: int, new_lines: list[str]) -> Edit:
        """Replace source lines first..last (inclusive) by ``new_lines``."""
        return Edit(first, 0, last, len(self.lines[last - 1]), "\n".join(new_lines))


def apply(source: Source, edits, first: int, last: int) -> list[str]:
    """Lines first..last of ``source`` with ``edits`` applied (each edit inside that range)."""
    lines = source.lines[first - 1 : last]
    for e in sorted(edits, key=lambda e: (e.line, e.col), reverse=True):  # bottom-up keeps positions valid
        head = lines[e.line - first][: e.col]
        tail = lines[e.end_line - first][e.end_col :]
        new = (head + e.text + tail).split("\n") if e.text or head or tail else []  # whole lines deleted
        lines[e.line - first : e.end_line - first + 1] = new
    return lines


_ATOMS = (ast.Name, ast.Constant, ast.Attribute, ast.Call, ast.Subscript, ast.List, ast.Tuple, ast.Dict)


def expr(node: ast.AST) -> str:
    """``node`` as source, parenthesised unless it is an atom."""
    text = ast.unparse(node)
    return text if isinstance(node, _ATOMS) else f"({text})"


def body_of(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The statements of ``fn`` after its docstring."""
    first = fn.body[0]
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    return fn.body[1:] if doc else fn.body


def walk_body(fn: ast.FunctionDef) -> Iterator[ast.AST]:
    """Every node of ``fn``'s body (after the docstring), in source order, nested definitions included."""
    nodes = [n for stmt in body_of(fn) for n in ast.walk(stmt) if hasattr(n, "lineno")]
    return iter(sorted(nodes, key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset)))


def blocks(fn: ast.FunctionDef) -> Iterator[list[ast.stmt]]:
    """Every statement list of ``fn``'s body (the body itself, and each nested block), outermost first."""
    yield body_of(fn)
    for node in walk_body(fn):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt) and not isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                yield block


def call_name(call: ast.Call) -> str:
    """The called name's last part: ``torch.nn.functional.softmax(...)`` -> ``softmax``."""
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def int_value(node: ast.AST) -> int | None:
    """The value of an integer literal (``-1`` included), else None (bools are not integers here)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = int_value(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


class Operator(abc.ABC):
    """A class of bug. ``sites(fn, source)`` yields every place in ``fn`` where it can be written."""

    name: str = ""
    title: str = ""  # the class of bug, as a fault title says it
    reference: str = ""  # the real bug or documented pitfall of this class

    @abc.abstractmethod
    def sites(self, fn: ast.FunctionDef, source: Source) -> Iterator[Site]:
        """Every site of this operator in ``fn``'s body, in source order."""


# ---- index, slice and shift ----------------------------------------------------------------------------

class OffByOne(Operator):
    name = "off_by_one"
    title = "an index, slice bound or shift off by one"
    reference = ("HF transformers docs, GPT2LMHeadModel/LlamaForCausalLM: 'labels are shifted inside the model' "
                 "(users who shift them again train on the token after next); nanoGPT get_batch: "
                 "y = data[i+1:i+1+block_size], the classic place for an off-by-one")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if isinstance(node, ast.Subscript):
                parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                bounds = [b for p in parts for b in ((p.lower, p.upper) if isinstance(p, ast.Slice) else (p,))]
                for bound in bounds:
                    if bound is not None:
                        yield from self._shifted(bound, source)
            elif isinstance(node, ast.Call) and call_name(node) in ("range", "roll", "narrow", "arange", "triu",
                                                                     "tril"):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    yield from self._shifted(arg, source)

    def _shifted(self, node, source):
        value = int_value(node)
        if value is not None and abs(value) <= 2:
            for new in (value + 1, value - 1):
                yield Site((source.replace(node, str(new)),), f"{value} -> {new}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and int_value(node.right) == 1:
            yield Site((source.replace(node, expr(node.left)),), f"{ast.unparse(node)} -> {ast.unparse(node.left)}")


# ---- reductions and dims ---------------------------------------------------------------------------------

_DIM_CALLS = {"softmax", "log_softmax", "sum", "mean", "max", "min", "argmax", "argmin", "cumsum", "logsumexp",
              "norm", "cat", "stack", "all", "any", "amax", "amin", "prod", "var", "std", "unsqueeze", "squeeze",
              "flatten", "split", "chunk", "size", "gather", "index_select", "sort", "topk"}


class WrongDim(Operator):
    name = "wrong_dim"
    title = "a reduction, softmax or concatenation over the wrong dimension"
    reference = ("PyTorch: 'Implicit dimension choice for softmax has been deprecated' (softmax over the wrong axis "
                 "mixes positions instead of normalizing each row); Vaswani et al. 2017, Eq. 1: softmax row-wise "
                 "over the keys")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if not isinstance(node, ast.Call) or call_name(node) not in _DIM_CALLS:
                continue
            dims = [k.value for k in node.keywords if k.arg in ("dim", "axis", "dims")]
            if not dims:  # x.sum(-1), torch.softmax(x, -1), torch.cat(xs, 1): the last int positional
                dims = [a for a in node.args[-1:] if int_value(a) is not None]
            for dim in dims:
                value = int_value(dim)
                if value is not None:
                    new = {-1: -2, -2: -1, 0: 1, 1: 0}.get(value, value - 1)
                    yield Site((source.replace(dim, str(new)),), f"dim {value} -> {new}")


# ---- arguments -------------------------------------------------------------------------------------------

class SwapArgs(Operator):
    name = "swap_args"
    title = "two arguments of the same kind passed in each other's place"
    reference = ("PyTorch docs, torch.nn.init.normal_(tensor, mean=0.0, std=1.0): mean is the second parameter "
                 "(normal_(w, 0.02) sets the mean); HF transformers apply_rotary_pos_emb(q, k, cos, sin): cos and "
                 "sin swapped rotate by the wrong angle")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if not isinstance(node, ast.Call):
                continue
            args = node.args
            for a, b in zip(args, args[1:], strict=False):  # neighbours
                same_kind = type(a) is type(b) and isinstance(a, (ast.Name, ast.Attribute, ast.Subscript))
                if same_kind and ast.dump(a) != ast.dump(b):
                    yield Site((source.replace(a, source.text(b)), source.replace(b, source.text(a))),
                               f"{call_name(node)}({source.text(a)}, {source.text(b)}) swapped")


# ---- terms, masks, scales --------------------------------------------------------------------------------

class DropTerm(Operator):
    name = "drop_term"
    title = "a term, scale or normalization factor dropped from an expression"
    reference = ("Vaswani et al. 2017, Eq. 1: softmax(QK^T / sqrt(d_k)) (the scale is easy to drop); HF transformers "
                 "blog 'Fixing Gradient Accumulation' (Oct 2024): the loss was not divided by the right count; "
                 "Xiong et al. 2020: a residual dropped from a pre-LN block")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
                kept = node.left
                yield Site((source.replace(node, expr(kept)),), f"{ast.unparse(node)[:60]} -> {ast.unparse(kept)[:40]}")
                if isinstance(node.op, (ast.Add, ast.Mult)):  # a sum or product drops either side
                    yield Site((source.replace(node, expr(node.right)),),
                               f"{ast.unparse(node)[:60]} -> {ast.unparse(node.right)[:40]}")
            elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Mult, ast.Div)):
                yield Site((source.whole_lines(node.lineno, node.end_lineno, [source.indent(node.lineno) + "pass"]),),
                           f"{ast.unparse(node)[:60]} dropped")


class DropMask(Operator):
    name = "drop_mask"
    title = "a mask not applied"
    reference = ("HF transformers generate() warning 'The attention mask and the pad token id were not set' (padded "
                 "positions attended); HF docs 'attention_mask': 1 for tokens to attend, 0 for padding; "
                 "PyTorch docs F.scaled_dot_product_attention attn_mask")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if not isinstance(node, ast.Call):
                continue
            name = call_name(node)
            if name in ("masked_fill", "where") and len(node.args) >= 2:
                receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
                if name == "masked_fill" and receiver is not None:
                    yield Site((source.replace(node, expr(receiver)),), f"{ast.unparse(node)[:60]} -> unmasked")
                elif name == "where" and len(node.args) == 3:
                    yield Site((source.replace(node, expr(node.args[1])),), f"{ast.unparse(node)[:60]} -> unmasked")
            for kw in node.keywords:
                is_mask = kw.arg and "mask" in kw.arg
                if is_mask and not (isinstance(kw.value, ast.Constant) and kw.value.value is None):
                    yield Site((source.replace(kw.value, "None"),), f"{kw.arg}={ast.unparse(kw.value)[:40]} -> None")


# ---- comparisons -----------------------------------------------------------------------------------------

_NEGATED = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
            ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}


class NegateComparison(Operator):
    name = "negate_comparison"
    title = "a comparison negated or its boundary moved"
    reference = ("PyTorch docs, nn.MultiheadAttention: key_padding_mask True means IGNORED, the opposite of HF's "
                 "attention_mask (a mask built with the other convention is the negation); PyTorch docs torch.triu "
                 "diagonal=1: the boundary of a causal mask decides whether a token sees itself")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if isinstance(node, ast.Compare) and len(node.ops) == 1:
                for table, what in ((_NEGATED, "negated"), (_BOUNDARY, "boundary moved")):
                    new_op = table.get(type(node.ops[0]))
                    if new_op is not None:
                        new = copy.deepcopy(node)
                        new.ops = [new_op()]
                        yield Site((source.replace(node, expr(new)),), f"{ast.unparse(node)[:60]} {what}")
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                yield Site((source.replace(node, expr(node.operand)),), f"{ast.unparse(node)[:60]} negated")


# ---- constants -------------------------------------------------------------------------------------------

def _wrong_float(value: float) -> float | None:
    if value == 0 or value != value:
        return None
    if abs(value) < 1e-3:  # an epsilon: dropped
        return 0.0
    if value in (float("inf"), float("-inf")):
        return 0.0
    return value * 10 if abs(value) < 1 else value / 10


class WrongConstant(Operator):
    name = "wrong_constant"
    title = "a wrong constant (epsilon, fill value, scale, ignore index, flag)"
    reference = ("HF transformers modeling_attn_mask_utils._unmask_unattended: a fill of finfo.min or -inf in a "
                 "fully masked row NaNs SDPA; PyTorch forums 'IndexError: Target -100 is out of bounds' (the ignore "
                 "index must match the collator's); Kingma & Ba 2015, Adam's epsilon")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if isinstance(node, ast.Constant) and type(node.value) is float:
                new = _wrong_float(node.value)
                if new is not None:
                    yield Site((source.replace(node, repr(new)),), f"{node.value!r} -> {new!r}")
            elif isinstance(node, ast.Call) and call_name(node) == "float" and len(node.args) == 1 and \
                    isinstance(node.args[0], ast.Constant) and "inf" in str(node.args[0].value):
                yield Site((source.replace(node, "0.0"),), f"{ast.unparse(node)} -> 0.0")
            elif isinstance(node, ast.Attribute) and node.attr in ("min", "max") and \
                    isinstance(node.value, ast.Call) and call_name(node.value) == "finfo":
                yield Site((source.replace(node, "0.0"),), f"{ast.unparse(node)} -> 0.0")
            elif int_value(node) == -100 and isinstance(node, ast.UnaryOp):
                yield Site((source.replace(node, "0"),), "ignore index -100 -> 0")
            elif isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant) and \
                    type(node.value.value) is bool:
                flipped = not node.value.value
                yield Site((source.replace(node.value, str(flipped)),), f"{node.arg}={node.value.value} -> {flipped}")


# ---- casts, detach, contiguous, contexts ------------------------------------------------------------------

_CASTS = {"float", "half", "bfloat16", "double", "type_as", "to"}
_DTYPES = {"float32": "bfloat16", "float": "bfloat16", "float16": "float32", "bfloat16": "float32", "half": "float32"}


def _casts_dtype(call: ast.Call) -> bool:
    """``x.float()``, ``x.to(torch.float32)``, ``x.to(dtype=...)``, ``x.type_as(y)``: a cast, not a device move."""
    name = call_name(call)
    if name != "to":
        return name in _CASTS
    args = [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]
    return any("dtype" in ast.unparse(a) or ast.unparse(a).split(".")[-1] in _DTYPES for a in args)


class Cast(Operator):
    name = "cast"
    title = "a cast or upcast dropped, or the wrong dtype"
    reference = ("HF transformers GPT-2 option reorder_and_upcast_attn and LlamaRMSNorm's float32 variance: the "
                 "upcast is what keeps fp16/bf16 attention and norms finite; areal-project/AReaL#1292: AdamW "
                 "state inherits bf16 from the parameters")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _casts_dtype(node):
                yield Site((source.replace(node, expr(node.func.value)),), f"{ast.unparse(node)[:60]}: cast dropped")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" \
                    and node.attr in _DTYPES:
                new = f"torch.{_DTYPES[node.attr]}"
                yield Site((source.replace(node, new),), f"{ast.unparse(node)} -> {new}")


class DetachContiguous(Operator):
    name = "detach_contiguous"
    title = "a detach, clone or contiguous dropped, or a detach added"
    reference = ("PyTorch FAQ 'My model reports cuda runtime error(2): out of memory': 'Don't accumulate history "
                 "across your training loop' (total_loss += loss without detach); PyTorch RuntimeError 'view size "
                 "is not compatible with input tensor's size and stride ... Use .reshape(...)' after a transpose")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args and \
                    call_name(node) in ("detach", "contiguous", "clone"):
                yield Site((source.replace(node, expr(node.func.value)),), f"{ast.unparse(node)[:60]}: dropped")
            elif isinstance(node, ast.Return) and isinstance(node.value, (ast.Name, ast.Call, ast.BinOp)):
                value = node.value
                yield Site((source.replace(value, f"{expr(value)}.detach()"),),
                           f"return {ast.unparse(value)[:40]}: detached")


class DropContext(Operator):
    name = "drop_context"
    title = "a context manager dropped (no_grad, autocast, no_sync, a lock around the body)"
    reference = ("PyTorch docs, DistributedDataParallel.no_sync: without it every micro-batch all-reduces (and with it "
                 "on the last one too, gradients never sync); PyTorch AMP examples: the forward runs under autocast; "
                 "PyTorch docs torch.no_grad for evaluation")

    def sites(self, fn, source):
        for node in walk_body(fn):
            if isinstance(node, ast.With) and len(node.items) == 1 and node.body[0].lineno > node.lineno:
                body_first, body_last = node.body[0].lineno, node.body[-1].end_lineno
                outer, inner = source.indent(node.lineno), source.indent(body_first)
                lines = [outer + line[len(inner):] if line.startswith(inner) else line
                         for line in source.lines[body_first - 1 : body_last]]
                yield Site((source.whole_lines(node.lineno, body_last, lines),),
                           f"with {ast.unparse(node.items[0])[:50]}: dropped")


# ---- statements moved or removed ------------------------------------------------------------------------

_SIMPLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign)


class MoveStatement(Operator):
    name = "move_statement"
    title = "a statement moved across its neighbour, or out of its loop or context"
    reference = ("PyTorch docs 'How to adjust learning rate': scheduler.step() after optimizer.step() (UserWarning "
                 "'Detected call of lr_scheduler.step() before optimizer.step()'); PyTorch forums 'Where should I "
                 "place clip_grad_norm_?' (after backward, before step)")

    def sites(self, fn, source):
        for block in blocks(fn):
            for a, b in zip(block, block[1:], strict=False):  # neighbours
                if isinstance(a, _SIMPLE) and isinstance(b, _SIMPLE) and ast.dump(a) != ast.dump(b):
                    lines_a = source.lines[a.lineno - 1 : a.end_lineno]
                    lines_b = source.lines[b.lineno - 1 : b.end_lineno]
                    yield Site((source.whole_lines(a.lineno, b.end_lineno, lines_b + lines_a),),
                               f"'{ast.unparse(a)[:30]}' and '{ast.unparse(b)[:30]}' swapped")
        for node in walk_body(fn):
            if isinstance(node, (ast.With, ast.For)) and len(node.body) >= 2 and not getattr(node, "orelse", None):
                last = node.body[-1]
                if isinstance(last, _SIMPLE):
                    moved = [source.indent(node.lineno) + line.lstrip()
                             for line in source.lines[last.lineno - 1 : last.end_lineno]]
                    kept = source.lines[node.lineno - 1 : last.lineno - 1]
                    yield Site((source.whole_lines(node.lineno, last.end_lineno, kept + moved),),
                               f"'{ast.unparse(last)[:40]}' moved out of its block")


class RemoveCall(Operator):
    name = "remove_call"
    title = "a call whose effect matters removed (zero_grad, a scheduler step, set_epoch, a restore)"
    reference = ("PyTorch tutorial 'Zeroing out gradients in PyTorch' (gradients accumulate by default); PyTorch docs "
                 "DistributedSampler: 'calling set_epoch() at the beginning of each epoch ... is necessary'; "
                 "Lightning-AI/pytorch-lightning#2613: a resume that does not load the optimizer state")

    def sites(self, fn, source):
        for block in blocks(fn):
            for stmt in block:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                    replacement = [] if len(block) > 1 else [source.indent(stmt.lineno) + "pass"]
                    yield Site((source.whole_lines(stmt.lineno, stmt.end_lineno, replacement),),
                               f"{ast.unparse(stmt)[:60]} removed")


OPERATORS: dict[str, Operator] = {op.name: op for op in (
    OffByOne(), WrongDim(), SwapArgs(), DropTerm(), DropMask(), NegateComparison(), WrongConstant(), Cast(),
    DetachContiguous(), DropContext(), MoveStatement(), RemoveCall())}
