"""Black-box checks of a crash's place, of graphs a loop keeps alive, of the model's build and of probes in full
precision: a crash localized by the phase of the step it interrupted and by replaying its forward; a loss
kept as a tensor found within a few steps while a loop variable holding the last loss is fine; a model built unlike
the user's known-good runs (an untied head) reported as the model's, above the optimizer that then differs too; the
probes' full-precision round exact both ways, and a decode-position bug found under bf16 autocast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import faultbench
from faultbench.detectors.blackbox import probes
from tests.watch.test_lm import llama
from tests.watch.test_monitors import STEPS, Tok, _batches, _golden, _parts
from tests.watch.test_probes import hf_trainer_run  # noqa: F401 - the fixture, shared with the probe tests

VOCAB, WIDTH, LENGTH = 16, 8, 6


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A user's loss with nanoGPT's ignore value (-1) fed labels that mark ignored slots with -100."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1)


def rope_at(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return table[positions]


class TinyLM(torch.nn.Module):
    """Embedding, a position table of ``table_rows`` rows looked up by ``rope_at``, a head: ``model(idx) -> logits``.
    ``reshape_bug``: its forward reshapes to a wrong shape (a crash in a function whose name says nothing)."""

    def __init__(self, table_rows: int = LENGTH, reshape_bug: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.head = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB)
        self.table = torch.nn.Parameter(torch.randn(table_rows, WIDTH))
        self.reshape_bug = reshape_bug

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + rope_at(self.table, torch.arange(idx.shape[1]))
        if self.reshape_bug:
            x = x.view(idx.shape[0], -1, WIDTH + 1)
        return self.head(x)


def crash_findings(model: torch.nn.Module, labels: torch.Tensor) -> list:
    """bb_crash_site's findings on a one-step loop over a (2, LENGTH) batch that raises."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = faultbench.watch(model, optimizer, report=False, detectors=["bb_crash_site"])
    with pytest.raises((IndexError, RuntimeError)), w:
        idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
        lm_loss(model(idx), labels).backward()
        optimizer.step()
    assert w.errors == {}
    return w.findings


def test_a_crash_is_localized_by_the_phase_it_interrupted_and_a_replay_of_the_forward():
    labels = torch.ones(2, LENGTH, dtype=torch.long)
    labels[:, -1] = -100  # the model's forward returned; the loop's own loss raises (its ignore value is -1)
    top = crash_findings(TinyLM(), labels)[0]
    assert (top.subsystem, top.where, top.evidence["phase"]) == ("loss", "loss", "backward")
    assert "Target -100" in top.message
    # a position table one row short: the replayed forward raises at the batch's length and runs on half of it
    top = crash_findings(TinyLM(table_rows=LENGTH - 1), labels.clamp_min(0))[0]
    assert (top.subsystem, top.evidence["phase"], top.evidence["length"]) == ("position", "forward", LENGTH)


def test_a_crash_the_replayed_forward_repeats_at_any_length_is_the_models():
    top = crash_findings(TinyLM(reshape_bug=True), torch.ones(2, LENGTH, dtype=torch.long))[0]
    assert (top.subsystem, top.where) == ("model", "") and "model's own forward" in top.message


class Masked(torch.nn.Module):
    """``model(idx, attention_mask=None) -> logits`` whose mask handling fails on the mask it is given; ``inner``: a
    submodule that raises whatever it gets (then the model's code is at fault)."""

    def __init__(self, inner_raises: bool = False):
        super().__init__()
        self.wte, self.head = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB)
        self.block = Raising() if inner_raises else torch.nn.Identity()

    def forward(self, idx, attention_mask=None):
        x = self.block(self.wte(idx))
        if attention_mask is not None:
            x = x * attention_mask[:, :, None, None]  # a (B, T) mask broadcast one dimension too far: raises
        return self.head(x)


class Raising(torch.nn.Module):
    def forward(self, x):
        return x.view(-1, WIDTH + 1)


@pytest.mark.parametrize(("inner", "expected"), [(False, ("mask", "")), (True, ("model", "block"))])
def test_a_forward_that_runs_without_its_mask_is_a_mask_crash_else_the_innermost_module(inner, expected):
    model = Masked(inner)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = faultbench.watch(model, optimizer, report=False, detectors=["bb_crash_site"])
    with pytest.raises(RuntimeError), w:
        idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
        model(idx, attention_mask=torch.ones_like(idx)).sum().backward()
    assert [(f.subsystem, f.where) for f in w.findings] == [expected]


class Signal(torch.nn.Module):
    """Turns what it is given into a (B, T, WIDTH) signal with a reshape that fits no batch: raises at any length."""

    def forward(self, x, given, mask=None):
        return x + given.float().view(-1, WIDTH + 1).sum()


class Positioned(torch.nn.Module):
    """``model(idx) -> logits`` whose submodule ``signal`` gets the positions it computes (``arange`` over the
    columns), or the token ids, or nothing but the hidden state."""

    def __init__(self, given: str):
        super().__init__()
        self.wte, self.head, self.signal, self.given = (torch.nn.Embedding(VOCAB, WIDTH),
                                                       torch.nn.Linear(WIDTH, VOCAB), Signal(), given)

    def forward(self, idx):
        x = self.wte(idx)
        positions = torch.arange(idx.shape[1])[None].expand_as(idx)
        if self.given == "positions and mask":  # a whole layer: a causal mask passed on beside the positions
            return self.head(self.signal(x, positions, mask=torch.ones(idx.shape[1], idx.shape[1]).tril().bool()))
        return self.head(self.signal(x, {"positions": positions, "ids": idx, "hidden": x}[self.given]))


@pytest.mark.parametrize(("given", "expected"), [("positions", ("position", "signal")), ("ids", ("model", "signal")),
                                                 ("hidden", ("model", "signal")),
                                                 ("positions and mask", ("model", "signal"))])
def test_a_crash_in_a_module_given_the_positions_is_a_position_crash(given, expected):
    """The replay raises at any length, with or without a mask: the innermost module's inputs decide. One given an
    integer tensor counting along the columns turns positions into a signal (position); one given the token ids or
    the hidden state, or the positions beside a mask (a whole layer passing both on), is the model's."""
    top = crash_findings(Positioned(given), torch.ones(2, LENGTH, dtype=torch.long))[0]
    assert (top.subsystem, top.where) == expected


@pytest.mark.parametrize(("phase_of", "expected"), [
    ("step", ("optimizer", "optimizer")), ("between steps", ("data", "batch")), ("evaluation", ("eval", "eval")),
    ("generation", ("model", "generate"))])
def test_a_crash_outside_any_forward_is_localized_by_the_phase_it_interrupted(phase_of, expected):
    """The loop raises in its own code (no library frame): after the optimizer's step began, between steps, after an
    evaluation forward, and after a decode step's (one token a row)."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = faultbench.watch(model, optimizer, report=False, detectors=["bb_crash_site"])
    with pytest.raises(ValueError), w:
        if phase_of == "step":  # a hook of the user's, after the watch's: inside the optimizer's step
            optimizer.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(ValueError("a user's step hook")))
        idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        optimizer.step()
        if phase_of in ("evaluation", "generation"):  # a decode step feeds one token a row
            with torch.no_grad():
                model(idx[:, :1] if phase_of == "generation" else idx)
        raise ValueError("the loop's own bookkeeping")
    assert [(f.subsystem, f.where) for f in w.findings] == [expected]
    assert w.findings[0].evidence["phase"] == phase_of


def test_a_crash_in_code_the_scheduler_called_is_the_schedules():
    """A LambdaLR whose lambda (the user's) raises at step 3: the scheduler was running further out on the stack, so
    the crash is the optimizer's (its schedule), not the next batch's as a crash between steps would be."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (3 - step))  # 1/0 at step 3
    w = faultbench.watch(model, optimizer, scheduler=schedule, report=False, detectors=["bb_crash_site"])
    with pytest.raises(ZeroDivisionError), w:
        idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
        for _ in range(4):
            F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
    assert [(f.subsystem, f.where) for f in w.findings] == [("optimizer", "scheduler")]


def test_a_crash_inside_gradient_clipping_is_the_optimizers_not_the_losss():
    """Between the backward and the step (where a crash of the loop's own code is the loss's), torch's clipping
    raising on a non-finite norm it was told to refuse is the optimizer side's."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = faultbench.watch(model, optimizer, report=False, detectors=["bb_crash_site"])
    with pytest.raises(RuntimeError), w:
        idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
        (F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()) * float("inf")).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert [(f.subsystem, f.where) for f in w.findings] == [("optimizer", "gradient clipping")]


def _save(model, optimizer) -> dict:
    """A user's checkpoint whose last part raises (an RNG state it cannot serialize, say)."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    raise TypeError(f"cannot serialize the checkpoint's extra state ({len(state)} parts written)")


def test_a_crash_while_the_loop_saves_or_restores_its_state_is_the_checkpoints():
    """Between steps, a crash after the loop read the model's and optimizer's state is a save's; a loop watched
    from a restored step that raises before its first forward is a resume's; a plain crash between steps is not."""
    idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
    for case, expected in (("save", "checkpoint"), ("resume", "checkpoint"), ("between steps", "data")):
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        w = faultbench.watch(model, optimizer, report=False, detectors=["bb_crash_site"],
                             step=5 if case == "resume" else 0)
        with pytest.raises(TypeError), w:
            if case != "resume":
                F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
                optimizer.step()
            if case == "between steps":
                raise TypeError("the loop's own bookkeeping")
            _save(model, optimizer)
        assert [f.subsystem for f in w.findings] == [expected], case


def _framework_function(path: str, name: str):
    """A function whose frames say it is ``name`` in the installed file ``path`` (a framework's component)."""
    scope: dict = {}
    exec(compile(f"def {name}():\n    raise OSError('the component failed')\n", path, "exec"), scope)  # noqa: S102
    return scope[name]


@pytest.mark.parametrize(("path", "name", "expected"), [
    ("/env/site-packages/transformers/trainer.py", "_save_checkpoint", "checkpoint"),
    ("/env/site-packages/transformers/trainer.py", "evaluation_loop", "eval"),
    ("/env/site-packages/accelerate/data_loader.py", "skip_first_batches", "checkpoint"),
    ("/env/site-packages/accelerate/data_loader.py", "__iter__", "data"),
    ("/env/site-packages/transformers/generation/utils.py", "_update_model_kwargs_for_generation", "position"),
    ("/env/site-packages/transformers/generation/utils.py", "_sample", "model"),
    ("/env/site-packages/transformers/trainer.py", "_inner_training_loop", "data"),  # no component: the phase's
])
def test_a_crash_in_a_training_frameworks_component_is_that_components(path, name, expected):
    """Between steps, the innermost framework component on the stack names the crash; a frame of the framework's
    loop itself is no component (the phase answers: between steps, the next batch)."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = faultbench.watch(model, optimizer, report=False, detectors=["bb_crash_site"])
    idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
    with pytest.raises(OSError), w:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        optimizer.step()
        _framework_function(path, name)()
    assert [f.subsystem for f in w.findings] == [expected]


def test_a_crash_in_an_evaluation_after_training_reaches_the_watch_still_watching_evaluations():
    """As ``trainer.evaluate()`` after ``train()``: the watch exited, keeps watching evaluations, and is handed the
    evaluation's exception (``Watch.crashed``); a watch no longer watching evaluations ignores it."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = faultbench.watch(model, optimizer, report=False, detectors=["bb_crash_site"])
    idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
    with w:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        optimizer.step()
    w.watch_evaluations()
    for _ in range(2):  # watching evaluations, then not: the second crash adds nothing
        try:
            _framework_function("/env/site-packages/transformers/trainer.py", "evaluation_loop")()
        except OSError as exc:
            w.crashed(exc)
        assert [(f.subsystem, f.where) for f in w.findings] == [("eval", "transformers.trainer.evaluation_loop")]
        w.stop_watching_evaluations()


def test_a_state_read_by_a_detector_is_not_a_checkpoint():
    """A detector may copy the model's state inside its hook (``Watch._firing`` counts those running): the loop's
    phase stays; the loop's own read between steps is a checkpoint's, inside a step it is not."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = faultbench.watch(model, optimizer, report=False)
    idx = torch.arange(2 * LENGTH).view(2, LENGTH) % VOCAB
    with w:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        w._firing += 1  # as inside a detector's hook
        model.state_dict()
        w._firing -= 1
        assert w.ctx.phase == "backward"
        model.state_dict()  # the loop's own read
        assert w.ctx.phase == "backward"  # inside a step, a state read is not a checkpoint either
        optimizer.step()
        model.state_dict()
        assert w.ctx.phase == "checkpoint"


def _loop(parts, detectors, *, golden=None, steps=STEPS, keep_losses=False):
    """The usual loop (test_monitors' batches) under a watch with ``detectors``; ``keep_losses``: the loop logs each
    step's loss as the tensor itself (its graph with it)."""
    model, optimizer, scheduler = parts
    logged = []
    w = faultbench.watch(model, optimizer, scheduler=scheduler, tokenizer=Tok(), golden=golden, report=False,
                         detectors=detectors)
    with w:
        for x, y in _batches(0, n=steps):
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            logged.append(loss if keep_losses else loss.item())
    assert w.errors == {} and not w.not_applicable
    return w


@pytest.mark.parametrize("keep", [False, True], ids=["item", "tensor"])
def test_a_loss_kept_with_its_graph_is_found_two_steps_later(keep):
    w = _loop(_parts(0), ["bb_graphs_released"], steps=5, keep_losses=keep)
    found = [(f.subsystem, f.where, f.step, f.evidence["step"]) for f in w.findings]
    # the last step's loss stays in the loop's variable until the next forward: not a retention
    assert found == ([("optimizer", "loss", 3, 1)] if keep else [])


def test_golden_records_the_models_parameters():
    model = _parts(0)[0]
    distinct = list(model.parameters())
    assert _golden()["model"] == {"params": len(distinct), "numel": sum(p.numel() for p in distinct),
                                  "shared": ["lm_head.weight"]}


def test_a_model_built_unlike_the_golden_is_the_models_finding_above_the_optimizers():
    detectors = ["bb_golden_model", "bb_golden_config"]
    assert _loop(_parts(0), detectors, golden=_golden(), steps=2).findings == []
    model, _, _ = _parts(0)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # the head untied
    optimizer = model.configure_optimizers(0.1, 3e-3, (0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    w = _loop((model, optimizer, scheduler), detectors, golden=_golden(), steps=2)
    assert [(f.detector, f.subsystem) for f in w.findings] == [("bb_golden_model", "model"),
                                                              ("bb_golden_config", "optimizer")]
    top = w.findings[0]
    assert top.where == "lm_head" and top.evidence["model"]["shared"] == [] and "lm_head.weight" in top.message


def test_the_full_precision_round_restores_the_model_exactly():
    model = llama(0)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with probes.full_precision(model):
        assert {p.dtype for p in model.parameters()} == {torch.float64}
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads)


def test_a_decode_position_bug_hidden_by_bf16_rounding_is_found_in_full_precision(hf_trainer_run):  # noqa: F811
    assert ("bb_cache_consistency", "position", "model.layers.0.self_attn") in \
        hf_trainer_run("hf_cache_positions_ignore_past", "bf16")
