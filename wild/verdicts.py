"""Every finding the watch made on a clean wild program, classified: **true** (a real bug, documented with a
reproduction and the upstream place; the issue text is ready, not filed), **false** (the detector was wrong: fixed,
with a test on the program's convention; a false finding left here fails the run), or **by design** (the program's
convention is legitimate and documented). A finding that no verdict matches is reported as UNCLASSIFIED.
"""

from __future__ import annotations

from dataclasses import dataclass

TRUE, FALSE, BY_DESIGN = "true", "false", "by design"


@dataclass(frozen=True)
class Verdict:
    key: str  # the anchor in results/wild.md
    programs: tuple[str, ...]  # the programs it covers
    detector: str
    where: str | None  # the finding's place (None: any)
    kind: str
    summary: str

    def matches(self, program: str, finding: dict) -> bool:
        return (program in self.programs and finding["detector"] == self.detector
                and (self.where is None or finding.get("where") == self.where))


HF_TRAINERS = ("hf-gpt2", "hf-llama", "hf-qwen2-left", "hf-neox", "trl-sft", "trl-sft-packing")

VERDICTS = [
    Verdict("gpt2-num-items", ("hf-gpt2",), "bb_eval_loss", "eval", TRUE,
            "transformers 5.23.0: GPT-2's loss_type is None, so Trainer counts num_items_in_batch over the "
            "UNSHIFTED labels and the loss (and eval_loss) is divided by too many targets"),
    Verdict("gpt2-num-items", ("hf-gpt2",), "bb_loss_normalization", "loss", TRUE,
            "the same transformers bug, seen in the training loss's weights (they sum to less than 1)"),
]


def classify(program: str, finding: dict) -> Verdict | None:
    return next((v for v in VERDICTS if v.matches(program, finding)), None)


# The documentation of each true finding: reproduction, upstream version and place, issue text (not filed).
TRUE_FINDINGS = {
    "gpt2-num-items": {
        "title": "Trainer normalizes GPT-2's causal-LM loss by the unshifted label count (loss_type is None)",
        "upstream": "transformers 5.23.0, transformers/trainer.py: `Trainer.__init__` sets `self._loss_shifts_labels = "
                    "LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss`, and `Trainer._get_num_items_in_batch` "
                    "counts `labels[..., 1:]` only when it is True. `GPT2LMHeadModel.loss_type` is None "
                    "(modeling_utils.py, `PreTrainedModel.__init__`: the class name matches no LOSS_MAPPING key), "
                    "while its `loss_function` property falls back to `ForCausalLMLoss`, which shifts: the count "
                    "keeps each row's first label, which the loss never scores",
        "reproduction": "wild/repro/gpt2_num_items_in_batch.py (standalone: builds GPT-2 from a tiny config, "
                        "calls the model with the count Trainer computes, compares with the mean NLL)",
        "issue": (
            "**GPT-2 (and other models whose loss_type is None) get `num_items_in_batch` counted over unshifted "
            "labels**\n\n"
            "transformers 5.23.0, torch 2.13. `Trainer` passes `num_items_in_batch` to the model's loss. It counts "
            "over `labels[..., 1:]` only when `LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss` "
            "(`Trainer._loss_shifts_labels`). `GPT2LMHeadModel.loss_type` is None (no LOSS_MAPPING key in its "
            "class name), but its `loss_function` falls back to `ForCausalLMLoss`, which shifts; so the count "
            "includes every row's first label, which "
            "`ForCausalLMLoss` never scores after its shift. The loss is then sum(NLL) / (N + rows) instead of "
            "sum(NLL) / N: with run_clm's 64-token blocks, 63/64 = 0.984 of the true mean; with short padded rows "
            "~0.93. `eval_loss` is off by the same ratio, so perplexities reported by run_clm on GPT-2 are low. "
            "Reproduction: `python wild/repro/gpt2_num_items_in_batch.py` (no download). Expected: the loss with "
            "Trainer's count equals the mean next-token NLL. Suggested fix: decide the shift by the model's "
            "task (a causal-LM head: `model_input_names`/`_is_causal_lm`, or `loss_function is ForCausalLMLoss`) "
            "rather than by the class-name-derived `loss_type`, or give GPT2LMHeadModel `loss_type=\"ForCausalLM\"`."
            "\n\n(not filed)"),
    },
}
