"""HF faults in the `precision` subsystem: which dtype the weights live in, and what autocast rounds.

What cannot exist on this CPU stack (so is not registered): anything needing a GradScaler (accelerate 1.15 runs
``fp16=True`` on CPU as plain fp32, with neither autocast nor a scaler: no missing unscale before clipping, no
scaler state to lose), and the low-precision islands CPU bf16 autocast already keeps in fp32 here, where removing
the upcast changes no bit of a 16-step bf16 run (measured): RMSNorm's input is fp32 after the residual adds,
cross-entropy on bf16 logits runs in fp32 (``ForCausalLMLoss`` without ``logits.float()``), and eager attention's
scores are fp32 once the fp32 additive mask is added (its softmax without ``dtype=torch.float32``).
"""

import torch
from transformers.trainer import ParallelMode, logger

from faultbench.faults.registry import Manifest, fault

_TRAINER = "transformers.trainer.Trainer"
_LLAMA = "transformers.models.llama.modeling_llama"


@fault(
    "hf_bf16_weights_no_master_copy", target="hf", seam=f"{_TRAINER}._move_model_to_device",
    title="bf16=True casts the weights themselves to bf16: AdamW updates smaller than bf16's spacing are lost",
    subsystem="precision", also_acceptable=("optimizer",), trigger="amp-only", symptoms=("stall", "silent-quality"),
    explanation="Placing the model on its device, Trainer also casts it to bfloat16 when args.bf16 is set ('to save "
    "memory'). bf16 mixed precision means bf16 compute under autocast with fp32 master weights; with the weights "
    "themselves in bf16 there is no master copy, AdamW's state is created in bf16 too, and every update is rounded "
    "to the weight's bf16 spacing (2^-7 just above 1.0, 2^-8 just below). The RMSNorm gains start at 1.0, where an "
    "update of lr ~ 3e-3 is below half a spacing: a gain that wants to grow never moves, and small updates elsewhere "
    "round away. Nothing crashes and the loss still falls, a little more slowly.",
    fix="Leave the parameters in float32 (model.to(device) only) and let autocast run the matmuls in bf16; a model "
    "that must be stored in bf16 needs fp32 master weights in the optimizer (or stochastic rounding).",
    references=(
        "areal-project/AReaL#1292: '[BUG] FSDP engine: torch.optim.AdamW inherits bf16 dtype from "
        "model.parameters(), causing late-stage convergence to plateau ~3x higher than DS-Z3 / Megatron' "
        "(fixed by #1369 'maintain fp32 master weights for AdamW')",
        "meta-pytorch/torchtune#2254: 'Very bad convergence with bf16'",
        "NVIDIA/apex#1728: 'FusedAdam doesn't allocate master weights for bfloat16'",
    ),
    manifest=Manifest(check="extra_at_least", scenario="train", steps=16, variant={"precision": "bf16"},
                      params={"key": "frozen_param_fraction", "faulty_min": 0.04, "clean_max": 0.0}),
)
def move_model_to_device_bf16(self, model, device):
    """Casts the model's parameters to bf16 along with the move when bf16 is on: no fp32 master weights."""
    if getattr(model, "hf_device_map", None) is not None:
        logger.warning(
            "The model is already on multiple devices. Skipping the move to device specified in `args`."
        )
        return
    model = model.to(device, dtype=torch.bfloat16 if self.args.bf16 else None)
    # Moving a model to an XLA device disconnects the tied weights, so we have to retie them.
    if self.args.parallel_mode == ParallelMode.TPU and hasattr(model, "tie_weights"):
        model.tie_weights()


@fault(
    "hf_rope_freqs_under_autocast", target="hf", seam=f"{_LLAMA}.LlamaRotaryEmbedding.forward",
    title="RoPE angles computed by a matmul that bf16 autocast runs in bf16: positions lose precision at long context",
    subsystem="precision", also_acceptable=("position",), trigger="amp-only", symptoms=("silent-quality",),
    explanation="LlamaRotaryEmbedding.forward builds the angles position x inv_freq as a batched matmul of two "
    "tensors it has just cast to float32. matmul is on autocast's lower-precision list, so under bf16 autocast "
    "(Trainer with bf16=True) both operands and the angles are rounded to bf16, whose 8 significant bits space "
    "integers 8 apart at 1024: positions beyond 256 are no longer all distinct, inv_freq keeps 8 bits, and the error "
    "in radians grows with the position. cos/sin are then taken of the wrong angles. Short sequences barely change; at long context the "
    "encoding stops being relative (the same tokens at other offsets attend differently) and quality degrades.",
    fix="Compute the angles with autocast disabled (torch.autocast(device_type, enabled=False)) in float32, as "
    "transformers does since #29285, or as an elementwise product (not an autocast op): "
    "position_ids[..., None].float() * inv_freq.float().",
    references=(
        "huggingface/transformers#29285: 'RoPE loses precision for Llama / Gemma + Gemma logits.float()' (the "
        "angles' matmul autocast to bf16; fixed by wrapping it in torch.autocast(enabled=False))",
        "huggingface/diffusers#13920: 'Ideogram4MRoPE breaks under torch.autocast: all image positions collapse' "
        "(the same matmul on autocast's lower-precision list)",
    ),
    # trained until attention depends on relative position (16 steps at lr 3e-3 barely get there)
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=32,
                      variant={"precision": "bf16", "lr": 1e-2},
                      params={"key": "rope_far_shift_gap", "faulty_min": 0.2, "clean_max": 0.1}),
)
def rotary_forward_freqs_matmul(self, x, position_ids):
    """The angles come from a matmul, which bf16 autocast runs (and rounds) in bf16."""
    inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling

    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
