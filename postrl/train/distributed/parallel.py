"""How the W trainer workers hold the model (``train_parallel``): DDP or FSDP2.

``ddp``: every worker holds a full replica; DDP all-reduces (averages) the gradients on the
last micro-batch of a step (Li et al. 2020, "PyTorch Distributed").

``fsdp2``: parameters, gradients and AdamW moments are sharded over the workers (Zhao et al.
2023, "PyTorch FSDP"; torch's ``fully_shard``, torch >= 2.6): each decoder layer is one
all-gather unit, the root module (embeddings, final norm, LM head) another. Gradients
accumulate unsharded over the micro-batches (``set_requires_gradient_sync(False)``, the
counterpart of DDP's ``no_sync``) and are reduce-scattered, averaged over the W workers, on
the last one: the same average as DDP's, so the same ``x W`` loss scaling makes the gradient
of a step the full-batch one for both.

Parameters under FSDP2 are DTensors: reading whole weights or optimizer moments
(:func:`postrl.train.distributed.weights.full`) is a collective that every worker must join.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from postrl.train.replicas import Replica


class DDPReplica(Replica):
    """Rank ``rank`` of ``size``: gradients synchronise (DDP's all-reduce) on the last
    micro-batch of a step only, and every rank skips a non-finite step or none does."""

    def __init__(self, rank: int, size: int, modules: list[nn.Module], device: str) -> None:
        self.rank, self.size, self.modules, self.device = rank, size, modules, device

    def accumulating(self, last: bool):
        stack = ExitStack()
        if not last:
            for module in self.modules:
                stack.enter_context(module.no_sync())
        return stack

    def all_true(self, flags: list[bool]) -> list[bool]:
        values = torch.tensor([float(f) for f in flags], device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        return [bool(v) for v in values.tolist()]


class FSDPReplica(DDPReplica):
    """As :class:`DDPReplica`, over FSDP2 modules: the gradient reduce-scatter runs on the
    last micro-batch of a step only. Every forward gathers the weights from all ranks, so
    every rank must run as many as the others."""

    forwards_must_match = True

    def accumulating(self, last: bool):
        for module in self.modules:
            module.set_requires_gradient_sync(last)
        return nullcontext()


def replicate(module: nn.Module) -> DistributedDataParallel:
    """DDP without a buffer broadcast in every forward: the buffers (rotary tables) are
    equal everywhere, and that broadcast is a collective that ranks running different numbers
    of micro-batches would not match up."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    keyword = "forward_sync_buffers" if "forward_sync_buffers" in parameters else (
        "broadcast_buffers")  # torch < 2.13
    return DistributedDataParallel(module, **{keyword: False})


def shard(module: nn.Module, layers: list[nn.Module]) -> nn.Module:
    """FSDP2 over ``module``: each of ``layers`` (the decoder layers) sharded on its own, then
    the root with what is left. The parameters become DTensors in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # a mesh of the parameters' device type: left to itself, FSDP2 meshes over CUDA whenever
    # the machine has a GPU, and CPU shards over gloo then crash
    device = next(module.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def decoder_layers(backbone: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers backbone (``LlamaModel``-style ``.layers``); an
    unfamiliar layout is sharded as one unit."""
    return list(getattr(backbone, "layers", []))


def wrap(mode: str, module: nn.Module, layers: list[nn.Module]) -> nn.Module:
    """``module`` (a ``TokenScorer`` or ``ValueScorer``) as a data-parallel replica."""
    return shard(module, layers) if mode == "fsdp2" else replicate(module)


def make_replica(mode: str, rank: int, size: int, modules: list[nn.Module],
                 device: str) -> DDPReplica:
    kind = FSDPReplica if mode == "fsdp2" else DDPReplica
    return kind(rank, size, modules, device)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load the driver's full optimizer state (one process's ``state_dict``) into an
    optimizer over possibly sharded parameters: each moment shaped like its parameter is cut
    into this rank's shard of it (locally: every rank holds the full state)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    moments = {}
    for index, values in state["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            values = {key: (distribute_tensor(value.to(param.device), param.device_mesh,
                                              param.placements, src_data_rank=None)
                            if torch.is_tensor(value) and value.shape == param.shape else value)
                      for key, value in values.items()}
        moments[index] = values
    optimizer.load_state_dict({**state, "state": moments})
