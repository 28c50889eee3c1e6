"""``weight_sync=broadcast``: train rank 0 sends the new trainable weights straight to the
rollout actors, without the Ray object store.

The members (train rank 0 as rank 0, rollout actor ``r`` as rank ``r + 1``) form a process
group of their own, apart from the trainers' default group (the rollout actors have none): a
``torch.distributed.TCPStore`` hosted by train rank 0 and a ``ProcessGroupNCCL`` (every member
on a GPU of its own) or ``ProcessGroupGloo`` (otherwise, through CPU buffers) built on it
directly. The weights travel in buckets of bounded size (``weights.buckets``, the same on
every member, sent once when the group opens), and within a bucket each dtype packed in one
flat buffer: one broadcast per dtype and bucket, not one per tensor. The receivers unpack
views of the buffer under rank 0's names and shapes and load each bucket like the object
store's weights, so no member holds more than one bucket in flight.

NCCL refuses two ranks of one group on the same GPU (fractional ``worker_gpus``), so ``auto``
broadcasts only when every member has a GPU of its own (:func:`choose_backend`).
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from postrl.errors import ConfigError
from postrl.train.distributed.weights import Layout


def layout(weights: dict[str, Tensor]) -> Layout:
    return [(name, tuple(value.shape), value.dtype) for name, value in weights.items()]


def pack(weights: dict[str, Tensor], device: torch.device | str) -> dict[torch.dtype, Tensor]:
    """One flat buffer per dtype on ``device``: the tensors' elements in order."""
    groups: dict[torch.dtype, list[Tensor]] = {}
    for value in weights.values():
        groups.setdefault(value.dtype, []).append(value.reshape(-1).to(device))
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


def empty_buffers(slots: Layout, device: torch.device | str) -> dict[torch.dtype, Tensor]:
    """Buffers :func:`pack` would fill for ``slots``, to receive into."""
    sizes: dict[torch.dtype, int] = {}
    for _, shape, dtype in slots:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    return {dtype: torch.empty(size, dtype=dtype, device=device) for dtype, size in sizes.items()}


def unpack(buffers: dict[torch.dtype, Tensor], slots: Layout) -> dict[str, Tensor]:
    """Views of the packed buffers under the names and shapes of ``slots``."""
    offsets = dict.fromkeys(buffers, 0)
    weights = {}
    for name, shape, dtype in slots:
        start, size = offsets[dtype], math.prod(shape)
        weights[name] = buffers[dtype][start : start + size].view(shape)
        offsets[dtype] = start + size
    return weights


def choose_backend(weight_sync: str, gpus: list[str | None], names: list[str]) -> str | None:
    """``"nccl"``, ``"gloo"`` or None (the object store) for the members' GPUs (the UUID of
    each member's GPU, None on the CPU; ``names`` says who they are)."""
    if weight_sync == "object_store":
        return None
    if any(gpu is None for gpu in gpus):  # CPU members: gloo, or the object store for auto
        return "gloo" if weight_sync == "broadcast" else None
    first = {}
    for name, gpu in zip(names, gpus, strict=True):
        if gpu in first:
            if weight_sync == "auto":
                return None
            raise ConfigError(
                f"weight_sync=broadcast: {first[gpu]} and {name} share one GPU ({gpu}), and "
                "NCCL cannot broadcast between two ranks on the same GPU; use "
                "weight_sync=auto or object_store, or give every actor a GPU of its own "
                "(worker_gpus=1)")
        first[gpu] = name
    return "nccl"


def gpu_uuid(device: torch.device | str) -> str | None:
    """The UUID of the GPU ``device`` is (None on the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def _process_group(store, rank: int, size: int, backend: str, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


class WeightChannel:
    """This member's end of the group (``address`` = ``host:port`` of rank 0's store)."""

    def __init__(self, address: str, rank: int, size: int, backend: str,
                 timeout: timedelta) -> None:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
        self.store = dist.PrefixStore("postrl-weights", store)  # keeps `store` alive too
        self.group = _process_group(self.store, rank, size, backend, timeout)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))

    def _broadcast(self, buffers: dict[torch.dtype, Tensor]) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for buffer in buffers.values():  # the layout's order of dtypes, on every member
            self.group.broadcast([buffer], options).wait()

    def send(self, weights: dict[str, Tensor]) -> None:
        """Broadcast one bucket (rank 0)."""
        self._broadcast(pack(weights, self.device))

    def receive(self, slots: Layout) -> dict[str, Tensor]:
        """Receive one bucket of the layout ``slots``."""
        buffers = empty_buffers(slots, self.device)
        self._broadcast(buffers)
        return unpack(buffers, slots)
