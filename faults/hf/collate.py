"""HF faults in the `collate` subsystem: the tokenizer's padding (``_pad``), the causal-LM collator's labels
(``DataCollatorForLanguageModeling.torch_call``) and the pad token a user picks for them."""

from collections.abc import Mapping

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors
from transformers import PreTrainedTokenizerFast
from transformers.data.data_collator import _torch_collate_batch, pad_without_fast_tokenizer_warning
from transformers.tokenization_utils_base import PaddingStrategy

from faultbench.faults.registry import Manifest, fault
from faultbench.targets.hf.data import SPECIAL_TOKENS

_COLLATOR = "transformers.data.data_collator.DataCollatorForLanguageModeling.torch_call"


@fault(
    "hf_pad_side_mismatch",
    target="hf",
    seam="transformers.tokenization_utils_base.PreTrainedTokenizerBase._pad",
    title="Left padding pads the tokens on the left but the attention mask on the right",
    subsystem="collate",
    also_acceptable=("mask",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="_pad's left branch (a copy of the right one) prepends the pad ids to input_ids but still "
    "appends the zeros to attention_mask. The mask now describes right padding while the tokens are padded "
    "on the left: the pads count as real tokens (every real token attends to them) and the last real tokens "
    "of each short row are masked out as keys. Right padding is unaffected, so a right-padded training run "
    "looks fine; every left-padded batch (batched generation, a left_pad recipe) computes other logits than "
    "its prompts alone, and the positions generate derives from the mask are wrong too.",
    fix="Prepend the mask zeros on the left branch: attention_mask = [0] * difference + attention_mask.",
    references=(
        "huggingface/transformers tokenization_utils_base.PreTrainedTokenizerBase._pad: each padding_side "
        "branch pads input_ids, attention_mask, token_type_ids and special_tokens_mask on the same side",
        "huggingface/transformers#7552: Add batch inferencing support for GPT2LMHeadModel (left-padded batches "
        "rely on the attention mask marking the left pads)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=16,
                      params={"key": "pad_logit_gap", "faulty_min": 0.05, "clean_max": 1e-4}),
)
def pad_mask_on_other_side(
    self,
    encoded_inputs,
    max_length=None,
    padding_strategy=PaddingStrategy.DO_NOT_PAD,
    pad_to_multiple_of=None,
    padding_side=None,
    return_attention_mask=None,
):
    """Left padding: the ids are padded on the left, the attention mask on the right."""
    # Load from model defaults
    if return_attention_mask is None:
        return_attention_mask = "attention_mask" in self.model_input_names

    required_input = encoded_inputs[self.model_input_names[0]]

    if padding_strategy == PaddingStrategy.LONGEST:
        max_length = len(required_input)

    if max_length is not None and pad_to_multiple_of is not None and (max_length % pad_to_multiple_of != 0):
        max_length = ((max_length // pad_to_multiple_of) + 1) * pad_to_multiple_of

    needs_to_be_padded = padding_strategy != PaddingStrategy.DO_NOT_PAD and len(required_input) != max_length

    # Initialize attention mask if not present.
    if return_attention_mask and "attention_mask" not in encoded_inputs:
        encoded_inputs["attention_mask"] = [1] * len(required_input)

    if needs_to_be_padded:
        difference = max_length - len(required_input)
        padding_side = padding_side if padding_side is not None else self.padding_side

        if padding_side == "right":
            if return_attention_mask:
                encoded_inputs["attention_mask"] = encoded_inputs["attention_mask"] + [0] * difference
            if "token_type_ids" in encoded_inputs:
                encoded_inputs["token_type_ids"] = (
                    encoded_inputs["token_type_ids"] + [self.pad_token_type_id] * difference
                )
            if "special_tokens_mask" in encoded_inputs:
                encoded_inputs["special_tokens_mask"] = encoded_inputs["special_tokens_mask"] + [1] * difference
            encoded_inputs[self.model_input_names[0]] = required_input + [self.pad_token_id] * difference
        elif padding_side == "left":
            if return_attention_mask:
                encoded_inputs["attention_mask"] = encoded_inputs["attention_mask"] + [0] * difference
            if "token_type_ids" in encoded_inputs:
                encoded_inputs["token_type_ids"] = [self.pad_token_type_id] * difference + encoded_inputs[
                    "token_type_ids"
                ]
            if "special_tokens_mask" in encoded_inputs:
                encoded_inputs["special_tokens_mask"] = [1] * difference + encoded_inputs["special_tokens_mask"]
            encoded_inputs[self.model_input_names[0]] = [self.pad_token_id] * difference + required_input
        else:
            raise ValueError(f"Invalid padding strategy:{padding_side}")

    return encoded_inputs


@fault(
    "hf_label_permute",
    target="hf",
    seam=_COLLATOR,
    title="Labels collated from the length-sorted examples: each row is scored against another row's tokens",
    subsystem="collate",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The collator pads the examples in the order it got them for input_ids, but builds labels by "
    "padding the examples sorted by length (to pad them compactly), so row i's labels are another document's "
    "tokens. Shapes match and the count of target tokens is unchanged, so nothing fails; the model is trained "
    "to predict unrelated text, the train and validation losses stay far above a clean run's.",
    fix="Build labels from the same padded input_ids: labels = batch['input_ids'].clone(), then mask the pads.",
    references=(
        "huggingface/transformers data_collator.DataCollatorForLanguageModeling.torch_call: labels are a clone "
        "of the padded input_ids (the row order is the batch's order)",
        "huggingface/transformers trainer_pt_utils.LengthGroupedSampler: length grouping reorders documents in "
        "the sampler, before collation, so inputs and labels stay paired",
    ),
    manifest=Manifest(check="loss_above", steps=16, variant={"lr": 1e-2}, params={"min_gap": 0.15, "metric": "val"}),
)
def torch_call_labels_from_sorted(self, examples):
    """Labels are padded from the examples sorted by length, input_ids from the examples as given."""
    if self.seed is not None and self.generator is None:
        # If we have a seed, we need to create a generator object. Subsequent calls to this function will use the same generator.
        # If no seed supplied, we will use the global RNG
        self.create_rng()

    if isinstance(examples[0], Mapping):
        batch = pad_without_fast_tokenizer_warning(
            self.tokenizer, examples, return_tensors="pt", pad_to_multiple_of=self.pad_to_multiple_of
        )
    else:
        batch = {
            "input_ids": _torch_collate_batch(examples, self.tokenizer, pad_to_multiple_of=self.pad_to_multiple_of)
        }

    # If special token mask has been preprocessed, pop it from the dict.
    special_tokens_mask = batch.pop("special_tokens_mask", None)
    offset_mapping = batch.pop("offset_mapping", None)
    if self.mlm:
        batch["input_ids"], batch["labels"] = self.torch_mask_tokens(
            batch["input_ids"], special_tokens_mask=special_tokens_mask, offset_mapping=offset_mapping
        )
    else:
        by_length = sorted(examples, key=lambda e: len(e["input_ids"]), reverse=True)
        labels = pad_without_fast_tokenizer_warning(
            self.tokenizer, by_length, return_tensors="pt", pad_to_multiple_of=self.pad_to_multiple_of
        )["input_ids"]
        if self.tokenizer.pad_token_id is not None:
            labels[labels == self.tokenizer.pad_token_id] = -100
        batch["labels"] = labels
    return batch


@fault(
    "hf_pad_labels_not_ignored",
    target="hf",
    seam=_COLLATOR,
    title="Causal-LM collator never sets pad labels to -100: the loss is taken on padding",
    subsystem="collate",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="labels are a clone of the padded input_ids, and the step that replaces the pad ids with the "
    "ignore index is gone. Every pad position becomes a target: the model spends capacity on predicting "
    "'pad after pad' (trivial after an EOS on the right), the reported loss drops because those targets are "
    "easy, and the loss's token count (num_items_in_batch) includes the pads, so the real tokens' gradient is "
    "diluted by how much padding each batch needed.",
    fix="labels[labels == tokenizer.pad_token_id] = -100 (or mask by attention_mask == 0).",
    references=(
        "huggingface/transformers#32832: Causal lanuage modeling should consider loss masks for pad tokens "
        "(the collator is where pad labels become -100)",
        "huggingface/transformers#6213: [DataCollatorForLanguageModeling] fix labels (set the ignore index on "
        "pad labels whenever a pad token exists)",
    ),
    manifest=Manifest(check="extra_at_least", steps=8,
                      params={"key": "target_fraction", "faulty_min": 1.2, "clean_max": 1.0}),
)
def torch_call_pads_are_targets(self, examples):
    """The pad labels are never replaced by -100."""
    if self.seed is not None and self.generator is None:
        # If we have a seed, we need to create a generator object. Subsequent calls to this function will use the same generator.
        # If no seed supplied, we will use the global RNG
        self.create_rng()

    if isinstance(examples[0], Mapping):
        batch = pad_without_fast_tokenizer_warning(
            self.tokenizer, examples, return_tensors="pt", pad_to_multiple_of=self.pad_to_multiple_of
        )
    else:
        batch = {
            "input_ids": _torch_collate_batch(examples, self.tokenizer, pad_to_multiple_of=self.pad_to_multiple_of)
        }

    # If special token mask has been preprocessed, pop it from the dict.
    special_tokens_mask = batch.pop("special_tokens_mask", None)
    offset_mapping = batch.pop("offset_mapping", None)
    if self.mlm:
        batch["input_ids"], batch["labels"] = self.torch_mask_tokens(
            batch["input_ids"], special_tokens_mask=special_tokens_mask, offset_mapping=offset_mapping
        )
    else:
        labels = batch["input_ids"].clone()
        batch["labels"] = labels
    return batch


@fault(
    "hf_eos_masked_pad_eq_eos",
    target="hf",
    seam="targets.hf.data.wrap_tokenizer",
    title="pad_token set to eos_token: the collator masks every EOS label, the model never learns to stop",
    subsystem="collate",
    also_acceptable=("data",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The tokenizer is given the common one-line fix for a missing pad token, "
    "tokenizer.pad_token = tokenizer.eos_token. DataCollatorForLanguageModeling builds causal-LM labels by "
    "replacing every id equal to pad_token_id with -100, so every real EOS becomes an ignored label too: no "
    "document's end is ever a target, and a fine-tuned model does not learn to emit EOS (generation runs on "
    "to max_new_tokens). The model's pad_token_id (taken from the tokenizer) is EOS as well, so EOS's "
    "embedding row is the padding_idx. The loss looks fine; only the share of target tokens drops.",
    fix="Keep a distinct pad token (add one, or reuse unk), or build labels from attention_mask == 0 instead "
    "of from the pad id.",
    references=(
        "huggingface/transformers#23530: Incorrect handling of EOS tokens in DataCollatorForLanguageModeling "
        "when pad_token is set to eos_token",
        "huggingface/trl#976: DataCollatorForCompletionOnlyLM defaults can create a model that never generates "
        "eos_token_id",
    ),
    manifest=Manifest(check="extra_at_most", steps=8,
                      params={"key": "target_fraction", "faulty_max": 0.95, "clean_min": 1.0}),
)
def wrap_tokenizer_pad_is_eos(tokenizer_json: str, seq_len: int, padding_side: str) -> PreTrainedTokenizerFast:
    """The pad token is the EOS token."""
    backend = BackendTokenizer.from_str(tokenizer_json)
    pad, bos, eos, unk = SPECIAL_TOKENS
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, backend.token_to_id(bos)), (eos, backend.token_to_id(eos))]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos,
                                        unk_token=unk, model_max_length=seq_len, padding_side=padding_side)
    tokenizer.pad_token = tokenizer.eos_token  # the usual line for a causal LM "without" a pad token
    return tokenizer
