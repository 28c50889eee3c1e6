"""Mixed precision: bf16 autocast over float32 master weights."""

from __future__ import annotations

import torch

PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device_type: str = "cpu"):
    """A context running matmuls in bf16 (``precision="bf16"``) while the weights, the optimizer
    state and every log-softmax stay float32; a no-op for ``"fp32"``."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16")
