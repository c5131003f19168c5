"""Each mutation operator writes its class of bug, and only there: on a small hand-written function, every
operator's mutants are exactly the edits its class describes (a no-op or a wrong operator fails here)."""

from __future__ import annotations

import ast
import textwrap

import pytest

from faultbench.faults.mutants.operators import OPERATORS, Source, apply

SAMPLE = textwrap.dedent('''
    def step(model, optimizer, scheduler, batch, mask, scale):
        """A docstring the operators leave alone: x[0] < 1."""
        optimizer.zero_grad()
        with torch.autocast("cpu"):
            logits = model(batch[:, :-1])
            model.tick()
        scores = torch.softmax(logits.float() * scale, dim=-1)
        scores = scores.masked_fill(mask, float("-inf"))
        scores = rescale(scores, scale)
        loss = cross_entropy(logits, batch[:, 1:], ignore_index=-100, reduce=True)
        if loss.item() > 1e-8:
            loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.detach().contiguous()
''').strip("\n")

# operator -> mutated lines every one of its sites must include one of (each line as the mutant writes it)
EXPECTED = {
    "off_by_one": {"logits = model(batch[:, :0])", "logits = model(batch[:, :-2])",
                   "loss = cross_entropy(logits, batch[:, 2:], ignore_index=-100, reduce=True)",
                   "loss = cross_entropy(logits, batch[:, 0:], ignore_index=-100, reduce=True)"},
    "wrong_dim": {"scores = torch.softmax(logits.float() * scale, dim=-2)"},
    "swap_args": {"scores = rescale(scale, scores)"},
    "drop_term": {"scores = torch.softmax(logits.float(), dim=-1)", "scores = torch.softmax(scale, dim=-1)"},
    "drop_mask": {"scores = scores"},
    "negate_comparison": {"if (loss.item() <= 1e-08):", "if (loss.item() >= 1e-08):"},
    "wrong_constant": {"scores = scores.masked_fill(mask, 0.0)", "if loss.item() > 0.0:",
                       "loss = cross_entropy(logits, batch[:, 1:], ignore_index=0, reduce=True)",
                       "loss = cross_entropy(logits, batch[:, 1:], ignore_index=-100, reduce=False)"},
    "cast": {"scores = torch.softmax(logits * scale, dim=-1)"},
    "detach_contiguous": {"return loss.contiguous()", "return loss.detach()",
                          "return loss.detach().contiguous().detach()"},
    "drop_context": {'with torch.autocast("cpu"):'},  # the body stays, one level out (its own test below)
    "move_statement": set(),  # it changes the order of lines, not their text: its own test below
    "remove_call": {"model.tick()", "optimizer.zero_grad()", "loss.backward()", "optimizer.step()",
                    "scheduler.step()"},
}


def _mutants(op_name: str) -> list[tuple[list[str], list[str]]]:
    """(removed lines, added lines) of every site of the operator on SAMPLE."""
    source = Source(SAMPLE)
    fn = ast.parse(SAMPLE).body[0]
    out = []
    for site in OPERATORS[op_name].sites(fn, source):
        mutated = apply(source, site.edits, fn.lineno, fn.end_lineno)
        ast.parse("\n".join(mutated))  # every mutant is valid Python
        before, after = [s.strip() for s in source.lines], [s.strip() for s in mutated]
        out.append(([s for s in before if s not in after], [s for s in after if s not in before]))
    return out


def test_every_operator_is_tested():
    assert set(EXPECTED) == set(OPERATORS)


@pytest.mark.parametrize("op_name", sorted(OPERATORS))
def test_the_operator_writes_its_class_of_bug(op_name):
    """Each site changes the code, and together the sites write every expected line."""
    mutants = _mutants(op_name)
    assert mutants, f"{op_name} found no site in the sample"
    assert all(removed or added for removed, added in mutants) or op_name == "move_statement"
    written = {line for _, added in mutants for line in added}
    if op_name in ("remove_call", "drop_context"):  # they remove lines: the removed ones are the class
        written = {line for removed, _ in mutants for line in removed}
    assert EXPECTED[op_name] <= written, (op_name, EXPECTED[op_name] - written)


@pytest.mark.parametrize("op_name", sorted(OPERATORS))
def test_the_docstring_and_header_are_never_touched(op_name):
    source = Source(SAMPLE)
    fn = ast.parse(SAMPLE).body[0]
    for site in OPERATORS[op_name].sites(fn, source):
        assert site.lines[0] > fn.body[0].end_lineno, (op_name, site.label)


def test_a_statement_swap_a_call_removal_and_a_dropped_context_do_what_they_say():
    source = Source(SAMPLE)
    fn = ast.parse(SAMPLE).body[0]
    texts = ["\n".join(apply(source, s.edits, fn.lineno, fn.end_lineno))
             for s in OPERATORS["move_statement"].sites(fn, source)]
    assert any(t.index("scheduler.step()") < t.index("optimizer.step()") for t in texts)  # two neighbours swapped
    assert any("\n    model.tick()" in t for t in texts)  # the last statement moved out of the autocast block
    removed = {r[0] for r, _ in _mutants("remove_call")}
    assert removed == {"model.tick()", "optimizer.zero_grad()", "loss.backward()", "optimizer.step()",
                       "scheduler.step()"}
    (dropped,) = _mutants("drop_context")
    assert dropped[0] == ['with torch.autocast("cpu"):']
    site = next(OPERATORS["drop_context"].sites(fn, source))
    text = apply(source, site.edits, fn.lineno, fn.end_lineno)
    assert "    logits = model(batch[:, :-1])" in text  # the body, one level out
