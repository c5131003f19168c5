"""The interviewer's rubric for one fault: what a strong answer covers, and how to score it.

Six dimensions in the order a strong answer takes them (reproduce with seed control, isolate by
subsystem, instrument, fix, prevent with a regression test, minimal reproducible example), each
tailored to the fault's trigger, symptom class and subsystem, with score bands 1-4; then 2-3
follow-up questions chosen by trigger, symptom and subsystem, red flags, and a time budget by
difficulty. It also draws on the committed results: the detectors that localized the fault in the
bench (results/bench.csv), its manifest evidence (results/faults.md) and the unit test that fails
with it injected (results/mutation.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from faultbench.faults.registry import get_fault
from faultbench.harness.practice_level import difficulty, localizing_detectors, symptom_class

RESULTS = Path(__file__).resolve().parent.parent / "results"
TIME_BUDGET_MIN = {"easy": 20, "medium": 35, "hard": 50}

# how to make it happen on demand, by trigger
REPRODUCE = {
    "always": "Any run shows it: fix the seed and compare two runs of the same seed (identical) before changing "
              "anything.",
    "amp-only": "Same seed in fp32 and in fp16/bf16: only the reduced-precision run shows it.",
    "eval-only": "Same seed; the training losses agree with a healthy run, the evaluation or decoding does not.",
    "after-step": "Same seed; step 0 agrees with a healthy run, the steps after it do not: what a step leaves "
                  "behind.",
    "rare-batch": "Same seed, then find the first batch that triggers it and replay that batch alone.",
    "on-resume": "Same seed: save at step k and resume, next to the same job uninterrupted; they part right "
                 "after the restart.",
    "multi-rank": "Same seed on one rank and on two gloo ranks (world size 2 on CPU): only two ranks show it.",
}
# the checks that expose a bug of each subsystem
SUBSYSTEM_CHECKS = {
    "data": "decode a batch back to text; every document ends with EOS and starts with BOS; each rank and "
            "each epoch sees its own share; the token counts are the expected ones",
    "collate": "a handcrafted two-document batch, left and right padded: attention_mask 1 on tokens, labels "
               "the inputs shifted by one with -100 on pads and BOS, pad ids only where the mask is 0",
    "mask": "the mask on a padded batch: no query sees a future key or a pad key; logits of the real tokens "
            "identical with and without padding; no row fully masked in fp16",
    "position": "position ids of a left-padded batch start at 0 on the first real token; the logits do not "
                "change with the padding amount; cached decoding equals one full forward",
    "model": "the loss at initialization near ln(vocabulary); gradients reach every parameter; tied weights "
             "share storage; cached decoding equals one full forward",
    "loss": "the loss of a hand-computed example (two tokens); the next-token shift; ignore_index on pads; "
            "the same loss with accumulation 1 and 2 over the same tokens",
    "optimizer": "the learning rate the optimizer really uses at each step against the schedule; every "
                 "parameter in exactly one group; the weights change after step(); the gradient norm before "
                 "and after clipping",
    "precision": "the same step in fp32 and fp16: the loss scale, the unscaled gradient norm, inf/NaN "
                 "checks, skipped steps",
    "checkpoint": "a resumed run against the same job uninterrupted, step by step: weights, optimizer state, "
                  "schedule, sampler position, RNG states, step counter",
    "distributed": "per-rank checksums of the weights after each step; what each rank samples; the gradient "
                   "after the reduction against the mean of the ranks' gradients",
    "eval": "the validation loss computed by hand on two documents: the mode (eval, no dropout), the tokens "
            "counted, the split (no document in both)",
}
# the smallest example that shows it, by symptom class
MINIMAL_EXAMPLE = {
    "crash": "the failing call on a handcrafted input of two short rows, no training loop",
    "nan": "one forward and backward in the reduced precision on the batch that produces the first non-finite",
    "stall": "one optimizer step on a fixed batch: the weights (or the loss) do not move as they should",
    "divergence": "two runs of a few steps next to each other, the first step where they part printed",
    "eval-metric": "the evaluation of two documents against a hand computation",
    "desync": "two gloo ranks for one step, the per-rank weight checksums printed",
    "performance": "a few steps with the tokens per step, time and memory printed",
    "quality": "an invariant on a tiny batch (padding, causality, shift, cached decoding) that a correct "
               "model satisfies and this one does not",
}
MINIMAL_BY_TRIGGER = {  # where the trigger matters more than the symptom
    "on-resume": "save after two steps, resume for two more, next to four uninterrupted steps: the first "
                 "tensor that differs printed",
    "multi-rank": "two gloo ranks for one step on CPU, each rank's batch and gradients printed",
}
FOLLOW_UPS = {
    "trigger": {
        "on-resume": "Why does it show only after a resume, and what state must a checkpoint hold for a resumed "
                     "run to be bit-identical to an uninterrupted one?",
        "multi-rank": "What changes under DDP (or ZeRO) that one process never exercises, and how would you test "
                      "it without a cluster?",
        "amp-only": "Why does fp32 hide it, and would bf16 show it too?",
        "rare-batch": "Why only some batches, and how would you have found the triggering batch in a long run?",
        "eval-only": "Why do the training numbers look healthy, and what would you monitor to catch it in "
                     "production?",
        "after-step": "What does one step leave behind for the next, and how does step 0 differ?",
    },
    "symptom": {
        "crash": "The traceback points at one line: why is that not where the bug is?",
        "nan": "How would you find the first operation that produced the non-finite value?",
        "quality": "Nothing crashed: which invariant test would have caught it before training?",
        "stall": "How do you tell a bug from a learning rate that is merely too small?",
        "divergence": "How do you tell a bug from an unlucky seed or a too-high learning rate?",
        "eval-metric": "Which number would you trust instead, and why?",
        "desync": "How would you detect that ranks disagree in a run that does not crash?",
        "performance": "How would you notice this in a run whose losses are right?",
    },
}
RED_FLAGS = (
    "changes hyperparameters (learning rate, clipping, precision) until the symptom goes away",
    "edits code before reproducing the problem with a fixed seed",
    "reads files at random instead of narrowing down by experiment",
    "declares it fixed without comparing against a healthy run",
)
RED_FLAG_BY_TRIGGER = {
    "on-resume": "tests only an uninterrupted run",
    "multi-rank": "tests only on one process",
    "amp-only": "switches to fp32 and calls it fixed",
    "rare-batch": "blames randomness without finding the batch",
    "eval-only": "looks only at the training loss",
    "after-step": "looks only at the first step",
}
DIMENSIONS = ("reproduce", "isolate", "instrument", "fix", "prevent", "example")  # the sections, in order
BANDS = ("1: missing or wrong", "2: attempted, not conclusive", "3: correct, with prompting",
         "4: correct, unprompted, and explained why")


def _table_row(path: Path, fault_id: str) -> list[str] | None:
    """The cells of the markdown table row of ``fault_id`` in a results file (None if absent)."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == fault_id:
            return cells
    return None


def follow_ups(spec) -> list[str]:
    """2-3 questions: one on the trigger (when it is not 'always'), one on the symptom, one on the subsystem."""
    questions = [FOLLOW_UPS["trigger"].get(spec.trigger), FOLLOW_UPS["symptom"][symptom_class(spec)],
                 f"Which test of `{spec.subsystem}` would you add so the whole class of this bug is caught?"]
    return [q for q in questions if q]


def _dimension(number: int, title: str, lines: list[str], band4: str) -> list[str]:
    return [f"## {number}. {title}", *[f"- {line}" for line in lines],
            f"- Score: {'; '.join(BANDS[:3])}; 4: {band4}.", ""]


def rubric(fault_id: str, results: Path = RESULTS) -> str:
    """The rubric of one fault as markdown."""
    spec = get_fault(fault_id)
    m = spec.manifest
    level = difficulty(spec, results)
    variant = json.dumps(m.variant) if m.variant else "the default tiny preset"
    acceptable = ", ".join((spec.subsystem, *spec.also_acceptable))
    evidence = _table_row(results / "faults.md", fault_id)
    mutation = _table_row(results / "mutation.md", fault_id)
    detectors = localizing_detectors(fault_id, results)
    symptom = symptom_class(spec)
    instrument = [f"Tailored checks for `{spec.subsystem}`: {SUBSYSTEM_CHECKS[spec.subsystem]}.",
                  f"Manifest check `{m.check}` {json.dumps(m.params) if m.params else ''}".rstrip()
                  + (f": {evidence[-1]}" if evidence else ".")]
    if detectors:
        instrument.append("Detectors that localize it first on every bench seed: "
                          + ", ".join(f"`{d}`" for d in detectors) + " (`faultbench detectors` says what each checks).")
    prevent = [f"A regression test that fails with this bug in place: `{mutation[-1]}` (`make mutation` lists "
               "them for every fault)."] if mutation else []
    prevent.append("A test of the function's contract, not of this one symptom, so the whole class of bug is caught.")
    lines = [
        f"# Rubric: {spec.title}", "",
        f"(fault `{spec.id}`; trigger {spec.trigger}; symptoms {', '.join(spec.symptoms)}; {level}; "
        f"time budget {TIME_BUDGET_MIN[level]} min)", "",
        *_dimension(1, "Reproduce with seed control", [
            REPRODUCE[spec.trigger],
            f"The `{m.scenario}` scenario, {m.steps} steps, with {variant}; seeds {', '.join(map(str, m.seeds))}; "
            f"`faultbench run --fault {spec.id}` runs it next to the clean run."],
            "reproduces on demand with a fixed seed and a healthy run beside it"),
        *_dimension(2, "Isolate by subsystem", [
            f"The bug lives in **{spec.subsystem}** (a diagnosis naming {acceptable} is acceptable), in "
            + ", ".join(f"`{s}`" for s in spec.seams) + ".",
            "Credit for narrowing down by experiment (smaller batch, fp32 vs fp16, no padding vs left padding, one "
            "rank vs two, with vs without resume) rather than by reading code at random."],
            "names the subsystem from an experiment that rules the others out"),
        *_dimension(3, "Instrument", instrument, "measures the quantity that exposes it before reading the code"),
        *_dimension(4, "Fix", [f"What is wrong: {spec.explanation}", f"The fix: {spec.fix}",
                               f"`faultbench show {spec.id}` prints the diff against the clean function."],
                    "a minimal fix, checked against a healthy run (`python check.py` exits 0)"),
        *_dimension(5, "Prevent with a regression test", prevent,
                    "a contract test that fails with the bug and passes without it"),
        *_dimension(6, "Minimal reproducible example", [
            f"For a {symptom} symptom ({spec.trigger}): "
            f"{MINIMAL_BY_TRIGGER.get(spec.trigger, MINIMAL_EXAMPLE[symptom])}."], "a few lines anyone can run"),
        "## Follow-up questions", *[f"- {q}" for q in follow_ups(spec)], "",
        "## Red flags", *[f"- {flag}" for flag in (*RED_FLAGS, RED_FLAG_BY_TRIGGER.get(spec.trigger)) if flag], "",
        "## Time budget",
        f"- {TIME_BUDGET_MIN[level]} minutes ({level}: {len(detectors)} detectors of the bench localize it on "
        "every seed); past it, give hints.", "",
        "## The real bug it models", *[f"- {ref}" for ref in spec.references],
    ]
    return "\n".join(lines) + "\n"
