"""Faults in the `data` subsystem: corpus, tokenizer, sampler, truncation."""

from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import collate


@fault(
    "pad_id_mismatch",
    seam="model.train.next_micro_batches",
    title="Batches padded with a fresh id one past the vocabulary instead of the tokenizer's pad id",
    subsystem="data",
    also_acceptable=("collate", "model"),
    trigger="always",
    symptoms=("crash-index",),
    explanation="next_micro_batches pads with data.vocab_size (256, 'a fresh id no real token uses') instead of "
    "tokenizer.pad_id (0). The embedding table has exactly vocab_size rows, so the first padded batch "
    "indexes row 256 and the forward raises IndexError ('index out of range in self') inside GPT.forward's "
    "token embedding, at step 0. The traceback points at the model, but the id came from the data path.",
    fix="Pad with the tokenizer's own pad id (run.tokenizer.pad_id); a new pad token needs its embedding row "
    "(resize the table) before it is ever used.",
    references=(
        "huggingface/transformers issue 'IndexError: index out of range in self' (#12763): special tokens added "
        "without model.resize_token_embeddings(len(tokenizer))",
        "huggingface/transformers issue 'GPT2 IndexError: index out of range in functional.py by running "
        "run_clm.py when adding any special tokens' (#11102)",
        "meta-llama/llama-recipes issue 'usage of tokenizer pad token causes illegal memory access' (#189): a pad "
        "id past the embedding table",
    ),
    manifest=Manifest(check="crash", steps=3, params={"types": ("IndexError",), "seam": "model.gpt.GPT.forward"}),
)
def next_micro_batches_pad_past_vocab(run) -> list[dict]:
    """Pads with the configured vocabulary size, an id the embedding table does not have."""
    cfg = run.config
    docs = [run.corpus.train[i] for i in run.sampler.next_indices()]
    size = len(docs) // cfg.train.accum
    pad_id = cfg.data.vocab_size  # first id past the vocabulary: no real token can collide with it
    return [
        {k: v.to(cfg.train.device) for k, v in
         collate(docs[i : i + size], pad_id, cfg.data.pad_side).items()}
        for i in range(0, len(docs), size)
    ]


@fault(
    "truncation_drops_eos",
    seam="model.data.truncate",
    title="Truncation slices over-long documents to max_len and loses their EOS",
    subsystem="data",
    also_acceptable=("collate",),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="truncate() returns ids[:max_len], so every document longer than seq_len ends on an ordinary "
    "word piece instead of EOS. The model is never taught to stop a long document: at the last position of "
    "a cut document its target is a word, not EOS, so it learns that a document running to seq_len goes on. "
    "Nothing crashes; with short examples (seq_len 8: most documents are cut) the validation loss ends ~0.07 "
    "nats above the clean run after 100 steps, because the EOS the clean model learns to expect at the cut "
    "is replaced by an unpredictable word, and generation runs on instead of stopping.",
    fix="Keep EOS on truncated examples: ids[:max_len - 1] + [eos_id].",
    references=(
        "tloen/alpaca-lora issue 'Removing EOS token during training' (#118): the EOS is dropped when the text "
        "continues beyond CUTOFF_LEN",
        "huggingface/trl PR 'Implement EOS token handling for truncated sequences' (#4698)",
        "huggingface/transformers issue 'Tokenizers should not should not append [EOS] for truncated sentences' "
        "(#19742): the convention of a truncated example's last token is a design decision to make explicitly",
    ),
    # short examples: most documents are cut, and the model has time to learn where a cut example ends
    manifest=Manifest(check="loss_above", steps=100, seeds=(0, 1), variant={"data": {"seq_len": 8}},
                      params={"metric": "val", "min_gap": 0.03}),
)
def truncate_without_eos(ids: list[int], max_len: int, eos_id: int) -> list[int]:
    """Appends the EOS, then slices to max_len: the truncated example has no EOS."""
    if len(ids) <= max_len:
        return ids
    return (ids + [eos_id])[:max_len]


@fault(
    "overlong_document_skips_truncation",
    seam="model.data.truncate",
    title="Off-by-one in truncation lets rare over-long documents through at seq_len + 1 tokens",
    subsystem="data",
    also_acceptable=("position",),
    trigger="rare-batch",
    symptoms=("crash-shape",),
    explanation="truncate() budgets one extra token 'for the shift' (as if the model saw ids[:-1], as in "
    "nanoGPT's block_size + 1 chunks), so every cut document is seq_len + 1 = 65 tokens long. The shift happens "
    "in the loss here: the model sees all 65 and GPT.forward raises ValueError ('exceeds the position table'). "
    "Only the ~1% of documents longer than seq_len are affected, so training runs fine for a number of steps "
    "and then dies on the first batch that happens to draw one.",
    fix="Cut to exactly max_len tokens including EOS: ids[:max_len - 1] + [eos_id] when len(ids) > max_len.",
    references=(
        "Hugging Face tokenizers warning 'Token indices sequence length is longer than the specified maximum "
        "sequence length for this model ... Running this sequence through the model will result in indexing "
        "errors'",
        "karpathy/nanoGPT train.py get_batch: x = data[i:i+block_size], y = data[i+1:i+1+block_size] (the "
        "block_size + 1 convention that the shifted-inside-the-loss design does not share)",
    ),
    manifest=Manifest(check="crash", steps=30,
                      params={"types": ("ValueError",), "seam": "model.gpt.GPT.forward", "min_step": 10}),
)
def truncate_one_past(ids: list[int], max_len: int, eos_id: int) -> list[int]:
    """Allows max_len + 1 tokens: over-long documents exceed the position table."""
    if len(ids) <= max_len + 1:  # +1: the model sees ids[:-1], the last token is only a target
        return ids
    return ids[:max_len] + [eos_id]


@fault(
    "missing_bos",
    seam="model.tokenizer.Tokenizer.encode_batch",
    title="encode_batch relies on add_special_tokens for BOS, which this tokenizer never adds",
    subsystem="data",
    also_acceptable=("collate",),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="encode_batch (what load_corpus uses) asks the HF tokenizer for add_special_tokens=True and "
    "appends only EOS, as one would for a Llama-style tokenizer that prepends BOS itself. This BPE tokenizer "
    "has no post-processor, so the corpus has no BOS: the first word piece of every document takes BOS's "
    "place, is never a target, and the model never learns how documents start. The reported loss drops "
    "(the hardest target of each document is gone) while encode() still adds BOS, so prompts at inference "
    "look unlike anything seen in training.",
    fix="Wrap every document explicitly: [bos_id, *ids, eos_id], exactly as encode() does.",
    references=(
        "EleutherAI/lm-evaluation-harness PR 'initialize tokenizer with add_bos_token' (#2781): some tokenizers "
        "do not add BOS with add_special_tokens=True",
        "huggingface/datatrove issue 'BOS tokens not properly added in some circumstances' (#345)",
    ),
    manifest=Manifest(check="loss_below", steps=30, params={"metric": "val", "min_gap": 0.1}),
)
def encode_batch_no_bos(self, texts: list[str]) -> list[list[int]]:
    """No BOS: add_special_tokens adds nothing for this tokenizer."""
    encoded = self._hf.encode_batch(texts, add_special_tokens=True)  # the tokenizer prepends BOS
    return [[*e.ids, self.eos_id] for e in encoded]
