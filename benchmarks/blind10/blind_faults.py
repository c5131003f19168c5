"""Blind set 10: plugin faults written without reading the detectors (reference and HF targets).

Each is a bug engineers have shipped; ids are neutral on purpose.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.config import TrainConfig
from faultbench.model.data import IGNORE_INDEX


@fault(
    "b10_01",
    seam="model.evaluate.evaluate",
    title="Validation loss averaged over every real input token instead of over the predicted ones",
    subsystem="eval",
    also_acceptable=("loss",),
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate weights each batch's summed loss correctly but divides the total by the number of real "
    "tokens in attention_mask, which counts each document's first token although nothing predicts it: the "
    "reported nats per token (and perplexity) are too low by a factor (n-1)/n that depends on document length.",
    fix="Divide by the number of predicted targets (count_targets), the same count the loss was summed over.",
    references=("EleutherAI lm-evaluation-harness discussions of token- vs target-count normalisation in "
                "perplexity; HF docs 'Perplexity of fixed-length models' (only the predicted tokens count)",),
    manifest=Manifest(check="metric_differs", steps=20, params={"min_gap": 0.05}),
)
def evaluate(model, docs, pad_id: int, batch_size: int, precision: str = "fp32", pad_side: str = "right") -> float:
    """The denominator counts input tokens (BOS included), not predicted targets."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nats, seen = 0.0, 0
    try:
        for first in range(0, len(docs), batch_size):
            chunk = collate(docs[first : first + batch_size], pad_id, pad_side)  # noqa: F821 (model.evaluate's)
            batch = {name: t.to(device) for name, t in chunk.items()}
            with autocast_context(precision, device.type):  # noqa: F821
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            targets = count_targets(batch["labels"])  # noqa: F821
            nats += float(lm_loss(logits, batch["labels"], targets)) * targets  # noqa: F821
            seen += int(batch["attention_mask"].sum())
    finally:
        model.train(was_training)
    return nats / seen


@fault(
    "b10_02",
    seam="model.gpt.GPT.init_weights",
    title="LayerNorm gains drawn from the small normal init meant for matrices",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="init_weights re-initializes every module with a 'weight' attribute (LayerNorm included) from "
    "N(0, init_std): the norm gains start near 0 instead of 1, so every pre-norm block and the final norm "
    "scale their outputs down ~50x and learning starts from an almost dead network.",
    fix="Initialize only Linear and Embedding weights from the normal; leave LayerNorm weight=1, bias=0.",
    references=("huggingface/transformers issues on _init_weights re-initialising LayerNorm/RMSNorm weights "
                "(e.g. 'norm weights initialised to normal instead of ones' after post_init changes)",),
    manifest=Manifest(check="loss_above", steps=40, params={"min_gap": 0.1}),
)
def init_weights(self) -> None:
    """Every module's weight tensor drawn from N(0, init_std), norms too."""
    std = self.config.init_std
    for module in self.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            torch.nn.init.normal_(weight, mean=0.0, std=std)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.nn.Parameter):
            torch.nn.init.zeros_(bias)
    depth_scale = std / math.sqrt(2 * self.config.n_layer)
    for block in self.blocks:
        torch.nn.init.normal_(block.attn.proj.weight, mean=0.0, std=depth_scale)
        torch.nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=depth_scale)


@fault(
    "b10_03",
    seam="model.loss.lm_loss",
    title="Negative log-likelihood taken on raw logits (no log-softmax before nll_loss)",
    subsystem="loss",
    trigger="always",
    symptoms=("divergence", "silent-quality"),
    explanation="lm_loss calls F.nll_loss on the logits, which expects log-probabilities: the 'loss' is minus "
    "the target logit, unbounded below. Training pushes target logits up without any normalisation, the "
    "reported loss goes negative and the model's distribution is never trained.",
    fix="F.cross_entropy on logits (or log_softmax before nll_loss).",
    references=("PyTorch forums: 'NLLLoss gives negative loss' / 'loss is negative' (answer: NLLLoss expects "
                "log-probabilities, apply log_softmax or use CrossEntropyLoss)",),
    manifest=Manifest(check="loss_below", steps=30, params={"min_gap": 1.0}),
)
def lm_loss(logits, labels, num_targets=None, ignore_index: int = IGNORE_INDEX):
    """nll_loss over unnormalised scores."""
    V = logits.size(-1)
    scores = logits[:, :-1].float().reshape(-1, V)
    targets = labels[:, 1:].reshape(-1)
    summed = F.nll_loss(scores, targets, ignore_index=ignore_index, reduction="sum")
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)  # noqa: F821 (model.loss's)
    return summed / max(num_targets, 1)


@fault(
    "b10_04",
    seam="model.optim.lr_at",
    title="The schedule's floor read as a ratio of the peak: cosine decays to almost zero",
    subsystem="optimizer",
    trigger="after-step",
    symptoms=("silent-quality",),
    explanation="lr_at treats cfg.min_lr (an absolute learning rate, 3e-4) as the fraction of the peak to keep "
    "(as transformers' cosine_with_min_lr 'min_lr_rate' does): the floor becomes lr * min_lr ~ 1e-6, so the "
    "end of training runs at a learning rate 300x lower than configured.",
    fix="Decay from lr to min_lr as an absolute value (or convert the config field explicitly).",
    references=("huggingface/transformers: get_cosine_with_min_lr_schedule_with_warmup takes min_lr or "
                "min_lr_rate; confusion between the two reported in issues on the scheduler kwargs",),
    manifest=Manifest(check="lr_ratio", steps=30, params={"min_ratio": 0.0, "max_ratio": 0.5, "step": 29}),
)
def lr_at(step: int, cfg: TrainConfig) -> float:
    """min_lr used as a multiplier of lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    frac = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.min_lr * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


@fault(
    "b10_05",
    seam="model.attention.build_attention_mask",
    title="Query rows of the mask numbered from 0 even when earlier tokens sit in the KV cache",
    subsystem="mask",
    also_acceptable=("position", "model"),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="build_attention_mask places the queries at key positions 0..T_q-1 instead of at the last T_q "
    "columns (it forgets the cache length). Training and prefill are unaffected (T_q == T_k), but in cached "
    "decoding the single new query is treated as position 0: it may attend only to the first cached token and "
    "itself, so generation with the cache diverges from the full forward.",
    fix="Offset the query positions by the cache length: arange(T_k - T_q, T_k).",
    references=("huggingface/transformers: _make_causal_mask(..., past_key_values_length) - decoding bugs when "
                "the causal mask ignores past_key_values_length (several model ports, e.g. issues on "
                "incorrect generation with use_cache=True)",),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-2, "clean_max": 1e-4}),
)
def build_attention_mask(attention_mask, query_len: int, dtype):
    """Queries assumed to start at column 0."""
    batch, key_len = attention_mask.shape
    right_aligned = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    if query_len == key_len and right_aligned:
        return None
    rows = torch.arange(query_len, device=attention_mask.device).view(-1, 1)
    cols = torch.arange(key_len, device=attention_mask.device).view(1, -1)
    visible = ((cols <= rows).unsqueeze(0) & attention_mask.bool().unsqueeze(1)) | (cols == rows).unsqueeze(0)
    out = torch.zeros((batch, 1, query_len, key_len), dtype=dtype, device=attention_mask.device)
    return out.masked_fill(~visible.unsqueeze(1), torch.finfo(dtype).min)


@fault(
    "b10_06",
    seam="model.precision.autocast_context",
    title="The precision table maps 'bf16' to float16: a bf16 run autocasts to fp16 with no gradient scaler",
    subsystem="precision",
    trigger="amp-only",
    symptoms=("silent-quality",),
    explanation="autocast_context looks the dtype up in a table whose bf16 entry says torch.float16. The grad "
    "scaler is (correctly) disabled for bf16, so the run computes in float16 without loss scaling: small "
    "gradients underflow to zero and the run's numerics are not bf16's.",
    fix="Map 'bf16' to torch.bfloat16 (and keep fp16 behind a GradScaler).",
    references=("PyTorch AMP docs: float16 needs GradScaler, bfloat16 does not; HF accelerate/transformers "
                "issues where bf16=True ended up running half precision (dtype mapping mistakes)",),
    manifest=Manifest(check="extra_at_least", steps=2,
                      variant={"model": {"init_std": 0.002}, "train": {"precision": "bf16"}},
                      params={"key": "grad_zero_fraction", "faulty_min": 0.05, "clean_max": 0.01}),
)
def autocast_context(precision: str, device_type: str):
    """bf16 mapped to float16."""
    half_types = {"fp16": torch.float16, "bf16": torch.float16}
    enabled = precision in half_types
    return torch.autocast(device_type=device_type, dtype=half_types.get(precision, torch.float16), enabled=enabled)


@fault(
    "b10_07",
    seam="model.checkpoint.load_checkpoint",
    title="The LR scheduler is stepped once after loading 'to catch up', so the resumed schedule runs a step ahead",
    subsystem="checkpoint",
    also_acceptable=("optimizer",),
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="load_checkpoint restores the scheduler state and then calls scheduler.step() once more, "
    "believing the saved state predates the last optimizer step. The state already counts that step, so every "
    "resumed step uses the learning rate of the following step: warmup and decay are shifted and the resumed "
    "run no longer matches the uninterrupted one.",
    fix="Load the scheduler state as saved; never step it outside the training loop.",
    references=("PyTorch forums: 'resume training LR scheduler off by one' (calling scheduler.step() after "
                "load_state_dict); Lightning issue on scheduler stepped twice on resume",),
    manifest=Manifest(scenario="resume", steps=12, check="extra_at_least",
                      params={"key": "resume_loss_diff", "faulty_min": 0.002, "clean_max": 0.0}),
)
def load_checkpoint(run, directory) -> None:
    """Scheduler advanced after restoring it."""
    directory = Path(directory)  # noqa: F821 (model.checkpoint's)
    meta = read_meta(directory)  # noqa: F821
    if meta.get("format") != FORMAT:  # noqa: F821
        raise CheckpointError(f"unsupported checkpoint format {meta.get('format')!r}")  # noqa: F821
    blob = directory / "state.pt"
    if not blob.exists() or _sha256(blob) != meta["sha256"]:  # noqa: F821
        raise CheckpointError(f"{blob} is missing or corrupted")  # noqa: F821
    mismatch = _config_mismatch(meta["config"], run.config.to_dict())  # noqa: F821
    if mismatch:
        raise CheckpointError("config differs: " + "; ".join(mismatch))  # noqa: F821
    if meta["tokenizer_sha256"] != run.tokenizer.sha256:
        raise CheckpointError("checkpoint was written with another tokenizer")  # noqa: F821
    saved = torch.load(blob, map_location=run.config.train.device, weights_only=True)
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    run.scheduler.step()  # catch up with the optimizer step taken just before saving
    run.scaler.load_state_dict(saved["scaler"])
    run.sampler.load_state_dict(saved["sampler"])
    run.step = saved["step"]
    run.history = [StepRecord(**{k: v for k, v in rec.items() if k != "tokens_per_s"})  # noqa: F821
                   for rec in saved["history"]]
    restore_rng_state(saved["rng"][run.rank])  # noqa: F821


_LLAMA = "transformers.models.llama.modeling_llama"


@fault(
    "b10_08",
    target="hf", seam=f"{_LLAMA}.LlamaRMSNorm.forward",
    title="RMSNorm applies its gain as (1 + weight), a convention of another architecture, to ones-initialised weights",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="LlamaRMSNorm.forward multiplies the normalised states by (1 + weight), as Gemma's RMSNorm does "
    "(whose weight is zero-initialised). Llama initialises the weight to ones, so every norm starts with a gain "
    "of 2 and the learned gains are offset by one: the residual stream and the logits are scaled differently "
    "from the architecture the config describes, and converted checkpoints would be wrong.",
    fix="weight * normalised (Llama); use (1 + weight) only with zero-initialised weights (Gemma).",
    references=("huggingface/transformers: GemmaRMSNorm uses (1 + weight) while LlamaRMSNorm uses weight; "
                "issues about ported/converted checkpoints where the +1 offset was applied to the wrong family",),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 0.02}),
)
def rmsnorm_forward_offset_gain(self, hidden_states):
    """Gain applied as 1 + weight."""
    in_dtype = hidden_states.dtype
    h = hidden_states.float()
    h = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + self.variance_epsilon)
    return (h * (1.0 + self.weight.float())).to(in_dtype)


@fault(
    "b10_09",
    target="hf", seam="transformers.optimization._get_cosine_schedule_with_warmup_lr_lambda",
    title="Cosine schedule written as cos(pi * num_cycles * progress): with num_cycles=0.5 it stops half way down",
    subsystem="optimizer",
    trigger="after-step",
    symptoms=("silent-quality",),
    explanation="The cosine factor drops the factor 2 in cos(pi * 2 * num_cycles * progress). With the default "
    "num_cycles=0.5 only a quarter wave is traced: the learning rate ends near half its peak instead of "
    "near zero, so the end of training never anneals.",
    fix="0.5 * (1 + cos(pi * 2 * num_cycles * progress)).",
    references=("transformers get_cosine_schedule_with_warmup docstring: num_cycles=0.5 'decrease from the max "
                "value to 0 following a half-cosine'; forum threads on schedulers that do not reach zero",),
    manifest=Manifest(check="lr_ratio", steps=16, params={"min_ratio": 5.0, "max_ratio": 1000.0, "step": 15}),
)
def cosine_lambda_quarter_wave(current_step, *, num_warmup_steps, num_training_steps, num_cycles, min_lr_rate=0.0):
    """Missing factor 2 in the cosine."""
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    done = (current_step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    wave = 0.5 * (1.0 + math.cos(math.pi * num_cycles * done))
    return max(0.0, min_lr_rate + (1.0 - min_lr_rate) * wave)


@fault(
    "b10_10",
    target="hf", seam="transformers.trainer.Trainer._save_rng_state",
    title="RNG states always written under the per-process file name, which a single-process resume never reads",
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="_save_rng_state names the file rng_state_{process_index}.pth even when world_size is 1, while "
    "the loader looks for rng_state.pth in that case: it finds nothing, logs that it could not restore the RNG "
    "and continues. The resumed run draws different dropout masks (and shuffles) than the uninterrupted one.",
    fix="Write rng_state.pth when world_size <= 1 (or make save and load share one naming function).",
    references=("huggingface/transformers: 'Didn't find an RNG file, if you are resuming a training that was "
                "launched in a distributed fashion, reproducibility is not guaranteed' - save/load naming "
                "mismatches reported in resume-reproducibility issues",),
    manifest=Manifest(scenario="resume", steps=16, check="extra_at_least", variant={"recipe": "resume"},
                      params={"key": "resume_loss_gap", "faulty_min": 1e-3, "clean_max": 0.0}),
)
def save_rng_state_per_process_name(self, output_dir):
    """Per-process name in single-process runs."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(),  # noqa: F821 (transformers.trainer's)
              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    os.makedirs(output_dir, exist_ok=True)  # noqa: F821
    torch.save(states, os.path.join(output_dir, f"rng_state_{self.args.process_index}.pth"))  # noqa: F821


@fault(
    "b10_11",
    target="hf", seam="transformers.data.data_collator.pad_without_fast_tokenizer_warning",
    title="After padding, the attention mask is rebuilt as ones_like(input_ids): pads look like real tokens",
    subsystem="collate",
    also_acceptable=("mask",),
    trigger="rare-batch",
    symptoms=("silent-quality",),
    explanation="The padding helper overwrites the tokenizer's attention mask with torch.ones_like(input_ids) "
    "(a custom collator's 'every token is real' shortcut). The labels still ignore pads, so with right padding "
    "nothing changes for real tokens; with left padding every real token attends to the pad tokens before it, "
    "so the loss and the learned model depend on how much padding a row got.",
    fix="Keep the attention mask tokenizer.pad returns (1 for tokens, 0 for pads).",
    references=("huggingface/transformers warning 'We strongly recommend passing in an attention_mask since "
                "your input_ids may be padded'; forum threads on custom collators building attention_mask as "
                "ones_like(input_ids) with left padding",),
    manifest=Manifest(check="metric_differs", steps=16, variant={"recipe": "left_pad"}, params={"min_gap": 0.02}),
)
def pad_mask_all_ones(tokenizer, *pad_args, **pad_kwargs):
    """Mask overwritten with ones after padding."""
    import torch

    flags = getattr(tokenizer, "deprecation_warnings", None)
    if flags is None:
        out = tokenizer.pad(*pad_args, **pad_kwargs)
    else:
        previous = flags.get("Asking-to-pad-a-fast-tokenizer", False)
        flags["Asking-to-pad-a-fast-tokenizer"] = True
        try:
            out = tokenizer.pad(*pad_args, **pad_kwargs)
        finally:
            flags["Asking-to-pad-a-fast-tokenizer"] = previous
    if "attention_mask" in out:
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out


@fault(
    "b10_12",
    target="hf", seam="transformers.trainer.Trainer.get_train_dataloader",
    title="Training dataloader built with the evaluation sampler: no shuffling, the same documents in file order",
    subsystem="data",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="get_train_dataloader passes sampler_fn=self._get_eval_sampler (copied from the eval loader): "
    "training reads the dataset sequentially, every epoch and every seed in the same order, so the run no "
    "longer depends on the data seed and any ordering of the source file (sorted, grouped) leaks into training.",
    fix="Use self._get_train_sampler for training.",
    references=("PyTorch forums/StackOverflow: 'forgot shuffle=True in the training DataLoader' as a "
                "classic cause of poor or order-dependent training",),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 0.01}),
)
def train_dataloader_sequential(self):
    """Eval sampler for the training set."""
    if self.train_dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                batch_size=self._train_batch_size, sampler_fn=self._get_eval_sampler,
                                is_training=True)


@fault(
    "b10_13",
    seam="model.distributed.global_target_count",
    title="Target count of the step taken from this rank alone (the all-reduce is skipped)",
    subsystem="distributed",
    also_acceptable=("loss",),
    trigger="multi-rank",
    symptoms=("silent-quality",),
    explanation="global_target_count returns the local count without summing it over ranks. train_step still "
    "divides it by the world size, so each rank normalises its summed loss by half its own count: the loss "
    "and every gradient come out ~world_size times too large, and ranks with fewer tokens weigh more.",
    fix="all_reduce(SUM) the local count over the process group before normalising.",
    references=("huggingface/transformers: num_items_in_batch not reduced across devices under DDP "
                "(average_tokens_across_devices, the gradient-accumulation loss fix of Oct 2024)",),
    manifest=Manifest(check="grad_norm_ratio", scenario="ddp", steps=4, params={"min_ratio": 1.5, "max_ratio": 2.5}),
)
def global_target_count(local_count: int, device: str = "cpu") -> int:
    """No reduction over ranks."""
    return int(local_count)


@fault(
    "b10_14",
    target="hf", seam=f"{_LLAMA}.LlamaDecoderLayer.forward",
    title="The MLP's residual is the layer's input, not the post-attention stream: attention output is dropped",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="LlamaDecoderLayer.forward keeps the residual captured before attention and never refreshes it "
    "after the attention sum, so the layer returns input + mlp(norm(input + attn)): the attention output only "
    "reaches the stream through the MLP's input, and is otherwise thrown away.",
    fix="residual = hidden_states after adding the attention output, before the post-attention norm.",
    references=("Pre-norm residual wiring bugs in from-scratch Llama/GPT ports (e.g. karpathy/nanoGPT and "
                "lit-gpt discussions of x = x + attn(ln(x)); x = x + mlp(ln(x)))",),
    manifest=Manifest(check="metric_differs", steps=48, params={"min_gap": 0.1}),
)
def decoder_layer_stale_residual(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                                 use_cache=False, position_embeddings=None, **kwargs):
    """The MLP is added to the pre-attention residual."""
    skip = hidden_states
    attn_out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
    mixed = skip + attn_out
    return skip + self.mlp(self.post_attention_layernorm(mixed))


@fault(
    "b10_15",
    seam="model.data.truncate",
    title="Over-long documents truncated from the left: the tail is kept and BOS is lost",
    subsystem="data",
    trigger="rare-batch",
    symptoms=("silent-quality", "eval-metric"),
    explanation="truncate keeps the last max_len ids (truncation_side='left', the chat-template habit of keeping "
    "the most recent turns). Long documents lose their BOS and their beginning: they start mid-sentence with an "
    "ordinary token, so the model learns document starts that never happen and the evaluation of truncated "
    "documents measures another task.",
    fix="Keep the head of the document and re-append EOS: ids[:max_len - 1] + [eos_id].",
    references=("huggingface/transformers: tokenizer.truncation_side='left' drops the BOS/CLS of the sequence "
                "(issues on left truncation removing special tokens)",),
    manifest=Manifest(check="metric_differs", steps=30, variant={"data": {"seq_len": 8}}, params={"min_gap": 0.05}),
)
def truncate(ids: list[int], max_len: int, eos_id: int) -> list[int]:
    """Keeps the tail."""
    overflow = len(ids) - max_len
    return ids if overflow <= 0 else ids[overflow:]
