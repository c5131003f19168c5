"""The contract catalogue: what every correct causal-LM training run keeps, per component and kind of property.

Written before the detectors that are to fill it (issue 22, DESIGN.md "Contracts and roles"): the suite's
coverage is measured over these contracts, never over the fault registry. A contract is one line that holds
for EVERY correct run, whatever its conventions (ignore value, pad side, position scheme, where the label shift
happens); a registry fault is at most evidence that a contract matters. Each contract names where it was taken
from (a framework's own tests or docs, a debugging checklist of ``../shared/seeds/``, a paper, a bug thread),
the tracks that CAN check it (``white-box``: probes of a target's roles/seams; ``black-box``: what
``faultbench.watch`` sees of any loop), the detectors that check it TODAY (empty: not checked yet), and, where
no track can check it, why (``uncheckable``).

Rows (``COMPONENTS``) and columns (``KINDS``) make a grid; every cell holds at least one contract or an entry of
``EMPTY_CELLS`` that argues why it is empty. The baselines (``detect_anomaly``, ``loss_curve``,
``crash_triage``) are scored alongside the suite, not in it, and are mapped to no contract.

``python -m faultbench.detectors.contracts`` prints ``markdown()``: that output is ``detectors/CONTRACTS.md``
(``tests/detectors/test_contracts.py`` fails when the two differ).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

TRACKS = ("white-box", "black-box")

# (row name, what it covers)
COMPONENTS = (
    ("corpus/tokenizer", "documents, their train/validation split, the tokenizer and the examples it makes"),
    ("sampler/loader", "which examples each step draws, in what order, on which worker and rank"),
    ("collate", "examples -> a batch: ids, attention mask, labels, positions, padding"),
    ("embeddings and positions", "token and position embeddings, position ids, rotary/relative schemes"),
    ("attention and masks", "scores, softmax, causal and padding masks, heads"),
    ("normalization/residual/MLP blocks", "the block stack: norms, residual stream, MLP, dropout, init"),
    ("head and tying", "the output projection, its tie to the input embedding, the logits"),
    ("loss", "next-token cross-entropy: targets, ignored positions, normalization, what is reported"),
    ("optimizer and its groups", "param groups, hyperparameters, decay rule, the update, its state"),
    ("LR schedule", "the learning rate of each optimizer step"),
    ("gradient path", "backward, accumulation over micro-batches, clipping, loss scaling"),
    ("checkpoint and resume", "what a checkpoint holds and how a resumed run continues"),
    ("ranks (DDP/ZeRO)", "data-parallel replicas and shards: data, reductions, replica agreement"),
    ("evaluation", "the evaluation loop and the metric it reports"),
    ("generation and the KV cache", "decoding with a cache: offsets, masks, cached vs full forwards"),
)

# (column name, one-line definition, as in issue 22)
KINDS = (
    ("invariance", "what must not change the result"),
    ("accounting", "what is reported equals what was computed"),
    ("declared = executed", "the configuration the user set is what actually runs"),
    ("state", "everything stateful round-trips exactly through save/resume and advances exactly once when it should"),
    ("numerics", "finite, in range, no silent loss of precision"),
    ("isolation", "information flows only where it may"),
)

COMPONENT_NAMES = tuple(name for name, _ in COMPONENTS)
KIND_NAMES = tuple(name for name, _ in KINDS)

# the first segment of a contract id names its component, the second its kind
COMPONENT_KEYS = {
    "tokenizer": "corpus/tokenizer", "loader": "sampler/loader", "collate": "collate",
    "positions": "embeddings and positions", "attention": "attention and masks",
    "blocks": "normalization/residual/MLP blocks", "head": "head and tying", "loss": "loss",
    "optimizer": "optimizer and its groups", "schedule": "LR schedule", "gradients": "gradient path",
    "checkpoint": "checkpoint and resume", "ranks": "ranks (DDP/ZeRO)", "eval": "evaluation",
    "generation": "generation and the KV cache",
}
KIND_KEYS = {
    "invariance": "invariance", "accounting": "accounting", "declared": "declared = executed", "state": "state",
    "numerics": "numerics", "isolation": "isolation",
}


@dataclass(frozen=True)
class Contract:
    id: str  # "<component key>.<kind key>.<slug>", e.g. "loss.accounting.reported-equals-computed"
    component: str  # one of COMPONENT_NAMES
    kind: str  # one of KIND_NAMES
    statement: str  # one line that holds for every correct causal-LM training run
    source: str  # where it was taken from
    tracks: tuple[str, ...]  # the tracks that CAN check it (subset of TRACKS)
    detectors: tuple[str, ...]  # the registered detectors that check it today
    uncheckable: str  # why no track can check it; "" when one can

    def to_dict(self) -> dict:
        return {"id": self.id, "component": self.component, "kind": self.kind, "statement": self.statement,
                "source": self.source, "tracks": list(self.tracks), "detectors": list(self.detectors),
                "uncheckable": self.uncheckable}


WB, BB, BOTH, NONE = ("white-box",), ("black-box",), ("white-box", "black-box"), ()


def _c(cid: str, statement: str, source: str, tracks: tuple[str, ...], detectors: tuple[str, ...] = (),
       uncheckable: str = "") -> Contract:
    component, kind = cid.split(".")[:2]
    return Contract(cid, COMPONENT_KEYS[component], KIND_KEYS[kind], statement, source, tracks, tuple(detectors),
                    uncheckable)


# the seed documents (../shared/seeds/), cited by file name
S000 = "seeds/000_8394dc57ef2ba1c4.txt (interview question)"
S001 = "seeds/001_0519463b8b975b5f.txt (what it tests)"
S002 = "seeds/002_8cab73739bcbd185.txt (fundamentals book)"
S003 = "seeds/003_cbc9e19dda7e9a0e.txt (debugging topic)"
S004 = "seeds/004_171ac7c3cf29993a.txt (debugging deep dive)"
KARPATHY = "Karpathy, 'A Recipe for Training Neural Networks' (2019)"
HF_COMMON = "huggingface/transformers tests/test_modeling_common.py"
HF_GEN = "huggingface/transformers tests/generation/test_utils.py"
HF_TRAINER = "huggingface/transformers tests/trainer/test_trainer.py"
GA_FIX = ("huggingface/transformers PR #34191 'Fix Gradient Accumulation issue' and the HF blog "
          "'Fixing Gradient Accumulation' (2024)")

_CONTRACTS = (
    # ------------------------------------------------------------------------------------------ corpus/tokenizer
    _c("tokenizer.invariance.batch-equals-single",
       "encoding texts as a batch gives each text the ids it gets when encoded alone (neighbours and batch size "
       "change nothing)",
       "huggingface/transformers tests/test_tokenization_common.py (batch vs single encoding equivalence); "
       + S000 + ": tokenization checks",
       BOTH, ("tokenizer_roundtrip",)),
    _c("tokenizer.invariance.deterministic",
       "the same text tokenizes to the same ids on every call, worker, rank and resumed segment (one pinned "
       "tokenizer)",
       S000 + ": single pinned tokenizer across workers and checkpoints",
       WB),
    _c("tokenizer.accounting.roundtrip",
       "decode(encode(text)) gives back the text for every text the tokenizer claims to cover (no silent loss)",
       S004 + ": 'Do tokens decode back to original text?'; transformers tests/test_tokenization_common.py "
       "(encode/decode round trips)",
       BOTH, ("tokenizer_roundtrip",)),
    _c("tokenizer.accounting.no-silent-drop",
       "every document of a split reaches the examples (or is dropped by a declared filter): preprocessing loses "
       "and duplicates none silently",
       S000 + ": sane sequence-length distributions, nothing silently truncated",
       WB),
    _c("tokenizer.declared.special-ids",
       "the BOS/EOS/PAD ids that collate, model and loss use are the tokenizer's declared special ids, distinct "
       "unless declared shared",
       S001 + ": pad_token_id consistent between tokenizer and model",
       BOTH, ("tokenizer_roundtrip", "batch_special_ids", "bb_pad_ids")),
    _c("tokenizer.declared.max-length",
       "no example is longer than the declared context length; truncation keeps the declared part (prefix) and "
       "the declared ending",
       S000 + ": truncation that drops EOS or breaks label shifting; HF tokenizer docs (truncation, max_length)",
       BOTH, ("corpus_invariants",)),
    _c("tokenizer.declared.document-format",
       "every example follows the run's declared document format (BOS/EOS placement, no special id inside the "
       "text), the same for every example",
       S000 + ": correct PAD/BOS/EOS/UNK ids; " + S001 + ": special tokens",
       BOTH, ("corpus_invariants", "tokenizer_roundtrip", "bb_golden_layout")),
    _c("tokenizer.state.same-after-resume",
       "the tokenizer (vocabulary, merges, special ids) and dataset version after a resume, and on every rank, are "
       "the ones the run started with",
       S000 + ": 'Is the tokenizer / dataset versioned and identical across all workers and any resumed "
       "checkpoint?'",
       BOTH),
    _c("tokenizer.state.cache-keyed",
       "a cached tokenized corpus is reused only when the tokenizer and preprocessing that produced it are "
       "unchanged (the cache key covers them)",
       "Hugging Face datasets docs, 'Cache' (fingerprint of the transform that produced a cached dataset)",
       WB),
    _c("tokenizer.numerics.ids-in-vocabulary",
       "every id the tokenizer or corpus produces is a valid row of the model's embedding (0 <= id < vocab size)",
       S002 + ": out-of-range labels produce out-of-bounds indexing; HF docs, resize_token_embeddings",
       BOTH, ("corpus_invariants", "batch_special_ids", "bb_crash_site")),
    _c("tokenizer.numerics.trainable-examples",
       "every example holds at least two tokens (one prediction) and is not made only of UNK or PAD ids",
       S000 + ": all-UNK / all-PAD / pathologically long samples",
       BOTH),
    _c("tokenizer.isolation.split-disjoint",
       "no evaluation document is a training document (also after deduplication and normalization)",
       S003 + ": train and evaluation splits truly separate, duplicates across splits; " + S004
       + ": train-test contamination",
       BOTH, ("split_overlap", "bb_eval_overlap")),
    _c("tokenizer.isolation.split-per-document",
       "the split assigns each whole document to one side, by the document, never by its position in a shuffled "
       "stream",
       S004 + ": group leakage (the same group on both sides of a split)",
       WB, ("split_overlap",)),
    _c("tokenizer.isolation.fit-on-train",
       "the tokenizer and any statistics of preprocessing are fitted on training text only",
       S004 + ": preprocessing leakage (statistics computed on the full data before the split)",
       NONE, (), "a run receives a fitted tokenizer: which texts it was fitted on is recorded nowhere a run "
       "exposes, so neither a probe nor a watch can see it"),

    # -------------------------------------------------------------------------------------------- sampler/loader
    _c("loader.invariance.workers",
       "the examples an epoch-based loader yields do not depend on the number of workers, prefetching or batch "
       "size",
       "PyTorch docs, torch.utils.data (an IterableDataset is replicated on every worker unless it splits "
       "itself by worker_info)",
       BOTH),
    _c("loader.invariance.seeded",
       "with the same seeds, the loader yields the same examples in the same order",
       "PyTorch notes 'Reproducibility' (DataLoader generator and worker seeding); " + S002
       + ": seed every RNG your code touches",
       WB),
    _c("loader.accounting.epoch-coverage",
       "an epoch-based loader draws every training example exactly once per epoch (up to a declared drop of the "
       "last partial batch)",
       "PyTorch docs, DistributedSampler (drop_last and padding semantics)",
       BOTH, ("bb_batch_replay",)),
    _c("loader.accounting.tokens-seen",
       "the number of tokens the run reports having trained on equals the real (non-padding) tokens of the "
       "batches it stepped on",
       "nanoGPT train.py (tokens per iteration); Megatron-LM consumed_samples bookkeeping",
       BOTH),
    _c("loader.declared.global-batch",
       "each optimizer step consumes the declared global batch: micro-batch size x accumulation steps x ranks "
       "examples",
       S001 + ": micro-batch accumulation changes the effective batch; HF TrainingArguments docs "
       "(total train batch size)",
       BOTH, ("rank_data_distinct",)),
    _c("loader.declared.shuffle",
       "the loader shuffles exactly when declared; an epoch-based shuffle draws a new permutation every epoch",
       "PyTorch docs, DistributedSampler: call set_epoch() before each epoch, else every epoch has the same order",
       BOTH, ("bb_batch_replay", "batch_order")),
    _c("loader.state.resume-position",
       "after a resume the loader yields exactly the batches the uninterrupted run would have drawn next (epoch, "
       "position, permutation)",
       HF_TRAINER + "::test_can_resume_training; " + S000 + ": save the sampler and verify continuity after resume",
       BOTH, ("resume_continuity", "bb_batch_replay", "batch_order")),
    _c("loader.state.epoch-advances-once",
       "an epoch-based loader's epoch counter, and the permutation it seeds, advance exactly once per pass",
       "PyTorch docs, DistributedSampler.set_epoch",
       BOTH, ("bb_batch_replay", "batch_order")),
    _c("loader.numerics.bounded-length",
       "no batch is longer than the declared context length (nor than the model's position table)",
       S000 + ": a rare long sample that only appears late in an epoch; nanoGPT model.py (forward asserts the "
       "length against block_size)",
       BOTH, ("corpus_invariants", "bb_crash_site")),
    _c("loader.isolation.workers-distinct",
       "loader workers draw distinct examples and distinct random streams (no two workers duplicate an example "
       "or a random draw)",
       "PyTorch docs, torch.utils.data 'Randomness in multi-process data loading'",
       BOTH),
    _c("loader.isolation.training-split-only",
       "the training stream draws only documents of the training split",
       S003 + ": labels and splits checked before the model; " + S004 + ": train-test contamination",
       BOTH, ("bb_eval_overlap",)),

    # --------------------------------------------------------------------------------------------------- collate
    _c("collate.invariance.padding-side",
       "a document's ids, labels and positions relative to its real tokens do not depend on the padding side or "
       "on the other documents of its batch",
       S000 + ": right/left padding consistency; HF docs, DataCollatorWithPadding",
       WB, ("collate_contract",)),
    _c("collate.invariance.row-order",
       "row i of a batch holds example i, for every field (ids, mask, labels, positions in the same row order)",
       S000 + ": runtime asserts on the collate output",
       WB, ("collate_contract",)),
    _c("collate.accounting.mask-marks-real",
       "attention_mask is 1 exactly on real tokens and 0 exactly on padding",
       S000 + ": attention_mask = 1 for real tokens, 0 for PAD",
       BOTH, ("collate_contract", "batch_special_ids", "bb_pad_ids")),
    _c("collate.accounting.ignored-tracks-padding",
       "the share of ignored targets equals the share of padding plus what the run declares unlearned (e.g. a "
       "prompt): no real target ignored",
       S000 + ": the ignore_index fraction tracks the padding rate",
       BOTH, ("collate_contract", "bb_loss_padding")),
    _c("collate.declared.pad-id",
       "padding uses the declared pad id on the declared side",
       S000 + ": padding side consistency; " + S001 + ": pad_token_id consistent",
       BOTH, ("collate_contract", "batch_special_ids", "bb_pad_ids")),
    _c("collate.declared.padding-width",
       "a batch is as wide as the declared padding policy makes it (its longest row, a multiple, or a fixed "
       "length), never wider",
       "HF docs, DataCollatorWithPadding (padding='longest', pad_to_multiple_of); " + S000
       + ": padding and OOM triage",
       BOTH, ("padding_waste", "bb_golden_layout")),
    _c("collate.declared.dtype-shape",
       "ids and labels are integer (B, T) tensors and the mask has the shape and dtype the model declares",
       S000 + ": intermittent shape/dtype mismatch errors; runtime asserts on the collate output",
       BOTH, ("collate_contract",)),
    _c("collate.state.stateless",
       "collate keeps no state between calls: the same examples give the same batch whenever they are collated",
       S000 + ": convert intermittent failures into deterministic assertions",
       WB),
    _c("collate.numerics.ids-and-labels-in-range",
       "every input id is a vocabulary index and every label is a vocabulary index or the declared ignore value",
       S002 + ": check label ranges as a first step",
       BOTH, ("batch_special_ids", "collate_contract", "bb_crash_site")),
    _c("collate.isolation.own-row-labels",
       "each row's labels come from its own example only, never from another row",
       KARPATHY + ": use backprop to chart dependencies (rows of a batch must not mix)",
       BOTH, ("collate_contract", "bb_implied_labels")),
    _c("collate.isolation.packed-boundaries",
       "when examples are packed into one row with declared boundaries, no token attends or is positioned across "
       "a boundary",
       "HF docs, DataCollatorWithFlattening (position ids restart per packed sequence)",
       BOTH),

    # ---------------------------------------------------------------------------------- embeddings and positions
    _c("positions.invariance.relative-shift",
       "with a relative scheme (rotary, ALiBi), adding a constant to every position id changes no attention "
       "score and no logit",
       "Su et al., 'RoFormer' (2021), sec. 3 (rotary scores depend on relative position only)",
       BOTH, ("rope_properties", "shift_invariance", "bb_position_shift")),
    _c("positions.invariance.padding-offset",
       "a real token's position is its index among its row's real tokens, whatever padding precedes it",
       HF_GEN + "::test_left_padding_compatibility; " + S001 + ": off-by-one positions",
       BOTH, ("collate_contract", "rope_properties", "padding_invariance", "bb_padding_invariance")),
    _c("positions.accounting.no-silent-crop",
       "the model processes every position it is given: an input longer than its tables raises, never is "
       "cropped or wrapped",
       "nanoGPT model.py (forward asserts t <= block_size); " + S000 + ": behaviour at and over max context",
       BOTH),
    _c("positions.declared.scheme-parameters",
       "the position scheme runs with its declared parameters (rotary base and dimension, scaling, table size)",
       "RoFormer (2021) eq. 15 (frequencies base^(-2i/d)); HF LlamaConfig docs (rope_theta, rope_scaling)",
       WB, ("rope_properties",)),
    _c("positions.declared.ids-honoured",
       "position ids passed to the model are the positions it uses (not ignored, not recomputed from 0)",
       "HF LlamaModel.forward docs (position_ids); " + S000 + ": consistent Q/K positions",
       BOTH, ("bb_positions_used",)),
    _c("positions.state.derived-tables",
       "precomputed position tables (rotary cos/sin, sinusoids) equal their definition from the config before "
       "and after a load, in every dtype move",
       "RoFormer (2021); PyTorch docs, register_buffer(persistent=False) (derived buffers stay out of checkpoints)",
       BOTH, ("rope_properties", "bb_golden_init")),
    _c("positions.numerics.in-bounds",
       "every position id, cached offsets included, lies inside the position table",
       S000 + ": position_ids within table bounds",
       BOTH, ("bb_crash_site",)),
    _c("positions.numerics.rotation-preserves-norm",
       "a rotary embedding is a rotation: it keeps each query/key norm and is computed without precision loss at "
       "large positions",
       "RoFormer (2021), sec. 3.4 (properties of the rotary matrix)",
       WB, ("rope_properties",)),
    _c("positions.numerics.embedding-scale",
       "token and position embedding outputs are finite and at the scale of known-good runs at init",
       S002 + ": activation statistics by layer; " + S001 + ": bad initialization",
       BOTH, ("init_envelope", "bb_first_nonfinite")),
    _c("positions.isolation.per-row",
       "a row's positions depend only on its own mask and cache, never on another row's",
       HF_GEN + "::test_left_padding_compatibility",
       BOTH, ("rope_properties", "padding_invariance", "bb_padding_invariance")),

    # -------------------------------------------------------------------------------------- attention and masks
    _c("attention.invariance.padding",
       "a document's real-token logits are the same alone and inside a left- or right-padded batch",
       HF_COMMON + "::test_batching_equivalence; " + HF_GEN + "::test_left_padding_compatibility",
       BOTH, ("padding_invariance", "bb_padding_invariance")),
    _c("attention.invariance.backend",
       "attention implementations (eager, SDPA, flash, cached) agree on the same inputs and mask within the "
       "dtype's tolerance",
       HF_COMMON + "::test_eager_matches_sdpa_inference",
       WB, ("attend_contract",)),
    _c("attention.accounting.weights-are-distributions",
       "each query's attention weights are non-negative and sum to 1 over its allowed keys (softmax over the key "
       "axis)",
       S003 + ": softmax applied over the key dimension; Vaswani et al., 'Attention Is All You Need' (2017), eq. 1",
       BOTH, ("attend_contract", "bb_attention_distribution")),
    _c("attention.declared.mask-semantics",
       "the mask attention receives means what its producer declared: orientation (which value attends), "
       "boolean vs additive, shape broadcast to (B, H, Tq, Tk)",
       "PyTorch docs, scaled_dot_product_attention (attn_mask, is_causal); " + S003
       + ": mask orientation, broadcasting shape",
       WB, ("mask_contract", "attend_contract")),
    _c("attention.declared.scale",
       "scores are scaled by the declared factor (1/sqrt(head_dim) unless declared otherwise)",
       "Vaswani et al. (2017), eq. 1; " + S003 + ": scaling by sqrt(d_k)",
       WB, ("attend_contract",)),
    _c("attention.declared.heads",
       "heads are split and merged as declared (n_heads x head_dim), never mixing heads with batch or time",
       S003 + ": wrong transpose, mixing batch and head dimensions",
       BOTH, ("attend_contract", "bb_row_isolation")),
    _c("attention.state.mask-fresh",
       "the mask used by a forward is built for that forward's lengths, padding and cache; no mask is reused "
       "from another batch",
       S000 + ": mask shape/dtype, composing causal + padding masks",
       WB),
    _c("attention.numerics.finite-masked-softmax",
       "masked scores give finite softmax rows in the compute dtype (a representable fill value, fully masked "
       "rows handled)",
       S000 + ": masking in float32 before softmax, not large negatives in FP16",
       WB, ("mask_contract", "fp16_attention_stress")),
    _c("attention.numerics.reduced-precision-softmax",
       "softmax of large scores in bf16/fp16 matches an fp32 reference within the dtype's tolerance",
       S004 + ": compute attention in higher precision; " + S001 + ": softmax overflow",
       BOTH, ("fp16_attention_stress", "attend_contract")),
    _c("attention.isolation.causal",
       "the output at position t does not depend on any token after t",
       "Vaswani et al. (2017), sec. 3.2.3 (masked decoder self-attention); " + KARPATHY
       + ": use backprop to chart dependencies",
       BOTH, ("causality_probe", "mask_contract", "bb_causality")),
    _c("attention.isolation.padding-keys",
       "no real query attends to a padding key",
       S001 + ": padding positions masked in attention",
       BOTH, ("mask_contract", "padding_invariance", "bb_padding_invariance")),
    _c("attention.isolation.rows",
       "no information crosses batch rows: row i's outputs do not depend on row j's tokens",
       HF_COMMON + "::test_batching_equivalence; " + KARPATHY + ": use backprop to chart dependencies",
       BOTH, ("padding_invariance", "bb_row_isolation")),

    # ---------------------------------------------------------------------------- normalization/residual/MLP blocks
    _c("blocks.invariance.eval-deterministic",
       "in eval mode a forward is a deterministic function of its inputs: the same row twice gives identical "
       "outputs",
       HF_COMMON + "::test_determinism; " + S003 + ": training/eval mode bugs",
       BOTH, ("bb_eval_determinism", "eval_contract")),
    _c("blocks.invariance.batch-independent-norm",
       "normalization acts on each token's features; a row's outputs do not depend on batch size or batch "
       "composition",
       "Ba et al., 'Layer Normalization' (2016); " + HF_COMMON + "::test_batching_equivalence",
       BOTH, ("padding_invariance", "bb_row_isolation")),
    _c("blocks.accounting.every-layer-once",
       "every declared layer runs exactly once per forward, in order (none skipped, none repeated)",
       HF_COMMON + "::test_hidden_states_output (num_hidden_layers + 1 hidden states)",
       BOTH, ("module_composition", "bb_layers_once")),
    _c("blocks.declared.composition",
       "each block computes its declared composition (pre-norm: x + attn(norm(x)), then + mlp(norm(x)); "
       "post-norm where declared)",
       S001 + ": swapped LayerNorm/residual order; Xiong et al., 'On Layer Normalization in the Transformer "
       "Architecture' (2020)",
       WB, ("module_composition",)),
    _c("blocks.declared.norm-parameters",
       "normalization runs as declared: type (LayerNorm/RMSNorm), epsilon, affine parameters, over the feature "
       "dimension",
       "PyTorch docs, torch.nn.LayerNorm (normalized_shape: the last dimensions); " + S002 + ": LayerNorm",
       WB),
    _c("blocks.declared.dropout",
       "dropout runs with the declared probability in training forwards and not at all in evaluation or "
       "generation",
       "PyTorch docs, torch.nn.Dropout (identity in eval mode); " + S002 + ": train vs eval mode",
       BOTH, ("bb_eval_mode", "bb_eval_determinism", "eval_contract")),
    _c("blocks.declared.mlp",
       "the MLP uses the declared activation and width (e.g. GELU, 4 x d)",
       "Radford et al., GPT-2 (2019) / Vaswani et al. (2017), sec. 3.3 (position-wise feed-forward)",
       WB),
    _c("blocks.state.buffers-roundtrip",
       "every buffer a block uses round-trips through save/load or is rebuilt identically from the config",
       "PyTorch docs, Module.state_dict / register_buffer(persistent=...); " + S002 + ": checkpoint model state",
       BOTH, ("resume_continuity",)),
    _c("blocks.numerics.activation-envelope",
       "every module's output is finite and stays within the scale known-good runs show (no explosion or "
       "vanishing through depth)",
       S002 + ": activation quantiles per layer; " + S004 + ": NaN debugging, detect the first NaN site",
       BOTH, ("init_envelope", "nonfinite_origin", "bb_first_nonfinite")),
    _c("blocks.numerics.safe-normalization",
       "normalization divides by a positive epsilon-guarded quantity computed in at least fp32",
       S004 + ": division by zero when a variance estimate hits 0",
       BOTH, ("nonfinite_origin", "bb_first_nonfinite")),
    _c("blocks.numerics.init-scale",
       "parameters start with the declared initialization scale (e.g. std 0.02, residual projections scaled "
       "with depth)",
       "Radford et al., GPT-2 (2019), sec. 2.3 (residual init scaled by 1/sqrt(N)); " + S001
       + ": bad initialization",
       BOTH, ("init_envelope", "bb_golden_init")),
    _c("blocks.isolation.position-wise",
       "norms and MLPs act on each position and row alone: only attention mixes positions",
       "Vaswani et al. (2017), sec. 3.3 (position-wise feed-forward networks)",
       BOTH, ("causality_probe", "bb_causality", "padding_invariance")),

    # ------------------------------------------------------------------------------------------- head and tying
    _c("head.invariance.per-position",
       "a position's logits depend only on its own final hidden state",
       "Vaswani et al. (2017), sec. 3.4 (the output projection is applied per position)",
       BOTH),
    _c("head.accounting.logits-not-probabilities",
       "the model returns unnormalized logits (B, T, V) over the full vocabulary; the loss normalizes them "
       "exactly once",
       S003 + ": softmax applied before a loss that already expects logits",
       BOTH, ("output_contract", "bb_output_contract")),
    _c("head.accounting.parameter-count",
       "the parameter count a run reports counts each tensor once (tied weights once) and equals the model's",
       "nanoGPT model.py get_num_params; HF docs, PreTrainedModel.num_parameters",
       BOTH),
    _c("head.declared.tying",
       "with tying declared the output projection and the input embedding are one tensor for the whole run; "
       "without it they are two",
       "Press & Wolf, 'Using the Output Embedding to Improve Language Models' (2017); " + HF_COMMON
       + "::test_tied_weights_keys; " + S001 + ": forgetting to tie",
       BOTH, ("init_envelope", "bb_golden_model")),
    _c("head.declared.vocab-size",
       "the head's output dimension equals the embedding's vocabulary (at least the tokenizer's)",
       S001 + ": embedding-output projection dimensions (a mismatch can broadcast silently)",
       BOTH, ("output_contract", "bb_golden_model")),
    _c("head.state.tie-survives-load",
       "weights tied before a save, a device move or a wrap are still one tensor (with one optimizer state) "
       "after it",
       HF_COMMON + "::test_model_weights_reload_no_missing_tied_weights",
       BOTH, ("bb_resume_state",)),
    _c("head.numerics.initial-loss",
       "before training the next-token loss is close to ln V (a near-uniform prediction), not many times it",
       KARPATHY + ": verify loss @ init",
       BOTH, ("bb_output_contract",)),
    _c("head.numerics.finite-logits",
       "logits are finite, and the loss reads them in at least fp32",
       S000 + ": float32 softmax/loss, assert_finite on logits",
       BOTH, ("nonfinite_origin", "bb_first_nonfinite")),
    _c("head.isolation.labels-not-inputs",
       "the logits do not depend on the labels handed to the model with the batch (labels reach only the loss)",
       S004 + ": target leakage (a feature computed from the target)",
       BOTH, ("bb_label_isolation",)),

    # ------------------------------------------------------------------------------------------------------ loss
    _c("loss.invariance.batch-composition",
       "under a token-mean loss, a target's weight in the step's loss does not depend on which micro-batch, rank "
       "or padded batch holds it",
       GA_FIX + "; " + HF_TRAINER + "::test_gradient_accumulation_loss_alignment_with_model_loss",
       BOTH, ("bb_loss_normalization", "logit_grad_scale")),
    _c("loss.accounting.reported-equals-computed",
       "the loss a loop reports for a step comes from that step's forwards at the scale of one mean per-token "
       "loss (not times the accumulation, loss scale or world size)",
       "huggingface/transformers issue #37766 (reported loss grows with gradient_accumulation_steps); " + S002
       + ": trainer template (loss accounting under accumulation)",
       BOTH, ("train_step_contract",)),
    _c("loss.accounting.token-mean",
       "a token-mean loss averages the NLL over exactly the real targets: ignored positions count in neither "
       "the sum nor the count",
       "PyTorch docs, torch.nn.CrossEntropyLoss (reduction='mean' with ignore_index averages over non-ignored "
       "targets)",
       BOTH, ("loss_contract", "forward_loss_contract", "logit_grad_scale")),
    _c("loss.accounting.weights-sum-to-one",
       "with a mean loss, the per-target weights of one optimizer step sum to 1 over the global batch (all "
       "micro-batches and ranks)",
       GA_FIX,
       BOTH, ("bb_loss_normalization", "logit_grad_scale")),
    _c("loss.declared.next-token",
       "the target of position t is token t+1 of the same row: the shift happens exactly once (in the collator "
       "or in the loss)",
       S001 + ": verify whether labels are shifted by one; HF LlamaForCausalLM.forward docs (labels shifted "
       "inside the model)",
       BOTH, ("loss_contract", "collate_contract", "bb_implied_labels", "bb_label_alignment")),
    _c("loss.declared.ignore-value",
       "targets carrying the run's declared ignore value get zero weight, and no other target does",
       "PyTorch docs, CrossEntropyLoss(ignore_index); HF docs (labels set to -100 are ignored)",
       BOTH, ("loss_contract", "logit_grad_scale", "bb_loss_padding")),
    _c("loss.declared.objective",
       "the loss is the declared objective: softmax cross-entropy of the logits, with only the declared label "
       "smoothing or auxiliary terms",
       S002 + ": mistaken label smoothing, custom loss vs built-in cross_entropy; " + S003
       + ": loss/activation pairs",
       BOTH, ("loss_contract",)),
    _c("loss.state.step-local",
       "a step's loss is built from that step's forwards only: no running sum or earlier graph enters its "
       "backward",
       "PyTorch FAQ, 'Don't accumulate history across your training loop'",
       BOTH, ("bb_step_local_backward",)),
    _c("loss.numerics.stable-log-softmax",
       "the loss uses a stable log-sum-exp in at least fp32 and is finite whenever the logits are",
       S002 + ": numerically stable softmax/cross-entropy; " + S004 + ": log of zero",
       BOTH, ("nonfinite_origin", "bb_first_nonfinite")),
    _c("loss.numerics.logit-gradient-bound",
       "the gradient of a token-mean loss w.r.t. one target's logits has L1 norm <= 2/N (N: the step's targets) "
       "and is zero where there is no target",
       S002 + ": dL/dlogits = (softmax - onehot) / B",
       BOTH, ("logit_grad_scale", "bb_loss_normalization")),
    _c("loss.numerics.above-floor",
       "no train or evaluation loss falls below the data's irreducible entropy (where it is known)",
       S003 + ": a metric that looks too good suggests leakage; " + S004 + ": suspicious metrics",
       WB, ("loss_vs_floor",)),
    _c("loss.numerics.seed-envelope",
       "the loss per step stays within the spread of known-good runs of the same recipe with other seeds",
       S004 + ": compare loss curves across runs; TrainCheck (OSDI 2025): invariants from reference runs",
       BOTH, ("bb_golden_loss",)),
    _c("loss.isolation.no-padding-target",
       "padding is never a target, and no position is trained to predict across the end of its document into "
       "padding",
       S000 + ": labels = ignore_index on PAD",
       BOTH, ("loss_contract", "collate_contract", "logit_grad_scale", "bb_loss_padding")),

    # ---------------------------------------------------------------------------------- optimizer and its groups
    _c("optimizer.invariance.implementation",
       "the update does not depend on how the optimizer is executed (for-loop, foreach, fused, wrapped by a "
       "scaler or sharding) beyond rounding",
       "pytorch/pytorch test/test_optim.py::test_foreach_matches_forloop",
       WB),
    _c("optimizer.accounting.every-parameter-once",
       "every trainable parameter is in exactly one param group: none missing, none twice",
       S003 + ": are the intended parameters in the optimizer; torch.optim (a parameter in two groups raises)",
       BOTH, ("optimizer_config", "bb_params_in_optimizer", "bb_golden_config")),
    _c("optimizer.accounting.updates-applied",
       "every parameter with a non-zero gradient changes at a step that is not skipped and has a non-zero LR",
       S003 + ": whether parameters change after optimizer.step()",
       BOTH, ("grad_hygiene", "bb_updates_applied")),
    _c("optimizer.accounting.step-counter",
       "the optimizer's step counter (Adam's t) equals the number of updates it applied",
       "Kingma & Ba, 'Adam' (2015), algorithm 1 (bias correction by t)",
       BOTH, ("bb_resume_continuity",)),
    _c("optimizer.declared.hyperparameters",
       "each group runs with its declared lr, betas, eps and weight decay",
       S001 + ": AdamW hyperparameters; PyTorch docs, torch.optim per-parameter options",
       BOTH, ("optimizer_config", "bb_golden_config")),
    _c("optimizer.declared.decay-rule",
       "weight decay applies to exactly the parameters the decay rule declares (e.g. matmul weights; not biases "
       "or norms)",
       "nanoGPT model.py configure_optimizers ('Any parameters that is 2D will be weight decayed'); " + S000
       + ": excluding bias/LayerNorm from weight decay",
       BOTH, ("optimizer_config", "bb_golden_config")),
    _c("optimizer.declared.algorithm",
       "the declared algorithm runs: decoupled decay for AdamW (never an L2 term in the loss), declared momentum "
       "and flags",
       "Loshchilov & Hutter, 'Decoupled Weight Decay Regularization' (2019); " + S002
       + ": weight decay vs L2 vs AdamW",
       BOTH, ("bb_golden_config",)),
    _c("optimizer.state.roundtrip",
       "the optimizer's state (moments, step counts, group hyperparameters) round-trips exactly through "
       "save/load, attached to the same parameters",
       "PyTorch tutorial 'Saving and loading a general checkpoint'; pytorch test/test_optim.py::"
       "test_state_dict_deterministic",
       BOTH, ("resume_continuity", "bb_resume_continuity", "bb_golden_update")),
    _c("optimizer.state.one-step-per-window",
       "the optimizer steps exactly once per accumulation window",
       S002 + ": the minimal training-step sequence (step only when the accumulation window ends)",
       BOTH, ("train_step_contract", "bb_resume_continuity")),
    _c("optimizer.numerics.state-precision",
       "optimizer moments and master weights are kept in at least fp32 when parameters are low precision",
       "Micikevicius et al., 'Mixed Precision Training' (2018), sec. 3.1 (fp32 master weights)",
       BOTH, ("bb_state_precision", "optimizer_config")),
    _c("optimizer.numerics.update-ratio",
       "the ratio of update to weight magnitude per step stays in the range known-good runs show",
       "Stanford CS231n notes, 'Neural Networks Part 3' (ratio of weight updates to weights, about 1e-3)",
       BOTH, ("bb_golden_update",)),
    _c("optimizer.isolation.frozen-untouched",
       "frozen parameters and parameters outside the optimizer never change, and a group's settings apply to "
       "its own parameters only",
       S003 + ": frozen parameters, missing parameter groups",
       BOTH, ("optimizer_config",)),

    # ----------------------------------------------------------------------------------------------- LR schedule
    _c("schedule.invariance.function-of-step",
       "the LR of optimizer step s depends only on s and the declared schedule (not on micro-batches, "
       "evaluation calls or ranks)",
       S002 + ": scheduler semantics, per-step scheduler.step()",
       BOTH, ("lr_schedule", "bb_golden_lr")),
    _c("schedule.accounting.reported-equals-used",
       "the LR the loop or scheduler reports for a step is the LR the optimizer stepped with",
       "PyTorch docs, LRScheduler.get_last_lr",
       BOTH, ("lr_schedule", "bb_lr_shape")),
    _c("schedule.declared.shape",
       "the LR follows the declared schedule (warmup length, peak, decay shape, floor, horizon) in the declared "
       "units (optimizer steps)",
       "HF docs, get_cosine_schedule_with_warmup; " + S002 + ": warmup + cosine scheduler",
       BOTH, ("lr_schedule", "bb_golden_lr")),
    _c("schedule.declared.per-group",
       "the schedule scales each group from its own base LR (declared ratios between groups stay)",
       "PyTorch docs, LambdaLR (one multiplicative factor applied to each group's initial lr)",
       BOTH, ("bb_golden_lr",)),
    _c("schedule.state.advances-once",
       "the schedule advances exactly once per optimizer step, after it",
       "PyTorch UserWarning 'Detected call of lr_scheduler.step() before optimizer.step()'; " + S002
       + ": scheduler.step() placement",
       BOTH, ("lr_schedule", "grad_hygiene", "train_step_contract", "bb_schedule_steps")),
    _c("schedule.state.resume",
       "after a resume the schedule is at the position the uninterrupted run would be",
       HF_TRAINER + "::test_can_resume_training; " + S002 + ": save the scheduler state",
       BOTH, ("resume_continuity", "bb_golden_lr")),
    _c("schedule.numerics.range",
       "the LR is finite, non-negative and never above the declared peak",
       S002 + ": warmup + cosine multiplier in [0, 1]",
       BOTH, ("lr_schedule", "bb_golden_lr")),
    _c("schedule.isolation.no-feedback",
       "evaluation, probes and logging never move the LR (only a declared metric-driven scheduler reads a metric)",
       "PyTorch docs, ReduceLROnPlateau (the one scheduler declared to read a validation metric)",
       BOTH, ("lr_schedule", "bb_golden_lr")),

    # --------------------------------------------------------------------------------------------- gradient path
    _c("gradients.invariance.accumulation",
       "k micro-batches accumulated give the gradient of one forward over the whole batch, within rounding",
       GA_FIX + "; accelerate docs, 'Performing gradient accumulation'",
       BOTH, ("bb_loss_normalization", "logit_grad_scale", "train_step_contract", "bb_golden_grad_norm")),
    _c("gradients.invariance.loss-scale",
       "with loss scaling, the update does not depend on the scale: the optimizer and the clipping see unscaled "
       "gradients",
       "PyTorch AMP examples, 'Working with Unscaled Gradients'; Micikevicius et al. (2018), sec. 3.2",
       BOTH, ("scaler_monitor", "logit_grad_scale", "bb_clip_scaled")),
    _c("gradients.accounting.reported-norm",
       "the gradient norm a loop reports is the global pre-clip norm (all parameters, all ranks, unscaled) of "
       "the gradients the backward produced",
       "PyTorch docs, clip_grad_norm_ (returns the total norm of all gradients viewed as one vector)",
       BOTH, ("bb_reported_grad_norm", "rank_grad_norm_agreement", "train_step_contract", "grad_hygiene")),
    _c("gradients.accounting.true-gradient",
       "the gradient the optimizer steps with is the derivative of the loss, up to one positive factor per step "
       "(clipping, scaling): finite differences agree with it",
       "PyTorch docs, torch.autograd.gradcheck (finite differences against the analytical gradient); Stanford "
       "CS231n notes, 'Neural Networks Part 3' (gradient checks)",
       BOTH, ("bb_gradient_check",)),
    _c("gradients.accounting.present",
       "after the backward every parameter the loss depends on holds a gradient (nothing cut off by a detach or "
       "an unused branch)",
       S003 + ": whether gradients are zero; " + S004 + ": disconnected gradients",
       BOTH, ("grad_hygiene", "bb_grads_present", "bb_golden_grad_norm")),
    _c("gradients.declared.clip-norm",
       "clipping runs as declared: on the global norm over all parameters and shards, with the declared max "
       "norm (post-clip norm = min(norm, max))",
       "PyTorch docs, clip_grad_norm_ and FullyShardedDataParallel.clip_grad_norm_ (norm over all ranks' shards)",
       BOTH, ("grad_hygiene", "train_step_contract", "rank_grad_norm_agreement")),
    _c("gradients.declared.unscale-clip-step-order",
       "with a loss scaler, gradients are unscaled, then clipped, then stepped",
       "PyTorch AMP examples, 'Gradient clipping' (scaler.unscale_ before clip_grad_norm_); " + S002
       + ": unscale -> clip -> step",
       BOTH, ("scaler_monitor", "bb_clip_scaled")),
    _c("gradients.declared.accumulation-steps",
       "the optimizer steps after exactly the declared number of micro-batches, and cross-rank sync happens once "
       "per window",
       "PyTorch docs, DistributedDataParallel.no_sync; accelerate docs, gradient accumulation",
       BOTH, ("reduction_probe", "train_step_contract")),
    _c("gradients.declared.precision",
       "autocast and loss scaling run as declared (fp16 with an enabled scaler, scale > 1; bf16/fp32 as set)",
       "PyTorch AMP docs (torch.autocast; GradScaler for float16)",
       BOTH, ("scaler_monitor", "bb_golden_config")),
    _c("gradients.state.cleared-once",
       "gradients are cleared once per optimizer step, after it and before the next window's first backward, "
       "never inside a window",
       S002 + ": zero_grad placement and accumulation math; " + S003 + ": zero_grad used incorrectly",
       BOTH, ("grad_hygiene", "train_step_contract", "bb_grads_cleared")),
    _c("gradients.state.scaler-advances",
       "the loss scaler updates once per optimizer step (grows after good steps, backs off and skips on "
       "overflow)",
       "PyTorch docs, GradScaler.step/update",
       BOTH, ("scaler_monitor",)),
    _c("gradients.state.graph-released",
       "a step's autograd graph is released when the step ends: nothing the loop keeps holds it",
       "PyTorch FAQ, 'Don't accumulate history across your training loop'",
       BOTH, ("graph_retention", "bb_graphs_released")),
    _c("gradients.numerics.finite-updates",
       "the gradients the optimizer applies are finite: a step with non-finite gradients is skipped, never "
       "applied",
       "PyTorch docs, GradScaler.step (skips optimizer.step() when gradients hold inf/NaN); " + S004
       + ": NaN debugging",
       BOTH, ("scaler_monitor", "nonfinite_origin", "bb_scaler_skips", "bb_first_nonfinite")),
    _c("gradients.numerics.norm-envelope",
       "the global gradient norm stays within the range of known-good runs of the same recipe",
       S000 + ": per-step metrics panel (grad norm); " + S002 + ": compare the global norm to a baseline",
       BOTH, ("bb_golden_grad_norm",)),
    _c("gradients.numerics.scaler-health",
       "a loss scaler skips only a small share of steps; its scale does not collapse",
       S000 + ": a GradScaler skipping a large fraction of steps",
       BOTH, ("scaler_monitor", "bb_scaler_skips")),
    _c("gradients.isolation.no-stale",
       "a step's gradient holds contributions of that step's micro-batches only (none from earlier steps, "
       "probes or evaluation)",
       S002 + ": zero_grad placement; " + S003 + ": zero_grad or step used incorrectly",
       BOTH, ("grad_hygiene", "bb_grads_cleared")),

    # ------------------------------------------------------------------------------------- checkpoint and resume
    _c("checkpoint.invariance.resume-equals-uninterrupted",
       "a run saved at step s and resumed continues as the uninterrupted run would: same weights, batches, LR "
       "and losses",
       HF_TRAINER + "::test_can_resume_training and ::test_resume_training_with_randomness; " + S000
       + ": loss continuity after resume",
       BOTH, ("resume_continuity", "bb_resume_continuity", "bb_rng_continuity", "bb_batch_replay", "bb_golden_lr",
              "bb_resume_state")),
    _c("checkpoint.accounting.complete",
       "a checkpoint holds every state the run's future depends on: weights, optimizer, scheduler, scaler, data "
       "position, step, RNG streams",
       S002 + ": checkpoint model, optimizer, scheduler, GradScaler and RNG states; " + S000
       + ": checkpoint/resume and RNG",
       BOTH, ("resume_continuity", "bb_resume_state")),
    _c("checkpoint.accounting.step",
       "the step a checkpoint records is the number of optimizer updates its weights contain",
       "PyTorch tutorial 'Saving and loading a general checkpoint' (epoch stored with the state)",
       BOTH, ("resume_continuity", "bb_resume_continuity")),
    _c("checkpoint.declared.strict-load",
       "loading fills every declared tensor (no missing or unexpected key ignored), re-ties tied weights, keeps "
       "declared dtypes",
       "PyTorch docs, Module.load_state_dict(strict=True); " + HF_COMMON
       + "::test_model_weights_reload_no_missing_tied_weights",
       WB, ("resume_continuity",)),
    _c("checkpoint.declared.resume-source",
       "a run asked to resume loads the checkpoint it was pointed at (the latest, if so declared) and a fresh run "
       "loads none",
       "HF docs, Trainer.train(resume_from_checkpoint=...)",
       BOTH, ("bb_resume_continuity",)),
    _c("checkpoint.state.rng",
       "every RNG stream (Python, NumPy, torch CPU and device, per rank, per worker) is saved and restored",
       S002 + ": RNG provenance in checkpoints; " + HF_TRAINER + "::test_resume_training_with_randomness",
       BOTH, ("resume_continuity", "bb_rng_continuity")),
    _c("checkpoint.state.atomic",
       "a checkpoint is complete or absent: a resume never reads a half-written one",
       "huggingface/transformers PR #27820 'fix: non-atomic checkpoint save'",
       WB),
    _c("checkpoint.state.save-is-side-effect-free",
       "saving changes no training state: a run with a save trains exactly as one without",
       "PyTorch docs, Module.state_dict (returns references to the live tensors)",
       WB),
    _c("checkpoint.numerics.bitwise-roundtrip",
       "tensors round-trip with their dtype and value (no silent downcast of fp32 weights or moments)",
       "PyTorch docs, torch.save (storage dtype preserved); DeepSpeed docs, zero_to_fp32 (fp32 master weights)",
       BOTH, ("resume_continuity", "bb_resume_state")),
    _c("checkpoint.isolation.per-rank-state",
       "on resume each rank restores its own rank-specific state (RNG, data shard) and the same shared state as "
       "every other rank",
       S002 + ": capture per-rank RNG streams; " + S000 + ": per-rank sampler seeding after resume",
       BOTH, ("resume_continuity", "rank_agreement", "bb_cross_rank")),

    # ------------------------------------------------------------------------------------------ ranks (DDP/ZeRO)
    _c("ranks.invariance.world-size",
       "for the same global batch, the reduced gradient and the update do not depend on the number of ranks "
       "(within rounding)",
       "PyTorch notes 'Distributed Data Parallel' (gradients averaged by all-reduce); accelerate "
       "test_utils/scripts/test_sync.py (DDP vs single-process gradients)",
       BOTH, ("reduction_probe", "bb_loss_normalization")),
    _c("ranks.accounting.reduced-once",
       "gradients are reduced across ranks exactly once per optimizer step, as the declared mean (never twice, "
       "never skipped)",
       S000 + ": exactly-once gradient reduction; PyTorch DDP docs",
       BOTH, ("reduction_probe", "rank_grad_norm_agreement", "bb_loss_normalization", "bb_reported_grad_norm")),
    _c("ranks.accounting.global-metrics",
       "metrics reported for the run are aggregated over all ranks with the right weights (summed counts, "
       "token-weighted means)",
       "PyTorch docs, torch.distributed.all_reduce; DistributedSampler docs (shards padded to equal length)",
       BOTH, ("rank_collectives", "bb_eval_loss")),
    _c("ranks.declared.sharding",
       "the declared parallelism runs (world size, ZeRO/FSDP stage); shards of states and gradients cover every "
       "parameter exactly once",
       "DeepSpeed docs, ZeRO stages 1-3; PyTorch docs, FullyShardedDataParallel",
       WB),
    _c("ranks.declared.seeding",
       "per-rank seeding is as declared: identical model init on every rank, distinct data and dropout streams",
       S001 + ": same random seed across workers; PyTorch DDP notes (parameters broadcast from rank 0)",
       BOTH, ("rank_agreement", "rank_data_distinct", "bb_cross_rank")),
    _c("ranks.declared.collectives-in-lockstep",
       "every rank issues the same collectives in the same order; no rank-local value decides whether one runs",
       "PyTorch docs, torch.distributed (collectives are called by every process of the group; "
       "TORCH_DISTRIBUTED_DEBUG=DETAIL checks their consistency)",
       WB),
    _c("ranks.state.replicas-identical",
       "data-parallel replicas hold identical parameters after every step and after every load",
       "Megatron-LM check_param_hashes_across_dp_replicas; PyTorch DDP notes",
       BOTH, ("rank_agreement", "bb_cross_rank", "resume_continuity")),
    _c("ranks.state.buffers-synced",
       "buffers that affect the forward are the same on every rank",
       "PyTorch docs, DistributedDataParallel(broadcast_buffers=True)",
       BOTH, ("bb_cross_rank",)),
    _c("ranks.numerics.reduction-precision",
       "cross-rank reductions lose no precision beyond a declared compression, and every rank gets the same "
       "result",
       "PyTorch docs, DDP communication hooks (fp16/bf16 compression is an explicit choice)",
       BOTH, ("rank_agreement", "rank_grad_norm_agreement")),
    _c("ranks.isolation.data-disjoint",
       "within a global batch the ranks' shards are disjoint and together make up the batch",
       "PyTorch docs, DistributedSampler; " + S000 + ": per-rank data and sampler seeding",
       BOTH, ("rank_data_distinct", "rank_agreement", "bb_cross_rank")),

    # ------------------------------------------------------------------------------------------------ evaluation
    _c("eval.invariance.batching",
       "a token-mean evaluation loss does not depend on the evaluation batch size, padding or order",
       S003 + ": averaging over padded tokens, mixing micro and macro averaging",
       WB, ("eval_contract",)),
    _c("eval.invariance.repeatable",
       "evaluating the same weights twice gives the same number",
       S003 + ": training/eval mode bugs (dropout makes metrics noisy)",
       BOTH, ("bb_eval_determinism", "eval_contract")),
    _c("eval.accounting.reported-equals-computed",
       "the evaluation loss the loop reports is the next-token NLL of its evaluation forwards over real targets, "
       "with its declared aggregation",
       S001 + ": metrics and evaluation parity (training metric matches the evaluation definition)",
       BOTH, ("eval_contract", "bb_eval_loss")),
    _c("eval.accounting.whole-split",
       "evaluation covers the declared part of the split, each document once (no dropped last batch, no "
       "duplicates from padded shards)",
       "PyTorch docs, DistributedSampler (drop_last=False pads shards with repeated indices)",
       BOTH, ("bb_eval_coverage",)),
    _c("eval.accounting.perplexity",
       "a reported perplexity is exp of the token-mean NLL it accompanies",
       "HF docs, 'Perplexity of fixed-length models'",
       BOTH),
    _c("eval.declared.mode",
       "evaluation runs with the model in eval mode and without gradients, and restores the mode it found",
       "nanoGPT train.py estimate_loss (@torch.no_grad, model.eval(), then model.train()); " + S002
       + ": train vs eval mode",
       BOTH, ("eval_contract", "bb_eval_mode")),
    _c("eval.declared.split",
       "evaluation reads the split it declares (validation unless it declares the training split on purpose)",
       S003 + ": train and evaluation splits truly separate",
       BOTH, ("split_overlap", "bb_eval_overlap")),
    _c("eval.state.no-side-effects",
       "evaluation changes no weight, optimizer, scheduler or scaler state",
       S002 + ": diagnostics must not change training; nanoGPT train.py estimate_loss",
       BOTH, ("bb_eval_side_effects",)),
    _c("eval.numerics.not-below-floor",
       "the evaluation loss is finite and not below the data's irreducible entropy (where it is known)",
       S004 + ": suspiciously good metrics point at leakage",
       WB, ("loss_vs_floor",)),
    _c("eval.isolation.no-update",
       "evaluation trains nothing: no backward, no optimizer step, no gradient left behind",
       S003 + ": a model that looks stable in training but fails at evaluation time",
       BOTH, ("bb_eval_side_effects",)),

    # ------------------------------------------------------------------------------- generation and the KV cache
    _c("generation.invariance.cached-equals-full",
       "decoding with a KV cache gives the logits (and greedy tokens) of one full forward over the same tokens",
       HF_GEN + "::test_generate_continue_from_past_key_values",
       BOTH, ("kv_cache_consistency", "bb_cache_consistency")),
    _c("generation.invariance.left-padding",
       "batched generation from left-padded prompts gives each prompt what it gets alone",
       HF_GEN + "::test_left_padding_compatibility",
       BOTH, ("kv_cache_consistency", "bb_cache_consistency")),
    _c("generation.invariance.chunked-prefill",
       "prefilling a prompt in chunks gives the cache and logits of one prefill",
       HF_GEN + "::test_generate_continue_from_past_key_values (continuing from a partial cache)",
       WB, ("attend_contract", "mask_contract")),
    _c("generation.accounting.cache-length",
       "the cache holds exactly the tokens processed so far and appends each new one at its current length",
       "HF docs, Cache.get_seq_length; " + S000 + ": KV-cache/position drift",
       WB, ("kv_cache_consistency",)),
    _c("generation.accounting.stop",
       "generation stops at EOS or the declared token budget and returns exactly the tokens it generated",
       "HF docs, GenerationConfig (max_new_tokens, eos_token_id)",
       BOTH, ("bb_generation",)),
    _c("generation.declared.decoding",
       "the declared decoding runs (greedy without sampling; temperature, top-k, top-p as configured)",
       "HF docs, GenerationConfig (do_sample, temperature, top_k, top_p)",
       BOTH, ("bb_generation",)),
    _c("generation.declared.no-grad-eval-mode",
       "generation runs in eval mode without gradients",
       "HF docs, GenerationMixin.generate (runs under torch.no_grad); " + S002 + ": train vs eval mode",
       BOTH, ("bb_eval_mode",)),
    _c("generation.state.position-offset",
       "each decode step's positions continue from the cache (past length plus index, counting real tokens only)",
       S000 + ": correct past_len offset with a KV cache",
       BOTH, ("rope_properties", "kv_cache_consistency", "bb_cache_consistency")),
    _c("generation.state.fresh-cache",
       "each generation call starts from an empty cache, and no cache reaches a training forward",
       "HF docs, 'Caching' (a cache object belongs to one generation)",
       BOTH, ("bb_generation",)),
    _c("generation.numerics.cache-precision",
       "the cache stores keys and values in the compute dtype: cached and uncached results agree within its "
       "tolerance",
       HF_GEN + "::test_generate_continue_from_past_key_values (rtol/atol comparison)",
       BOTH, ("kv_cache_consistency", "bb_cache_consistency")),
    _c("generation.isolation.decode-mask",
       "a decode step attends to its own row's cached real tokens and itself only (never pads, never another "
       "row's cache)",
       HF_GEN + "::test_left_padding_compatibility",
       BOTH, ("mask_contract", "attend_contract", "kv_cache_consistency")),
)

CONTRACTS: tuple[Contract, ...] = _CONTRACTS
CONTRACTS_BY_ID: dict[str, Contract] = {c.id: c for c in CONTRACTS}

# (component, kind) -> why the cell has no contract. Every cell of the grid holds at least one contract today; a
# cell that loses its last one must be argued here (tests/detectors/test_contracts.py).
EMPTY_CELLS: dict[tuple[str, str], str] = {}

BASELINES = ("detect_anomaly", "loss_curve", "crash_triage")  # scored alongside the suite, mapped to no contract

# Detectors that check a catalogue contract only in part, or with an assumption a correct loop can break (the
# audit of issue 22); each still implements the contracts it is mapped to, and is to be reworked into them.
DETECTOR_CAVEATS: dict[str, str] = {
    "bb_label_alignment": "fires only when the loss equals each position's own-token NLL: one alternative of "
                          "loss.declared.next-token",
    "bb_clip_scaled": "checks one consequence of unscale-before-clip (stepped norm below 1/sqrt(scale))",
    "bb_golden_layout": "a golden comparison of a few layout features, not the document format itself",
    "bb_loss_padding": "judges that real targets get weight only for the classes no correct loop masks by id "
                       "(EOS, a pad id that is a real token): a loop may mask other real targets on purpose (prompts)",
    "bb_output_contract": "sanity thresholds ('rows are probabilities', 'loss > 2 ln V before training')",
    "bb_eval_side_effects": "weights count only when changed between two evaluation forwards and kept (checked "
                            "from a loop's second such evaluation on); a scheduler only when stepped twice or more "
                            "in one evaluation",
}


# ------------------------------------------------------------------------------------------------ coverage
def _detector_tracks() -> dict[str, str]:
    """{detector id: its track} of every built-in detector (plugins registered at run time are not the suite's)."""
    from faultbench.detectors.api import all_detectors

    return {d: cls.track for d, cls in all_detectors().items() if cls.__module__.startswith("faultbench.detectors.")}


def status(contract: Contract) -> str:
    """The contract's coverage: ``checked`` (a detector checks it today), ``uncheckable`` (argued: no track
    can) or ``uncovered``."""
    if contract.detectors:
        return "checked"
    return "uncheckable" if contract.uncheckable else "uncovered"


def _counts(group: list[Contract]) -> dict:
    out = {"contracts": len(group), "checked": 0, "uncovered": 0, "uncheckable": 0}
    for c in group:
        out[status(c)] += 1
    return out


def coverage(contracts: Iterable[Contract] | None = None) -> dict:
    """Counts over the catalogue (or ``contracts``): how many contracts, how many a detector checks, per track
    (checkable by it / checked by one of its detectors), per component, per kind, per cell, and the ids no
    detector checks although a track could (``uncovered_ids``). A contract with no detector and no
    ``uncheckable`` reason is uncovered."""
    contracts = list(CONTRACTS if contracts is None else contracts)
    tracks_of = _detector_tracks()
    registered = set(tracks_of)
    mapped = {d for c in contracts for d in c.detectors}
    cells = {(comp, kind): [c for c in contracts if c.component == comp and c.kind == kind]
             for comp in COMPONENT_NAMES for kind in KIND_NAMES}
    return {
        **_counts(contracts),
        "uncovered_ids": [c.id for c in contracts if status(c) == "uncovered"],
        "uncheckable_ids": [c.id for c in contracts if status(c) == "uncheckable"],
        "per_track": {t: {"checkable": sum(t in c.tracks for c in contracts),
                          "checked": sum(any(tracks_of.get(d) == t for d in c.detectors) for c in contracts)}
                      for t in TRACKS},
        "per_component": {comp: _counts([c for c in contracts if c.component == comp]) for comp in COMPONENT_NAMES},
        "per_kind": {kind: _counts([c for c in contracts if c.kind == kind]) for kind in KIND_NAMES},
        "cells": {"total": len(cells),
                  "with_contracts": sum(bool(v) for v in cells.values()),
                  "argued_empty": sum(not v and k in EMPTY_CELLS for k, v in cells.items()),
                  "with_a_detector": sum(any(c.detectors for c in v) for v in cells.values()),
                  "missing": [f"{comp} x {kind}" for (comp, kind), v in cells.items()
                              if not v and (comp, kind) not in EMPTY_CELLS]},
        "detectors_mapped": len(mapped & registered),
        "detectors_without_contract": sorted(d for d in registered - mapped if d not in BASELINES),
    }


def as_json(contracts: Iterable[Contract] | None = None) -> list[dict]:
    """The catalogue as a list of {id, component, kind, statement, source, tracks, detectors, uncheckable}."""
    return [c.to_dict() for c in (CONTRACTS if contracts is None else contracts)]


# ------------------------------------------------------------------------------------------------ markdown
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _checked_by(c: Contract) -> str:
    if c.detectors:
        return ", ".join(f"`{d}`" for d in c.detectors)
    return f"cannot be checked: {c.uncheckable}" if c.uncheckable else "not checked yet"


def markdown(contracts: Iterable[Contract] | None = None) -> str:
    """The catalogue as a grid document: a coverage summary, then per component a table of its contracts."""
    contracts = list(CONTRACTS if contracts is None else contracts)
    cov = coverage(contracts)
    lines = [
        "# Contract catalogue",
        "",
        "What every correct causal-LM training run keeps, per component (rows) and kind of property (columns), "
        "with the source each contract was taken from, the tracks that can check it and the detectors that do "
        "today. Generated from `detectors/contracts.py` by `python -m faultbench.detectors.contracts`; do not "
        "edit by hand (`tests/detectors/test_contracts.py` fails when this file and `markdown()` differ).",
        "",
        "Kinds:",
        "",
        *[f"- **{name}**: {definition}" for name, definition in KINDS],
        "",
        "## Coverage",
        "",
        f"- contracts: {cov['contracts']}; checked by at least one detector: {cov['checked']}; "
        f"not checked yet: {cov['uncovered']}; cannot be checked: {cov['uncheckable']}",
        f"- cells (component x kind): {cov['cells']['total']}; with at least one contract: "
        f"{cov['cells']['with_contracts']}; argued empty: {cov['cells']['argued_empty']}; "
        f"with a contract a detector checks: {cov['cells']['with_a_detector']}",
        *[f"- {t}: can check {v['checkable']} contracts; a {t} detector checks {v['checked']}"
          for t, v in cov["per_track"].items()],
        f"- detectors mapped to a contract: {cov['detectors_mapped']} (baselines not mapped: "
        f"{', '.join(f'`{b}`' for b in BASELINES)}); detectors that implement no contract: "
        + (", ".join(f"`{d}`" for d in cov["detectors_without_contract"]) or "none"),
        "",
        "| component | contracts | checked | not checked yet | cannot be checked |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {comp} | {v['contracts']} | {v['checked']} | {v['uncovered']} | {v['uncheckable']} |"
          for comp, v in cov["per_component"].items()],
        "",
        "| kind | contracts | checked | not checked yet | cannot be checked |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {kind} | {v['contracts']} | {v['checked']} | {v['uncovered']} | {v['uncheckable']} |"
          for kind, v in cov["per_kind"].items()],
        "",
        "Not checked yet: " + (", ".join(f"`{i}`" for i in cov["uncovered_ids"]) or "none") + ".",
        "",
    ]
    if DETECTOR_CAVEATS:
        lines += ["Detectors that check their contracts only in part (issue 22's audit):", ""]
        lines += [f"- `{d}`: {_cell(why)}" for d, why in DETECTOR_CAVEATS.items()]
        lines.append("")
    for comp, scope in COMPONENTS:
        lines += [f"## {comp}", "", f"{scope}.", "", "| kind | contract | source | tracks | detectors |",
                  "| --- | --- | --- | --- | --- |"]
        for kind in KIND_NAMES:
            row = [c for c in contracts if c.component == comp and c.kind == kind]
            for c in row:
                lines.append(f"| {kind} | `{c.id}`: {_cell(c.statement)} | {_cell(c.source)} | "
                             f"{', '.join(c.tracks) or '-'} | {_cell(_checked_by(c))} |")
            if not row:
                why = EMPTY_CELLS.get((comp, kind), "no contract yet, and no argument why")
                lines.append(f"| {kind} | (empty) | - | - | {_cell(why)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
