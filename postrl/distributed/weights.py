"""Moving weights between replicas: only what training changes (the trainable parameters),
under the names of the Hugging Face module, on the CPU. Under FSDP2 the parameters (and
optimizer moments) are DTensor shards: reading them whole gathers them from every worker, so
every worker must make the same call (:func:`full`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def worker_device(cfg) -> str:
    """Where an actor's model lives: ``cuda`` when it reserved a GPU (``worker_gpus > 0``)
    and this process sees one, else ``cpu``."""
    return "cuda" if cfg.worker_gpus > 0 and torch.cuda.is_available() else "cpu"


def full(tensor: Tensor) -> Tensor:
    """A DTensor (an FSDP2 shard) gathered whole: a collective every rank must join, in the
    same order; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_trainable(module: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters of ``module`` by name (LoRA: only the adapters), whole, where
    they are (a collective under FSDP2)."""
    return {name: full(param.detach())
            for name, param in module.named_parameters() if param.requires_grad}


def trainable_state(module: nn.Module) -> dict[str, Tensor]:
    """:func:`whole_trainable` as CPU copies."""
    return {name: value.to("cpu", copy=True) for name, value in whole_trainable(module).items()}


@torch.no_grad()
def load_trainable(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state`) into the parameters of the same names."""
    params = dict(module.named_parameters())
    missing = sorted(set(state) - set(params))
    if missing:
        raise KeyError(f"no parameters named {missing[:3]} in {type(module).__name__}")
    for name, value in state.items():
        params[name].copy_(value)


def to_cpu(value: Any) -> Any:
    """``value`` (nested dicts/lists of tensors, e.g. an optimizer's state) with whole CPU
    tensors (DTensor shards gathered: a collective under FSDP2)."""
    if isinstance(value, Tensor):
        return full(value).to("cpu")
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(v) for v in value)
    return value
