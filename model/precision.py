"""Mixed precision: the autocast context and the gradient scaler for each precision setting."""

from __future__ import annotations

import contextlib

import torch

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(precision: str, device_type: str):
    """Autocast to bf16/fp16 for the forward pass; a no-op context for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=_AUTOCAST_DTYPES[precision])


def make_grad_scaler(precision: str, device_type: str, init_scale: float = 2.0**16) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 has fp32's exponent range and needs none)."""
    return torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=precision == "fp16")
