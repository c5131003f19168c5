"""The interviewer's run-sheet for one exercise: everything needed to run the interview, minute by minute.

The rubric (``harness.rubric``) says what a strong answer covers; the run-sheet says how to run the hour: what to
say at the start, when to give each hint (with its words), when to move on, the follow-up questions with model
answers, what a 1, 2, 3 or 4 looks like on each of the six dimensions for this bug, the red flags, and how to
close. The plan scales with the slot (``minutes``, default 45): the debugging part gets the difficulty's time
budget, capped so that questions and the close still fit. Plain words: it is read during the interview.
"""

from __future__ import annotations

from pathlib import Path

from faultbench.faults.registry import get_fault
from faultbench.harness.practice_level import difficulty, hints, symptom_class
from faultbench.harness.rubric import (
    FOLLOW_UPS,
    MINIMAL_BY_TRIGGER,
    MINIMAL_EXAMPLE,
    RED_FLAG_BY_TRIGGER,
    RED_FLAGS,
    REPRODUCE,
    RESULTS,
    SUBSYSTEM_CHECKS,
    TIME_BUDGET_MIN,
    follow_ups,
)

INTRO_MIN, QUESTIONS_MIN, CLOSE_MIN = 3, 8, 3  # the parts around the debugging
MIN_SLOT = INTRO_MIN + QUESTIONS_MIN + CLOSE_MIN + 10

# a model answer for each follow-up question the rubric can ask (by the same keys)
MODEL_ANSWERS = {
    "trigger": {
        "on-resume": "A checkpoint must hold everything the next step reads: weights, optimizer moments and step "
                     "counts, the schedule's position, the data order and position, every RNG (CPU, CUDA, Python, "
                     "NumPy), the loss scaler and the step counter. Until the restart the live objects carry that "
                     "state, so only a resumed run sees what the checkpoint lost. Test: save at step k, resume, and "
                     "compare each step with the same job run straight through (bit-identical on CPU).",
        "multi-rank": "Several processes each see part of the data and must agree on the gradient (all-reduce), on "
                      "the weights and on which samples each takes; with one process none of that code runs. Two "
                      "gloo ranks on one CPU machine exercise it: compare their weight checksums after each step "
                      "and the two-rank run against one process on the combined batch.",
        "amp-only": "fp16 has a range of about 6e4 and 10 bits of mantissa: large values overflow to inf, tiny ones "
                    "flush to zero, and sums lose precision; fp32 has room for all of it. bf16 has fp32's range but "
                    "fewer bits, so it shows precision losses and hides most overflows.",
        "rare-batch": "Only batches with a particular property (length, padding, a special token) take the wrong "
                      "path. In a long run: log per-batch statistics, stop at the first bad step, and save that "
                      "batch so it can be replayed alone.",
        "eval-only": "The training path is correct; evaluation has its own code (mode, batching, what is averaged), "
                     "so only its numbers are wrong. Monitor the evaluation against a hand computation on a few "
                     "documents, and its consistency with the training loss on the same data.",
        "after-step": "Anything stateful: gradients, optimizer moments, a schedule, a cache or a counter. Step 0 "
                      "starts from clean state, so a bug in what a step leaves behind shows from step 1 on.",
    },
    "symptom": {
        "crash": "The line that raises is where a wrong value was finally used, not where it was made: follow the "
                 "offending tensor (its shape, dtype or index) back to the code that produced it.",
        "nan": "Turn on anomaly detection or forward hooks that check every output for inf/NaN, and stop at the "
               "first module whose inputs are finite and whose output is not.",
        "quality": "An invariance test of the model on a tiny batch: padding must not change the real tokens' "
                   "logits, a future token must not change the past, cached decoding must equal a full forward.",
        "stall": "A learning rate that is too small still moves the weights a little every step and the loss "
                 "still falls; a bug typically stops part of the update entirely. Check that the weights change "
                 "after step() and that the learning rate the optimizer uses is the one intended.",
        "divergence": "Run the same seed twice: identical runs rule out luck. Then lower the learning rate: a "
                      "too-high rate diverges less or not at all when lowered; a bug keeps its signature (the same "
                      "step, the same tensor) regardless.",
        "eval-metric": "The mean token loss recomputed by hand on a few documents, in eval mode, over real tokens "
                       "only: it depends on nothing the training loop does.",
        "desync": "Compare a checksum of the weights (or of the gradients after the reduction) across ranks at "
                  "every few steps; any difference is a bug, since DDP keeps replicas identical.",
        "performance": "Track tokens per second and memory per step: a constant loss curve with a growing memory "
                       "footprint or a falling throughput points at state kept from step to step.",
    },
}


def _anchors(spec) -> dict[str, list[str]]:
    """What a 1, 2, 3 and 4 look like on each dimension, for this fault."""
    acceptable = " or ".join(f"`{s}`" for s in (spec.subsystem, *spec.also_acceptable))
    checks = SUBSYSTEM_CHECKS[spec.subsystem]
    minimal = MINIMAL_BY_TRIGGER.get(spec.trigger, MINIMAL_EXAMPLE[symptom_class(spec)])
    return {
        "reproduce": ["edits code or settings before running the job twice with the same seed",
                      "runs it, but does not compare with the healthy numbers in the README",
                      "reproduces it with a fixed seed next to the healthy run after a nudge",
                      f"unprompted: {REPRODUCE[spec.trigger][0].lower()}{REPRODUCE[spec.trigger][1:]}"],
        "isolate": ["names no part of the code, or a wrong one, even after the hints",
                    f"reaches {acceptable} only after the second hint",
                    f"reaches {acceptable} after the first hint or a prompt",
                    f"names `{spec.subsystem}` before any hint, from an experiment that rules the other parts out"],
        "instrument": ["prints values without a question behind them",
                       "measures something related that does not decide",
                       f"measures what exposes it when prompted (for `{spec.subsystem}`: {checks})",
                       "measures it unprompted, before reading code, and reads the number right"],
        "fix": ["no fix, or a change of settings that hides the symptom",
                "a change that moves the symptom; `python check.py` still fails",
                "`python check.py` passes after hints",
                f"a minimal fix that passes `python check.py`, explained: {spec.fix}"],
        "prevent": ["no test", "a test of this one symptom",
                    "a test of the function's contract when asked for one",
                    "proposes, unprompted, a test of the contract that would catch every bug of this kind"],
        "example": ["none", "the whole training job", "a smaller case with prompting", f"unprompted: {minimal}"],
    }


def follow_up_answers(spec) -> list[tuple[str, str]]:
    """The rubric's follow-up questions for ``spec``, each with its model answer."""
    symptom = symptom_class(spec)
    pairs = [(FOLLOW_UPS["trigger"].get(spec.trigger), MODEL_ANSWERS["trigger"].get(spec.trigger)),
             (FOLLOW_UPS["symptom"][symptom], MODEL_ANSWERS["symptom"][symptom]),
             (follow_ups(spec)[-1], f"A test of the whole contract of `{spec.subsystem}`, not of this one symptom: "
                                    f"{SUBSYSTEM_CHECKS[spec.subsystem]}.")]
    return [(q, a) for q, a in pairs if q]


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _plan(budget: int) -> list[tuple[int, str]]:
    """(minute, what happens) for a debugging part of ``budget`` minutes after the introduction."""
    start = INTRO_MIN
    at = lambda share: start + round(budget * share)  # noqa: E731
    return [
        (0, "Introduce the exercise (the words above); hand over the folder or archive."),
        (start, "The candidate reads the README and runs `python train.py` as the colleague did. Listen: do they "
                "reproduce before reading code?"),
        (at(0.4), "No part of the code named yet (or a wrong one)? Give hint 1."),
        (at(0.6), "Still not in the right part? Give hint 2."),
        (at(0.8), "Not at the function? Give hint 3. Ask them to fix it and run `python check.py`."),
        (start + budget, "Stop debugging, repaired or not. Run `faultbench practice check DIR` yourself; ask how "
                         "they would prevent it (a test) and for a minimal example."),
        (start + budget + QUESTIONS_MIN // 2, "Follow-up questions (below), as time allows."),
        (start + budget + QUESTIONS_MIN, "Close: `faultbench practice reveal DIR` together; score after the "
                                         "candidate leaves."),
    ]


def runsheet(fault_id: str, minutes: int = 45, candidate: str | None = None, results: Path = RESULTS) -> str:
    """The run-sheet of one fault's exercise as markdown, for a slot of ``minutes``."""
    if minutes < MIN_SLOT:
        raise ValueError(f"a run-sheet needs a slot of at least {MIN_SLOT} minutes, got {minutes}")
    spec = get_fault(fault_id)
    level = difficulty(spec, results)
    budget = min(TIME_BUDGET_MIN[level], minutes - INTRO_MIN - QUESTIONS_MIN - CLOSE_MIN)
    lines = [
        f"# Run-sheet: {minutes}-minute interview" + (f" with {candidate}" if candidate else ""), "",
        "For the interviewer only. The candidate gets the exercise folder (or its archive) and nothing else: "
        "not faultbench, not this sheet.", "",
        f"- The bug (keep it to yourself): {spec.title}. {spec.explanation}",
        f"- Difficulty {level}; {budget} minutes of debugging.", "",
        "## What to say at the start", "",
        "> A colleague's training job misbehaves; the README is their report, with last week's healthy numbers. "
        "The folder runs on its own. Find what is wrong and fix it. Think aloud; you may run, print and edit "
        "anything. `python check.py` tells you whether the job now behaves like the healthy one. You can ask me "
        "for hints; it costs a little.", "",
        "## Minute plan", "", "| minute | what happens |", "| --- | --- |",
        *[f"| {m} | {what} |" for m, what in _plan(budget)], "",
        "## Hints, word for word", "",
        *[f"{i}. {_sentence(h.split(': ', 1)[-1])}" for i, h in enumerate(hints(spec), 1)], "",
        "Record each with `faultbench practice hint DIR` (the candidate can also ask it themselves).", "",
        "## Follow-up questions and model answers", "",
        *[f"**{q}**\n\n{a}\n" for q, a in follow_up_answers(spec)],
        "## Scoring: what each band looks like for this bug", "",
        "| dimension | 1 | 2 | 3 | 4 |", "| --- | --- | --- | --- | --- |",
        *[f"| {d} | " + " | ".join(anchors) + " |" for d, anchors in _anchors(spec).items()], "",
        "## Red flags", "", *[f"- {f}" for f in (*RED_FLAGS, RED_FLAG_BY_TRIGGER.get(spec.trigger)) if f], "",
        "## Closing", "",
        "- `faultbench practice stop DIR` when time is up (nothing more is counted), then `reveal` together.",
        "- `faultbench practice score DIR reproduce=N isolate=N instrument=N fix=N prevent=N example=N`, then "
        "`faultbench practice report DIR --out report.md`: times, hints, answers, checks, scores and the "
        "candidate's diff.",
    ]
    return "\n".join(lines) + "\n"
