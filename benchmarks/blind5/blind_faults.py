"""The fifth blind fault set: bugs engineers have shipped, written without reading the detectors.

Loaded as a plugin (``faultbench bench --plugin benchmarks/blind5/blind_faults.py --only-plugin-faults``).
Each fault replaces one seam of the reference (``ref``) or of the HF stack (``hf``) and cites the public thread
its bug class comes from. See README.md.
"""

import math

import torch
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.config import TrainConfig
from faultbench.model.data import IGNORE_INDEX

# --------------------------------------------------------------------------------------------------- reference


@fault(
    "b5_parallel_residual",
    seam="model.gpt.Block.forward",
    title="Block computes attention and MLP in parallel from the same input (GPT-J/NeoX layout) in a sequential model",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="Block.forward returns x + attn(ln_1(x)) + mlp(ln_2(x)): the MLP no longer sees the attention "
    "output of its own layer, the architecture differs from the one configured and checkpoints are not "
    "interchangeable with it.",
    fix="x = x + attn(ln_1(x)); then x + mlp(ln_2(x)).",
    references=(
        "huggingface/transformers#18695: 'Add a use_parallel_residual argument to control the residual computing "
        "way' (GPT-NeoX checkpoints trained with the sequential residual layout)",
        "ml-explore/mlx-lm#586: 'Add parallel_residual setting to gptneox' (sequential-layout GPT-NeoX "
        "derivatives otherwise run with the parallel layout)",
    ),
    manifest=Manifest(check="metric_differs", steps=60, params={"min_gap": 0.01}),
)
def block_parallel(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
    """Parallel residual."""
    return x + self.attn(self.ln_1(x), rope, attn_mask, cache, layer_idx) + self.mlp(self.ln_2(x))


@fault(
    "b5_targets_count_every_slot",
    seam="model.loss.count_targets",
    title="Loss normalized by every slot of the batch (pads and ignored labels included), not by the real targets",
    subsystem="loss",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="count_targets returns labels.numel(): the summed cross-entropy is divided by B*T, so each batch's "
    "loss and gradient shrink by its padding fraction and short-document batches weigh less.",
    fix="Count labels[:, 1:] != ignore_index.",
    references=(
        "huggingface/transformers#32832: 'Causal lanuage modeling should consider loss masks for pad tokens.'",
        "huggingface/transformers#46204: 'Fix `num_items_in_batch` over-counting for causal LM losses' (divisor "
        "larger than the number of real targets)",
    ),
    manifest=Manifest(check="loss_below", steps=30, params={"min_gap": 0.05}),
)
def count_every_slot(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Every slot counted."""
    return int(labels.numel())


@fault(
    "b5_eval_first_batch_only",
    seam="model.evaluate.evaluate",
    title="evaluate() breaks after its first batch: the validation loss is measured on a handful of documents",
    subsystem="eval",
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="A leftover 'max eval batches' shortcut returns after one batch, so the reported validation loss "
    "is that of the first batch_size documents only: noisy and biased by their lengths.",
    fix="Iterate over every validation batch.",
    references=(
        "NVIDIA/DeepLearningExamples#299: 'Fixed wrong val loss being logged' (one validation batch's loss "
        "reported instead of the average over all batches)",
        "rasbt/LLMs-from-scratch#312: validation loss computed over only eval_iter batches (one batch of a small "
        "validation loader)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.01}),
)
def evaluate_first_batch(model, docs, pad_id: int, batch_size: int, precision: str = "fp32",
                         pad_side: str = "right") -> float:
    """One batch only."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for i in range(0, len(docs), batch_size):
            batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}  # noqa: F821
            with autocast_context(precision, device.type):  # noqa: F821
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            n = count_targets(batch["labels"])  # noqa: F821
            total += lm_loss(logits, batch["labels"], n).item() * n  # noqa: F821
            count += n
            break
    finally:
        model.train(was_training)
    return total / count


@fault(
    "b5_cosine_full_period",
    seam="model.optim.lr_at",
    title="Cosine decay taken over a full period: the LR falls to min_lr mid-run and climbs back to the peak",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="lr_at uses cos(2*pi*progress) (num_cycles=1 instead of 0.5): half-way the LR is at its floor, "
    "and the run ends at the peak LR instead of annealed.",
    fix="cos(pi * progress): one half-cosine from lr to min_lr.",
    references=(
        "Hugging Face Transformers docs, Optimization, get_cosine_schedule_with_warmup: num_cycles defaults to "
        "0.5, a half-cosine from the peak to 0 "
        "(https://huggingface.co/docs/transformers/main_classes/optimizer_schedules)",
        "ModelScope Twinkle docs, CosineWarmupScheduler: num_cycles=0.5 decays to the minimum, num_cycles=1 "
        "decays and returns to the maximum "
        "(https://modelscope.github.io/twinkle-web/docs/components/lrscheduler/cosinewarmupscheduler/)",
    ),
    manifest=Manifest(check="lr_ratio", steps=20, variant={"train": {"warmup_steps": 2}},
                      params={"min_ratio": 2.0, "max_ratio": 1e9, "step": 19}),
)
def lr_at_full_period(step: int, cfg: TrainConfig) -> float:
    """A full cosine period."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(2 * math.pi * progress)) * (cfg.lr - cfg.min_lr)


@fault(
    "b5_adam_coupled_decay",
    seam="model.optim.configure_optimizer",
    title="Adam with weight_decay (L2 added to the gradient) where AdamW's decoupled decay was intended",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer builds torch.optim.Adam with the same groups: the decay term is added to the "
    "gradient and then normalized by Adam's second moment, so it is not a decay at all for large-gradient "
    "weights and a huge one for small-gradient weights.",
    fix="torch.optim.AdamW (decoupled weight decay).",
    references=(
        "Loshchilov & Hutter, 'Decoupled Weight Decay Regularization', arXiv:1711.05101 (ICLR 2019)",
        "pytorch/pytorch#48793: 'Weight_decay in torch.Adam' (Adam's weight_decay is an L2 penalty, not decoupled "
        "decay)",
        "pytorch/pytorch#21250: 'Implement AdamW optimizer'",
    ),
    manifest=Manifest(check="metric_differs", steps=60, params={"min_gap": 0.01}),
)
def configure_adam_l2(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Coupled L2 decay."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


@fault(
    "b5_truncate_half_context",
    seam="model.data.truncate",
    title="Documents cut to half the context length (a max_length copied from another recipe)",
    subsystem="data",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="truncate uses max_len // 2: every document longer than half the context is cut (its EOS kept), "
    "so the model never trains or is evaluated on the second half of the positions it was built for.",
    fix="Cut at max_len.",
    references=(
        "huggingface/transformers#21463: '[examples] improve block_size warning message' (run_clm's default "
        "block_size of 1024 below the model's max length)",
        "huggingface/transformers#26069: 'refactor: change default block_size in block size > max position "
        "embeddings'",
        "huggingface/autotrain-advanced#467: '[BUG] block_size gets reset to 1024 from 4096 for LLMs'",
    ),
    manifest=Manifest(check="metric_differs", steps=60, params={"min_gap": 0.01}),
)
def truncate_half(ids: list[int], max_len: int, eos_id: int) -> list[int]:
    """Half the context."""
    max_len = max_len // 2
    if len(ids) <= max_len:
        return ids
    return ids[: max_len - 1] + [eos_id]


@fault(
    "b5_init_every_parameter",
    seam="model.gpt.GPT.init_weights",
    title="init_weights draws every parameter from N(0, init_std): LayerNorm gains start near 0 instead of 1",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="init_weights loops over model.parameters() and normal_-initializes each one, LayerNorm weights "
    "included: every norm multiplies its output by ~0.02, the residual branches and the logits start almost "
    "silent and training crawls.",
    fix="Initialize Linear and Embedding weights only; leave LayerNorm gains at 1 and biases at 0.",
    references=(
        "huggingface/transformers#143: 'bug in init_bert_weights' (LayerNorm gamma/beta re-initialized from a "
        "normal distribution)",
        "huggingface/transformers#171: 'LayerNorm initialization' (gains filled with 1.0, biases with 0)",
    ),
    manifest=Manifest(check="metric_differs", steps=60, params={"min_gap": 0.02}),
)
def init_every_parameter(self) -> None:
    """Every parameter normal-initialized."""
    std = self.config.init_std
    for param in self.parameters():
        nn.init.normal_(param, mean=0.0, std=std)


@fault(
    "b5_rng_state_of_fresh_generator",
    seam="model.checkpoint.capture_rng_state",
    title="The checkpoint saves the state of a fresh torch.Generator, not of the global one",
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="capture_rng_state records torch.Generator().get_state() (a new, default-seeded generator) "
    "instead of torch.get_rng_state(): on resume the global generator is reset to that default state, so the "
    "dropout masks after a resume differ from the uninterrupted run's.",
    fix="torch.get_rng_state() (the default generator's state).",
    references=(
        "huggingface/transformers#17055: 'Fix RNG reload in resume training from epoch checkpoint' (RNG states "
        "not restored on resume)",
        "huggingface/accelerate#3960: '[Bug] RNG states from multiple backends (e.g. CUDA + HPU) are saved but "
        "only one is restored on load_state'",
    ),
    manifest=Manifest(scenario="resume", steps=12, check="extra_at_least", variant={"model": {"dropout": 0.1}},
                      params={"key": "resume_loss_diff", "faulty_min": 0.001, "clean_max": 0.0}),
)
def capture_fresh_generator() -> dict:
    """A fresh generator's state."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: F821 (model.checkpoint's)
    state = {
        "python": random.getstate(),  # noqa: F821
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,  # noqa: F821
                  "has_gauss": has_gauss, "cached_gaussian": cached},
        "torch": torch.Generator().get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# ------------------------------------------------------------------------------------------------------------- HF

_LLAMA = "transformers.models.llama.modeling_llama"


@fault(
    "b5_hf_rmsnorm_one_plus_weight",
    seam=f"{_LLAMA}.LlamaRMSNorm.forward",
    target="hf",
    title="RMSNorm scales by (1 + weight) (Gemma's convention) in a model whose gains are initialized at 1",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="LlamaRMSNorm.forward returns (1 + weight) * x_normed: every norm starts with gain 2 and the "
    "parametrization differs from the initialization and from Llama checkpoints.",
    fix="weight * x_normed for Llama (Gemma stores weight - 1 and adds 1).",
    references=(
        "huggingface/transformers#40796: '[`RMSNorm`] Fix rms norm init for models that center around 1' ((1 + "
        "weight) norms initialized at 1 double their gain)",
        "linkedin/Liger-Kernel#74: '[bug fix] Gemma needs RMSNorm with 1.0 offset' (Llama- and Gemma-style "
        "RMSNorm mixed up)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.01}),
)
def rmsnorm_one_plus(self, hidden_states):
    """(1 + weight)."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (1.0 + self.weight) * hidden_states.to(input_dtype)


@fault(
    "b5_hf_mlp_gate_up_swapped",
    seam=f"{_LLAMA}.LlamaMLP.forward",
    target="hf",
    title="SwiGLU's activation applied to up_proj instead of gate_proj (the projections swapped)",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="LlamaMLP.forward computes down(up(x)) activated times gate(x): trained from scratch it still "
    "learns, but loaded weights are used in the wrong roles and the init-time statistics differ.",
    fix="down_proj(act_fn(gate_proj(x)) * up_proj(x)).",
    references=(
        "Shazeer, 'GLU Variants Improve Transformer', arXiv:2002.05202 (SwiGLU: the activation gates one "
        "projection, the other stays linear)",
        "devvrit/matformer#4: 'Apply activation before gating in MLP layer' (gated MLP computed differently from "
        "Llama's down(act(gate(x)) * up(x)))",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.001}),
)
def mlp_swapped(self, x):
    """gate and up swapped."""
    return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


@fault(
    "b5_hf_rope_theta_ignored",
    seam=f"{_LLAMA}.LlamaRotaryEmbedding.compute_default_rope_parameters",
    target="hf",
    title="rope_theta read from the wrong place: the inverse frequencies use a base of 100 instead of the config's",
    subsystem="position",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="compute_default_rope_parameters falls back to a hard-coded small base when the config's "
    "rope_parameters lookup is bypassed: the slowest pair wraps within ~600 tokens and far positions alias.",
    fix="Use config.rope_parameters['rope_theta'].",
    references=(
        "huggingface/transformers#43281: 'fix: access `rope_theta` correctly in `Llama4VisionRotaryEmbedding`' "
        "(rope_theta moved into rope_parameters in v5)",
        "sgl-project/SpecForge#265: '`rope_theta` from config isn't used?' (rotary embeddings fall back to the "
        "default base)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.001}),
)
def rope_small_base(config, **kwargs):
    """Base 100."""
    base = 100.0
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_factor = 1.0
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, attention_factor


@fault(
    "b5_hf_chunked_attention",
    seam="transformers.masking_utils.causal_mask_function",
    target="hf",
    title="Causal mask restricted to fixed chunks of 8 tokens (chunked attention copied from another model)",
    subsystem="mask",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="causal_mask_function also requires kv_idx // 8 == q_idx // 8: each token attends only within its "
    "own 8-token chunk, cutting the context at every chunk boundary.",
    fix="kv_idx <= q_idx only (chunking belongs to models trained with it).",
    references=(
        "huggingface/transformers#37351: '[`Llamma4`] Chunked Attention' (chunked-attention mask bug)",
        "huggingface/transformers#37329: 'more fixes for post-training llama4' (the chunked mask at fault)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.01}),
)
def causal_chunked(batch_idx: int, head_idx: int, q_idx: int, kv_idx: int) -> bool:
    """Chunks of 8."""
    return (kv_idx <= q_idx) & (kv_idx // 8 == q_idx // 8)


@fault(
    "b5_hf_mean_then_divided",
    seam="transformers.loss.loss_utils.fixed_cross_entropy",
    target="hf",
    title="Cross-entropy mean-reduced and then divided by num_items_in_batch again",
    subsystem="loss",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="fixed_cross_entropy always takes the token mean, then divides by num_items_in_batch when it is "
    "given: the loss and gradients are divided by the token count twice, training barely moves.",
    fix="reduction='sum' when num_items_in_batch is given, 'mean' otherwise; divide once.",
    references=(
        "huggingface/transformers#34191: 'Fix Gradient Accumulation issue' (2024 fix: sum-reduced loss divided by "
        "num_items_in_batch)",
        "huggingface/transformers#35663: 'About GA loss in the latest transformers version' (follow-up: GA loss "
        "mis-scaled)",
        "Hugging Face blog, 'Fixing Gradient Accumulation', 2024-10-16 "
        "(https://huggingface.co/blog/gradient_accumulation)",
    ),
    manifest=Manifest(check="loss_below", steps=30, params={"min_gap": 0.5}),
)
def ce_mean_then_divided(source, target, num_items_in_batch=None, ignore_index: int = -100, **kwargs):
    """Divided twice."""
    loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index, reduction="mean")
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


@fault(
    "b5_hf_cosine_restarts",
    seam="transformers.optimization._get_cosine_schedule_with_warmup_lr_lambda",
    target="hf",
    title="Cosine lambda uses |cos|: the schedule bounces back to the peak LR instead of annealing",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The multiplier takes the absolute value of the cosine over two half-periods, so after the "
    "midpoint the LR climbs again and the run ends near the peak LR.",
    fix="max(0, 0.5 * (1 + cos(pi * num_cycles * 2 * progress))).",
    references=(
        "Hugging Face Transformers docs, Optimization: get_cosine_schedule_with_warmup and "
        "get_cosine_with_hard_restarts_schedule_with_warmup schedule shapes "
        "(https://huggingface.co/docs/transformers/main_classes/optimizer_schedules)",
        "huggingface/transformers#29852: 'cosine_with_restarts schedule not restart' (the cosine lambda's shape "
        "over num_cycles)",
    ),
    manifest=Manifest(check="lr_ratio", steps=20, params={"min_ratio": 2.0, "max_ratio": 1e9, "step": 18}),
)
def cosine_abs(current_step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float,
               min_lr_rate: float = 0.0):
    """|cos| over two periods."""
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = abs(math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


@fault(
    "b5_hf_eval_on_train",
    seam="transformers.trainer.Trainer.get_eval_dataloader",
    target="hf",
    title="The evaluation dataloader is built over the training set",
    subsystem="eval",
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="get_eval_dataloader returns the train dataloader (eval_dataset=train_dataset in the script): "
    "the reported validation loss is a training loss and hides overfitting.",
    fix="Build the eval dataloader over eval_dataset.",
    references=(
        "huggingface/peft#657: 'Typo in clm-prompt-tuning.mdx' (train_dataset and eval_dataset set to the same "
        "'train' split)",
        "JJGO/shrinkbench#7: 'Fix loading of validation data set' (the training set used as the validation set)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.001}),
)
def eval_on_train(self, eval_dataset=None):
    """Training data."""
    return self.get_train_dataloader()


@fault(
    "b5_hf_dataset_half_indexed",
    seam="targets.hf.data.TextDataset.__getitem__",
    target="hf",
    title="Dataset item i reads document i // 2: half the corpus repeated twice, the other half never seen",
    subsystem="data",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="__getitem__ maps index i to text i // 2 (a leftover from a pairs-per-row layout): every "
    "document in the first half appears twice per epoch and the second half is never trained on.",
    fix="self.texts[i].",
    references=(
        "huggingface/datasets#3754: 'Overflowing indices in `select`' (select silently wraps indices and repeats "
        "rows)",
        "huggingface/datasets#3459: 'dataset.filter overwriting previously set dataset._indices values, resulting "
        "in the wrong elements being selected.'",
    ),
    manifest=Manifest(check="metric_differs", steps=60, params={"min_gap": 0.001}),
)
def getitem_half(self, i: int) -> dict:
    """Index halved."""
    ids = self.tokenizer(self.texts[i // 2], truncation=True, max_length=self.tokenizer.model_max_length)["input_ids"]
    return {"input_ids": ids}
