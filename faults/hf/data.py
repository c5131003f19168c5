"""HF faults in the `data` subsystem: the target's tokenizer glue (``wrap_tokenizer``) and the dataset that
tokenizes each document (``TextDataset.__getitem__``): special tokens and truncation."""

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from faultbench.faults.registry import Manifest, fault
from faultbench.targets.hf.data import SPECIAL_TOKENS

_GETITEM = "targets.hf.data.TextDataset.__getitem__"


@fault(
    "hf_tokenizer_no_eos",
    target="hf",
    seam="targets.hf.data.wrap_tokenizer",
    title="The tokenizer's post-processor adds BOS but not EOS: no document's end is ever a target",
    subsystem="data",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The fast tokenizer's TemplateProcessing is what adds the special tokens on encoding; its "
    "template here is '<bos> $A', so tokenized documents carry no EOS. Nothing fails and the loss looks "
    "normal (one easy target fewer per document), but the model never sees a document end: it never learns "
    "to emit EOS, and generation runs on to max_new_tokens.",
    fix="Build the template with the EOS suffix: single='<bos> $A <eos>' with both special tokens registered "
    "(and rebuild it whenever add_bos/add_eos change).",
    references=(
        "huggingface/transformers#23855: [LlamaTokenizerFast] nit update post_processor on the fly (add_eos_token "
        "was stored but the post-processor template never rebuilt; addresses #23833)",
        "huggingface/transformers#23833: [llama] AutoTokenizer does not add eos_token at the end",
    ),
    manifest=Manifest(check="extra_at_most", steps=4,
                      params={"key": "eos_target_fraction", "faulty_max": 0.0, "clean_min": 1.0}),
)
def wrap_tokenizer_without_eos(tokenizer_json: str, seq_len: int, padding_side: str) -> PreTrainedTokenizerFast:
    """The post-processor template has no EOS."""
    backend = BackendTokenizer.from_str(tokenizer_json)
    pad, bos, eos, unk = SPECIAL_TOKENS
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos,
                                   unk_token=unk, model_max_length=seq_len, padding_side=padding_side)


@fault(
    "hf_double_bos",
    target="hf",
    seam=_GETITEM,
    title="Documents formatted with a leading BOS, then tokenized with special tokens: <bos><bos> text",
    subsystem="data",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The dataset renders each document in its prompt format, which starts with the BOS token "
    "text, and then tokenizes it with add_special_tokens on (the default), so the post-processor prepends a "
    "second BOS: every training example starts <bos><bos>. The model learns a distribution no prompt at "
    "inference has (a single BOS); a free, trivially predictable target per document lowers the reported "
    "loss and shifts every position by one.",
    fix="Tokenize text that already carries its special tokens with add_special_tokens=False (or do not put "
    "BOS in the rendered text).",
    references=(
        "huggingface/transformers#37686: Tokenizing with apply_chat_template behaves differently from regular "
        "tokenizing (encode(apply_chat_template(..., tokenize=False)) yields <bos><bos>)",
        "huggingface/transformers#35950: Idefics: remove double BOS token",
    ),
    manifest=Manifest(check="loss_below", steps=16, variant={"lr": 1e-2}, params={"min_gap": 0.15, "metric": "val"}),
)
def getitem_double_bos(self, i: int) -> dict:
    """The BOS text is prepended before tokenizing with special tokens."""
    text = self.tokenizer.bos_token + self.texts[i]
    ids = self.tokenizer(text, truncation=True, max_length=self.tokenizer.model_max_length)["input_ids"]
    return {"input_ids": ids}


@fault(
    "hf_truncation_drops_eos",
    target="hf",
    seam=_GETITEM,
    title="Over-long documents cut after tokenizing: their EOS is sliced off",
    subsystem="data",
    trigger="rare-batch",
    symptoms=("silent-quality",),
    explanation="The dataset tokenizes the whole document and slices the ids to model_max_length instead of "
    "letting the tokenizer truncate. The tokenizer's truncation keeps room for the special tokens; the slice "
    "does not, so a document longer than seq_len loses its EOS (and ends mid-text). Only the rare over-long "
    "documents (about 1% of this corpus) are affected: most batches are exact, and the model learns that long "
    "documents never end.",
    fix="Let the tokenizer truncate (truncation=True, max_length=...), which cuts the text and keeps BOS/EOS.",
    references=(
        "huggingface/transformers#23833: [llama] AutoTokenizer does not add eos_token at the end (examples "
        "without EOS teach the model never to stop)",
        "huggingface/tokenizers TruncationParams / PreTrainedTokenizerBase truncation: max_length counts the "
        "special tokens added by the post-processor",
    ),
    manifest=Manifest(check="extra_at_most", steps=4,
                      params={"key": "eos_target_fraction", "faulty_max": 0.999, "clean_min": 1.0}),
)
def getitem_slice_after_tokenizing(self, i: int) -> dict:
    """ids are sliced to model_max_length after tokenizing: over-long documents lose EOS."""
    ids = self.tokenizer(self.texts[i])["input_ids"][: self.tokenizer.model_max_length]
    return {"input_ids": ids}
