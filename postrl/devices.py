"""Where a process computes: the ``device`` option (``auto``, ``cpu``, ``cuda``, ``cuda:N``)
resolved against what this machine has. Knows no model code."""

from __future__ import annotations

import os
import re

import torch

DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def device_problem(spec: str) -> str | None:
    """Why ``spec`` cannot be used on this machine, or None."""
    if not isinstance(spec, str) or not _PATTERN.fullmatch(spec):
        return f"device={spec!r} is not one of {DEVICE_FORMS}"
    if not spec.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return (f"device={spec} needs a CUDA GPU, and torch sees none ({why_no_cuda()}): use "
                "device=cpu or device=auto")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        return (f"device={spec}: this machine has {count} CUDA GPU{'s' * (count != 1)} "
                f"(cuda:0 to cuda:{count - 1})")
    return None


def resolve_device(spec: str) -> torch.device:
    """The device ``spec`` names; ``auto`` is the first CUDA GPU when torch sees one, else
    the CPU. ``cuda`` means this process's current GPU (``cuda:0`` unless set)."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def why_no_cuda() -> str:
    """Why torch sees no CUDA GPU, as far as this process can tell."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else (
        "CUDA_VISIBLE_DEVICES is unset")
