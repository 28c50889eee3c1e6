"""Moving weights between replicas: only what training changes (the trainable parameters),
under the names of the Hugging Face module, on the CPU. Under FSDP2 the parameters (and
optimizer moments) are DTensor shards: reading them whole gathers them from every worker, so
every worker must make the same call (:func:`full`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from postrl.buckets import consecutive_buckets
from postrl.devices import resolve_device, why_no_cuda
from postrl.errors import ConfigError
from postrl.models.adapters import has_lora, merged_state

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]  # name, shape, dtype of each tensor


def worker_device(cfg, who: str = "this actor") -> torch.device:
    """Where an actor's model lives: its GPU (``cuda:N``, N normally 0 since Ray sets
    ``CUDA_VISIBLE_DEVICES``) when it reserved one (``worker_gpus > 0``), else the CPU. A GPU
    reserved but not visible to torch is an error: falling back to the CPU would run a GPU
    job on the CPU without a word."""
    if cfg.worker_gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"worker_gpus={cfg.worker_gpus:g}: {who} reserved a GPU, but torch "
                          f"in that actor sees no CUDA GPU ({why_no_cuda()}); check the "
                          "node's GPUs and CUDA_VISIBLE_DEVICES, and that the actors' torch is "
                          "a CUDA build, or set worker_gpus=0")
    return resolve_device("cuda")


def device_label(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200)`` or ``cpu``: what the driver reports for each actor."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def full(tensor: Tensor) -> Tensor:
    """A DTensor (an FSDP2 shard) gathered whole: a collective every rank must join, in the
    same order; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def trainable_state(module: nn.Module, keep: bool = True) -> dict[str, Tensor]:
    """The trainable parameters of ``module`` by name (LoRA: only the adapters), whole, as CPU
    copies; under FSDP2 a collective, gathered one parameter at a time. ``keep=False`` (the
    ranks whose copy nobody reads) joins the gathers and drops each at once."""
    state = {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            whole = full(param.detach())
            if keep:
                state[name] = whole.to("cpu", copy=True)
    return state


def engine_weights(module: nn.Module) -> dict[str, Tensor]:
    """What a sampler serving the whole model (vLLM) needs after an update: the trainable
    parameters, or with LoRA every weight under the base model's names with the adapters
    merged in, as CPU copies. Merged rather than adapter-only: vLLM's CPU build serves no
    LoRA, and a merged push costs one model's weights (about 1 s for SmolLM2-135M)."""
    if not has_lora(module):
        return trainable_state(module)
    return {name: tensor.to("cpu", copy=True) for name, tensor in merged_state(module).items()}


def trainable_layout(module: nn.Module) -> Layout:
    """Names, whole shapes (a DTensor's are its global ones) and dtypes of the trainable
    parameters, without gathering anything."""
    return [(name, tuple(param.shape), param.dtype)
            for name, param in module.named_parameters() if param.requires_grad]


def buckets(slots: Layout, limit: int) -> list[Layout]:
    """``slots`` in order, cut into consecutive buckets of at most ``limit`` bytes (a tensor
    larger than ``limit`` goes alone). Every member of a weight push walks the same buckets,
    so the collectives run in the same order everywhere."""
    return list(consecutive_buckets(slots, lambda slot: math.prod(slot[1]) * slot[2].itemsize,
                                    limit))


def gather_bucket(params: dict[str, Tensor], bucket: Layout) -> dict[str, Tensor]:
    """The parameters of ``bucket``, whole, where they are (a collective under FSDP2)."""
    return {name: full(params[name].detach()) for name, _, _ in bucket}


@torch.no_grad()
def load_trainable(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state`, or one bucket of it) into the parameters
    of the same names."""
    params = dict(module.named_parameters())
    missing = sorted(set(state) - set(params))
    if missing:
        raise KeyError(f"no parameters named {missing[:3]} in {type(module).__name__}")
    for name, value in state.items():
        params[name].copy_(value)


def to_cpu(value: Any, keep: bool = True) -> Any:
    """``value`` (nested dicts/lists of tensors, e.g. an optimizer's state) with whole CPU
    tensors (DTensor shards gathered: a collective under FSDP2); ``keep=False`` joins the
    gathers and puts None for every tensor."""
    if isinstance(value, Tensor):
        whole = full(value)
        return whole.to("cpu") if keep else None
    if isinstance(value, dict):
        return {k: to_cpu(v, keep) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(v, keep) for v in value)
    return value
