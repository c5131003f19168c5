"""Speed of the HF target's train step with faultbench's machinery against plain Trainer and a plain loop.

    python -m benchmarks.hf_perf [--recipe fp32] [--steps 100] [--repeats 2] [--warmup 5] [--json]

Three ways to train the same seeded ``LlamaForCausalLM`` on the same batches, single-threaded (they
reach bit-identical weights: tests/hf/test_hf_perf.py):
  (A) faultbench  ``targets.hf.hooks.train`` as a bench case runs it: ``StepTrainer`` (its batch
                  interception), the ``StepRecorder`` callback (step records) and an empty detector suite;
  (B) trainer     transformers' own ``Trainer``, the same ``TrainingArguments``, model, dataset and
                  collator, and no faultbench code;
  (C) loop        a hand-written loop: a ``DataLoader`` with the same sampler seed and collator, fused
                  AdamW with Trainer's decay groups, ``get_cosine_schedule_with_warmup``, clipping,
                  ``model(**batch, num_items_in_batch=n).loss.backward()``.
Each arm is a fresh run of the recipe with ``steps`` optimizer steps in a thread of its own; the three
run in lock step, one thread at a time, switching at every step start (``LockStep``), so the three
steps of a round run within a few hundred ms of each other in one of the six orders, and load from
other processes hits the three alike. A step's time runs from one step start to the next (data,
forward, backward, clipping, optimizer, schedule, logging and callbacks: everything a step costs), by
the wall clock and by the thread's CPU clock. Reported: per arm the median and min step time, and per
pair the median of the round-by-round ratios. Target: A/B <= 1.05 (wall, round by round).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import tempfile
import threading
import time

import torch

from faultbench import targets

targets.get("hf")  # HF_HUB_OFFLINE before transformers is imported

from transformers import (  # noqa: E402
    DataCollatorForLanguageModeling,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    get_cosine_schedule_with_warmup,
)

from faultbench.detectors.api import RunContext  # noqa: E402
from faultbench.harness.suite import Suite  # noqa: E402
from faultbench.targets.hf.data import TextDataset, load_texts, wrap_tokenizer  # noqa: E402
from faultbench.targets.hf.hooks import train  # noqa: E402
from faultbench.targets.hf.modeling import build_model  # noqa: E402
from faultbench.targets.hf.recipes import RECIPES, Recipe  # noqa: E402
from faultbench.targets.hf.run import build_run  # noqa: E402
from faultbench.targets.hf.seams import SEAMS, resolve  # noqa: E402

TARGET = 1.05
ARMS = ("faultbench", "trainer", "loop")
# wall: what a user waits; cpu: this thread's CPU time, which other processes' load barely changes (torch
# runs single-threaded, and on CPU the backward runs in the calling thread: the whole step is counted)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
PAIRS = ("faultbench/trainer", "trainer/loop")


class StepClock(TrainerCallback):
    """Calls ``on_step()`` at every optimizer step's start."""

    def __init__(self, on_step):
        self.on_step = on_step

    def on_step_begin(self, args, state, control, **kwargs):
        self.on_step()


def run_faultbench(recipe: Recipe, seed: int, workdir: str, on_step) -> torch.nn.Module:
    """(A): the trained model; ``on_step()`` is called at every step's start."""
    run = build_run(recipe, seed, workdir)
    suite = Suite((), RunContext(run=run, seam_resolver=resolve, seams=dict(SEAMS)))  # a case's, no detector
    run.trainer.add_callback(StepClock(on_step))
    train(run, suite)
    return run.model


def run_trainer(recipe: Recipe, seed: int, workdir: str, on_step) -> torch.nn.Module:
    """(B): transformers' ``Trainer`` on ``build_run``'s model, arguments, dataset and collator."""
    pieces = build_run(recipe, seed, workdir).trainer
    trainer = Trainer(model=pieces.model, args=pieces.args, train_dataset=pieces.train_dataset,
                      data_collator=pieces.data_collator, processing_class=pieces.processing_class)
    trainer.remove_callback(PrinterCallback)  # as build_run does: printing the logs is no training cost
    trainer.add_callback(StepClock(on_step))
    trainer.train()
    return trainer.model


def run_loop(recipe: Recipe, seed: int, workdir: str, on_step) -> torch.nn.Module:
    """(C): the same training written by hand (``workdir``: unused, the loop saves nothing)."""
    texts = load_texts(recipe.data)
    tokenizer = wrap_tokenizer(texts.tokenizer_json, recipe.data.seq_len, recipe.padding_side)
    model = build_model(recipe.model, tokenizer, seed).train()
    dataset = TextDataset(texts.train, tokenizer)
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    loader = torch.utils.data.DataLoader(dataset, batch_size=recipe.micro_batch_size, sampler=sampler,
                                         collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    decay = [p for p in model.parameters() if p.dim() >= 2]  # Trainer's groups here: norms are the only 1-D
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, fused=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, recipe.warmup_steps, recipe.steps)
    batches = iter(loader)
    for _ in range(recipe.steps):
        micro_batches = [next(batches) for _ in range(recipe.accum)]
        on_step()  # where Trainer's on_step_begin fires: after fetching the step's batches
        items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)  # the window's targets
        for batch in micro_batches:
            model(**batch, num_items_in_batch=items).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model


RUNNERS = {"faultbench": run_faultbench, "trainer": run_trainer, "loop": run_loop}


class LockStep:
    """Runs the arms in threads one at a time, switching at every step start: each round, every arm runs
    one step, the arms in a new order per round (all orders in turn), so load and drift hit all alike.

    ``seconds[clock][arm]``: each step's time from the arm's resumption at the step start to its next step
    start (data, forward, backward, clipping, optimizer, schedule, logging, callbacks), by each of
    ``CLOCKS``. Set-up before the first step and the last step (it runs into tear-down) are not counted.
    """

    def __init__(self, names):
        self.cond = threading.Condition()
        self.orders = itertools.cycle(itertools.permutations(names))
        self.live, self.queue, self.turn = set(names), [], None
        self.resumed: dict[str, dict[str, float]] = {}
        self.seconds = {clock: {name: [] for name in names} for clock in CLOCKS}
        with self.cond:
            self._pass()

    def _pass(self) -> None:
        """Give the turn to the next live arm of this round, or of a new round (lock held)."""
        self.queue = [n for n in self.queue if n in self.live] or [n for n in next(self.orders) if n in self.live]
        self.turn = self.queue.pop(0) if self.queue else None
        self.cond.notify_all()

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == name)

    def tick(self, name: str) -> None:
        """At a step start: record the previous step, pass the turn, resume when it comes back."""
        if name in self.resumed:
            for clock, now in CLOCKS.items():
                self.seconds[clock][name].append(now() - self.resumed[name][clock])
        with self.cond:
            self._pass()
        self.wait(name)
        self.resumed[name] = {clock: now() for clock, now in CLOCKS.items()}

    def finish(self, name: str) -> None:
        with self.cond:
            self.live.discard(name)
            self._pass()


def lockstep_seconds(recipe: Recipe, seed: int) -> tuple[dict, dict]:
    """Every arm trains ``recipe`` from scratch, in lock step: (``LockStep.seconds``, {arm: trained model})."""
    lock, models, errors = LockStep(ARMS), {}, {}

    def arm(name: str, workdir: str) -> None:
        lock.wait(name)
        try:
            models[name] = RUNNERS[name](recipe, seed, workdir, lambda: lock.tick(name))
        except Exception as exc:  # re-raised in the caller's thread
            errors[name] = exc
        finally:
            lock.finish(name)

    with tempfile.TemporaryDirectory(prefix="faultbench-hfperf-") as tmp:
        threads = [threading.Thread(target=arm, args=(name, f"{tmp}/{name}")) for name in ARMS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        name, exc = next(iter(errors.items()))
        raise RuntimeError(f"arm {name} failed: {exc!r}") from exc
    return lock.seconds, models


def time_arms(recipe: Recipe, seed: int, repeats: int, warmup: int) -> dict:
    """{clock: {arm: step seconds}} over ``repeats`` lock-step runs, the first ``warmup`` steps of each dropped."""
    times = {clock: {name: [] for name in ARMS} for clock in CLOCKS}
    for _ in range(repeats):
        seconds, _ = lockstep_seconds(recipe, seed)
        for clock, name in itertools.product(CLOCKS, ARMS):
            times[clock][name] += seconds[clock][name][warmup:]
    return times


def summary(times: dict) -> dict:
    """Per arm the median and min step seconds; per pair the median of the step-by-step ratios (the steps
    of one round ran within a few hundred ms of each other: their ratio is what load disturbs least)."""
    out = {name: {"median": statistics.median(t), "min": min(t)} for name, t in times.items()}
    for pair in PAIRS:
        a, b = pair.split("/")
        out[pair] = statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="fp32", choices=[n for n, r in RECIPES.items()
                                                             if r.world_size == 1 and r.resume_at is None])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of each run")
    parser.add_argument("--repeats", type=int, default=2, help="lock-step runs (each a fresh run of every arm)")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each run not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.repeats < 1 or not 0 <= args.warmup < args.steps - 1:
        raise SystemExit("--repeats must be >= 1 and 0 <= --warmup < --steps - 1")

    torch.set_num_threads(1)  # single-threaded: overheads show up instead of hiding behind idle cores
    recipe = dataclasses.replace(RECIPES[args.recipe], steps=args.steps)
    times = time_arms(recipe, args.seed, args.repeats, args.warmup)
    result = {"recipe": args.recipe, "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
              "threads": torch.get_num_threads(), "steps_timed": len(times["wall"][ARMS[0]]), "target_ratio": TARGET,
              **{clock: summary(t) for clock, t in times.items()}}
    print(f"HF recipe {args.recipe}, {torch.get_num_threads()} thread: {args.repeats} lock-step runs x {args.steps} "
          f"steps per arm, {result['steps_timed']} steps timed per arm")
    print(f"{'':22}{'(A) faultbench':>15}{'(B) Trainer':>12}{'(C) loop':>10}{'A/B':>8}{'B/C':>8}")
    for clock in CLOCKS:
        s = result[clock]
        for stat in ("median", "min"):
            a, b, c = (s[name][stat] for name in ARMS)
            print(f"{f'{clock} {stat} ms':22}{1e3 * a:15.2f}{1e3 * b:12.2f}{1e3 * c:10.2f}{a / b:8.3f}{b / c:8.3f}")
        print(f"{f'{clock} step-by-step ratio':22}{'':37}{s[PAIRS[0]]:8.3f}{s[PAIRS[1]]:8.3f}")
    ratio = result["wall"][PAIRS[0]]
    result["target_met"] = ratio <= TARGET
    print(f"faultbench/Trainer wall step-by-step ratio {ratio:.3f}: target <= {TARGET} "
          f"{'met' if result['target_met'] else 'MISSED'}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
