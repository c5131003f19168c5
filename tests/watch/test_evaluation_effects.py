"""``bb_eval_side_effects``: evaluation trains nothing and leaves training as it found it (contracts
``eval.state.no-side-effects`` and ``eval.isolation.no-update``). Found on small loops whose evaluation steps the
optimizer, runs a backward, changes weights in place (an EMA swap never undone, a decay applied per batch) or steps
the scheduler per batch; silent on correct loops: evaluation between steps and in the middle of gradient
accumulation, greedy decoding (with and without a KV cache), a GradScaler and a scheduler, nanoGPT's estimate_loss
on the training split, EMA weights swapped in and restored, the best weights loaded after the last evaluation, a
plateau scheduler and a manual lr set after evaluation, an evaluation between a backward and its clipped step."""

from __future__ import annotations

import copy

import torch

import faultbench
from faultbench import targets
from tests.watch.nanogpt import TrainConfig, build, get_batch, train

torch.set_num_threads(1)
targets.get("hf")  # sets HF_HUB_OFFLINE before transformers is imported
import transformers  # noqa: E402

ID = "bb_eval_side_effects"
BLOCK = 16


# ---- a small loop and its evaluations
@torch.no_grad()
def evaluate(model, batches: int = 2) -> float:
    """A correct evaluation: eval mode, no grad, the mode restored."""
    was = model.training
    model.eval()
    losses = [float(model(*get_batch("val", 4, BLOCK))[1]) for _ in range(batches)]
    model.train(was)
    return sum(losses) / len(losses)


@torch.no_grad()
def decode(model, new_tokens: int = 6) -> torch.Tensor:
    """Greedy decoding, one no-grad forward per new token."""
    was = model.training
    model.eval()
    idx = get_batch("val", 2, 4)[0]
    for _ in range(new_tokens):
        logits, _ = model(idx[:, -BLOCK:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], 1)
    model.train(was)
    return idx


def loop(evaluation=None, *, steps: int = 6, every: int = 2, accum: int = 2, amp: bool = False, scheduler=None,
         mid_accumulation=None, before_step=None, ema: bool = False, detectors=(ID,)):
    """A nanoGPT-model loop: ``accum`` micro-batches per step, clipped, through a GradScaler (enabled with ``amp``),
    zero_grad after the step, ``scheduler(optimizer)`` stepped after it. Every ``every`` steps: ``evaluation(ctx)``
    after the step, ``mid_accumulation(ctx)`` after the first micro-batch, ``before_step(ctx)`` between the last
    backward and the clip; ``ctx``: {"model", "optimizer", "scheduler", "scaler", "state"}; with ``ema``,
    state["ema"] is an EMA of the weights, updated after every step. -> the Watch."""
    model, optimizer, scaler = build(TrainConfig(amp=amp), seed=0)
    sched = scheduler(optimizer) if scheduler else None
    ctx = {"model": model, "optimizer": optimizer, "scheduler": sched, "scaler": scaler, "state": {}}
    if ema:
        ctx["state"]["ema"] = [p.detach().clone() for p in model.parameters()]
    with faultbench.watch(model, optimizer, scheduler=sched, scaler=scaler, detectors=list(detectors),
                          report=False) as w:
        for it in range(steps):
            due = (it + 1) % every == 0
            for micro in range(accum):
                _, loss = model(*get_batch("train", 4, BLOCK))
                scaler.scale(loss / accum).backward()
                if due and micro == 0 and mid_accumulation:
                    mid_accumulation(ctx)
            if due and before_step:
                before_step(ctx)
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if sched is not None and not isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step()
            if "ema" in ctx["state"]:
                _ema_update(model, ctx["state"]["ema"])
            if due and evaluation:
                evaluation(ctx)
    return w


def _ema_update(model, ema: list[torch.Tensor], decay: float = 0.8) -> None:
    with torch.no_grad():
        for shadow, p in zip(ema, model.parameters(), strict=True):
            shadow.mul_(decay).add_(p.detach(), alpha=1 - decay)


def ema_loop(evaluation, steps: int = 8, **kwargs):
    """``loop`` keeping an EMA of the weights (seeded at the start, updated after every step)."""
    return loop(evaluation, steps=steps, ema=True, **kwargs)


def _swap(model, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy ``tensors`` into the parameters (``.data``, as EMA helpers do); returns the previous weights."""
    saved = [p.detach().clone() for p in model.parameters()]
    for p, t in zip(model.parameters(), tensors, strict=True):
        p.data.copy_(t)
    return saved


def mine(w) -> list:
    assert ID not in w.errors, w.errors
    return [f for f in w.findings if f.detector == ID]


def _messages(findings) -> list[str]:
    return [f"[{f.subsystem}] {f.where}: {f.message}" for f in findings]


def found(w, words: str):
    """The detector's finding whose message holds ``words``; it is in subsystem "eval", where "eval"."""
    findings = mine(w)
    hits = [f for f in findings if words in f.message]
    assert hits, _messages(findings)
    assert all((f.subsystem, f.where) == ("eval", "eval") for f in findings)
    return hits[0]


# ---- evaluations that break the contracts
def test_an_evaluation_that_steps_the_optimizer_is_found():
    """The evaluation reuses the training step on validation batches: eval mode, a backward, optimizer.step()."""
    def trains_on_val(ctx):
        model, optimizer = ctx["model"], ctx["optimizer"]
        model.eval()
        for _ in range(2):
            _, loss = model(*get_batch("val", 4, BLOCK))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        model.train()

    w = loop(trains_on_val)
    finding = found(w, "optimizer.step() ran during evaluation")
    assert finding.evidence["eval_forwards"] >= 1 and finding.confidence >= 0.8


def test_a_backward_inside_the_evaluation_is_found():
    """The evaluation computes its loss with grad enabled and calls backward (a gradient-norm diagnostic), no step:
    the next training step steps with the validation gradients added."""
    def diagnoses(ctx):
        model = ctx["model"]
        model.eval()
        _, loss = model(*get_batch("val", 4, BLOCK))
        loss.backward()
        ctx["state"]["val_grad_norm"] = float(torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]))
        model.train()

    w = loop(diagnoses)
    finding = found(w, "a backward ran during evaluation")
    assert finding.evidence["new"] == finding.evidence["params"] > 0 and not finding.evidence["mid_accumulation"]
    assert "at the next training forward" in finding.message


def test_a_backward_inside_an_evaluation_in_the_middle_of_accumulation_is_found():
    """In the middle of gradient accumulation the gradients are there before the evaluation: its backward changes
    them."""
    def diagnoses(ctx):
        model = ctx["model"]
        model.eval()
        model(*get_batch("val", 4, BLOCK))[1].backward()
        model.train()

    finding = found(loop(mid_accumulation=diagnoses), "a backward ran during evaluation")
    assert finding.evidence["changed"] > 0 and finding.evidence["mid_accumulation"]


def test_ema_weights_swapped_in_and_never_swapped_back_are_found():
    """The evaluation measures the raw weights, then swaps the EMA weights in to measure them and never restores
    the raw ones: training continues from the EMA weights."""
    def raw_then_ema(ctx):
        model = ctx["model"]
        evaluate(model, batches=1)
        _swap(model, ctx["state"]["ema"])  # the bug: the returned raw weights are dropped
        evaluate(model, batches=1)

    w = ema_loop(raw_then_ema)
    finding = found(w, "evaluation changed the weights")
    assert finding.evidence["params"] == finding.evidence["of"] == len(list(build()[0].parameters()))
    assert finding.evidence["first"]  # a module path of the model


def test_a_weight_changed_in_place_during_evaluation_is_found():
    """A decay applied to a weight after each evaluation batch (in place, no optimizer involved)."""
    def decays(ctx):
        model = ctx["model"]
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                model(*get_batch("val", 4, BLOCK))
                model.transformer.h[1].mlp.c_fc.weight.mul_(0.9)
        model.train()

    finding = found(loop(decays, steps=8), "evaluation changed the weights")
    assert finding.evidence["params"] == 1 and finding.evidence["first"] == "transformer.h.1.mlp.c_fc"


def test_a_scheduler_stepped_per_evaluation_batch_is_found():
    """A shared ``run_batches`` steps the scheduler after every batch, evaluation batches included."""
    def run_batches(ctx):
        model = ctx["model"]
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                model(*get_batch("val", 4, BLOCK))
                ctx["scheduler"].step()
        model.train()

    cosine = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)  # noqa: E731
    finding = found(loop(run_batches, scheduler=cosine), "the LR scheduler stepped 3 times during evaluation")
    before, after = finding.evidence["lrs"]
    assert before != after


# ---- correct loops: silent
def test_evaluation_between_steps_with_a_scaler_and_a_scheduler_is_silent():
    warmup = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))  # noqa: E731
    w = loop(lambda ctx: (evaluate(ctx["model"]), decode(ctx["model"])), amp=True, scheduler=warmup, steps=8)
    assert mine(w) == [], _messages(mine(w))
    detector = next(d for d in w.detectors if d.id == ID)
    assert detector._checks == 4 and not detector._anchoring  # four evaluations checked, no per-step anchor


def test_a_loop_that_never_evaluates_costs_no_fingerprint():
    w = loop(None, steps=4)
    detector = next(d for d in w.detectors if d.id == ID)
    assert mine(w) == [] and detector._checks == 0 and not detector._anchoring


def test_evaluation_in_the_middle_of_gradient_accumulation_is_silent():
    w = loop(mid_accumulation=lambda ctx: (evaluate(ctx["model"]), decode(ctx["model"], 3)), accum=3, amp=True)
    assert mine(w) == [], _messages(mine(w))


def test_evaluation_between_the_backward_and_a_clipped_unscaled_step_is_silent():
    w = loop(before_step=lambda ctx: evaluate(ctx["model"]), amp=True)
    assert mine(w) == [], _messages(mine(w))


def test_evaluation_mode_without_no_grad_and_no_backward_is_silent():
    """Forwards in eval mode with grad enabled (bb_eval_mode's business): nothing trains."""
    def no_no_grad(ctx):
        model = ctx["model"]
        model.eval()
        model(*get_batch("val", 4, BLOCK))
        model.train()

    w = loop(no_no_grad)
    assert mine(w) == [], _messages(mine(w))


def test_ema_weights_swapped_in_for_evaluation_and_restored_are_silent():
    """torch_ema's ``average_parameters()``: swap in, evaluate, restore; here the raw weights are then decoded from
    in the same evaluation, so the weights differ between its forwards: the per-step anchor tells the restore."""
    def ema_eval(ctx):
        model = ctx["model"]
        raw = _swap(model, ctx["state"]["ema"])
        evaluate(model, batches=1)
        _swap(model, raw)
        decode(model, 3)

    w = ema_loop(ema_eval, steps=10)
    assert mine(w) == [], _messages(mine(w))
    assert next(d for d in w.detectors if d.id == ID)._anchoring  # the restore was judged against the anchor


def test_raw_then_ema_evaluation_restored_at_the_end_is_silent():
    def both(ctx):
        model = ctx["model"]
        evaluate(model, batches=1)
        raw = _swap(model, ctx["state"]["ema"])
        evaluate(model, batches=1)
        _swap(model, raw)

    w = ema_loop(both)
    assert mine(w) == [], _messages(mine(w))


def test_rolling_back_to_the_best_weights_after_evaluation_is_silent():
    """Early stopping's restore: after the evaluation (and a plateau scheduler stepped once on its loss) the loop
    rolls back to the best weights and trains on from them, and loads them again before the watch exits."""
    model, optimizer, _ = build(TrainConfig(), seed=0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    best = None
    with faultbench.watch(model, optimizer, scheduler=sched, detectors=[ID], report=False) as w:
        for it in range(10):
            model(*get_batch("train", 4, BLOCK))[1].backward()
            optimizer.step()
            optimizer.zero_grad()
            if it % 2:
                sched.step(evaluate(model))
                decode(model, 2)
                if best is not None and it % 4 == 3:  # "worse than the best": roll back
                    model.load_state_dict(best)
                best = copy.deepcopy(model.state_dict())
        evaluate(model)
        model.load_state_dict(best)
    assert mine(w) == [], _messages(mine(w))


def test_a_manual_lr_set_after_evaluation_is_silent():
    """nanoGPT's order with the evaluation at the end of an iteration: the next iteration sets its lr first."""
    model, optimizer, _ = build(TrainConfig(), seed=0)
    with faultbench.watch(model, optimizer, detectors=[ID], report=False) as w:
        for it in range(6):
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * (it + 1)
            model(*get_batch("train", 4, BLOCK))[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # zeros, not None: no gradient is "left"
            evaluate(model)
    assert mine(w) == [], _messages(mine(w))


def test_nanogpt_estimate_loss_on_the_training_split_with_every_detector_is_silent():
    """nanoGPT's loop: estimate_loss evaluates the train split on purpose, every black-box detector watches (their
    probes are no evaluation), an enabled GradScaler."""
    out = train(TrainConfig(amp=True, eval_interval=4), seed=0, steps=12,
                watch=lambda m, o, s: faultbench.watch(m, o, scaler=s, report=False))
    w = out["watch"]
    assert len(out["evals"]) == 2 and mine(w) == [], _messages(mine(w))
    assert ID not in w.not_applicable


def test_generation_with_a_kv_cache_between_steps_is_silent():
    """A tiny Llama: training steps with labels, greedy ``generate`` (DynamicCache) and an evaluation between."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=6)
    with faultbench.watch(model, optimizer, scheduler=sched, detectors=[ID], report=False) as w:
        for it in range(6):
            ids = torch.randint(1, 64, (4, 12))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            sched.step()
            optimizer.zero_grad()
            if it % 2:
                model.eval()
                with torch.no_grad():
                    model(input_ids=ids, labels=ids)
                    model.generate(ids[:2, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
                model.train()
    assert mine(w) == [], _messages(mine(w))
