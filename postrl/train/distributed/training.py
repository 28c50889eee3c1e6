"""Data-parallel trainer workers: W Ray actors in one ``torch.distributed`` group (gloo on
the CPU, NCCL on GPUs), each holding a DDP replica or an FSDP2 shard of the policy (and of
PPO's critic): ``train_parallel`` (``parallel.py``).

Every worker runs the trainer's own update loop (``postrl.train.update``) on its contiguous
share of each minibatch, with the loss normalised by the counts of the WHOLE minibatch and
scaled by W, so that DDP's gradient average is the full-batch gradient (docs/algorithms.md §3):
the gradient of a step does not depend on W. The driver draws the plan (which rows make each
optimizer step) and merges the workers' diagnostics into the metrics of the whole batch.

Ray is imported only where it is used, so that a script can drive :class:`TrainWorker`
directly, in processes of its own, on a machine without Ray.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from postrl.config import TrainConfig
from postrl.process import configure_process
from postrl.train.batch import TrainBatch
from postrl.train.distributed.broadcast import WeightChannel, gpu_uuid
from postrl.train.distributed.failures import COLLECTIVE_TIMEOUT, gather
from postrl.train.distributed.parallel import (
    DDPReplica,
    decoder_layers,
    load_optimizer_state,
    make_replica,
    wrap,
)
from postrl.train.distributed.weights import (
    Layout,
    buckets,
    device_label,
    gather_bucket,
    to_cpu,
    trainable_layout,
    trainable_state,
    worker_device,
)
from postrl.train.replicas import RoundResult, merge_replicas
from postrl.train.scorers import TokenScorer, ValueScorer
from postrl.train.setup import load_trained_policy, make_optimizers
from postrl.train.update import Trainable, UpdateSettings, run_updates


def adopt_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a replica's optimizer moments into ``optimizer``, keeping its own param groups
    (the driver's learning-rate schedule stays the authority)."""
    merged = optimizer.state_dict()
    merged["state"] = state["state"]
    optimizer.load_state_dict(merged)


def device_option(device: torch.device) -> dict[str, torch.device]:
    """``init_process_group``'s ``device_id`` for a CUDA rank (binds the group to its GPU);
    nothing on the CPU, or on a torch whose ``init_process_group`` lacks it."""
    if device.type != "cuda":
        return {}
    if "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": device}


# the largest piece of the whole weights a push gathers at a time (FSDP2) and sends
PUSH_BUCKET_BYTES = 256 * 2**20


class TrainWorker:
    """The body of one trainer actor. ``bucket_bytes`` bounds the pieces of a weight push."""

    def __init__(self, cfg: TrainConfig, rank: int, size: int, threads: int,
                 bucket_bytes: int = PUSH_BUCKET_BYTES) -> None:
        from postrl.models.policy import ValueModel, causal_lm

        configure_process(threads, cfg.reuse_freed_memory)
        self.cfg, self.rank, self.size = cfg, rank, size
        self.bucket_bytes = bucket_bytes
        self.recipe = cfg.build_recipe()
        self.loss_cfg = self.recipe.policy_loss_config(cfg.max_new_tokens)
        self.device = worker_device(cfg, f"train worker {rank + 1}/{size}")
        if self.device.type == "cuda":  # NCCL and new CUDA tensors use this GPU
            torch.cuda.set_device(self.device)
        self.policy, _ = load_trained_policy(cfg)
        self.lm = causal_lm(self.policy)
        self.critic = ValueModel(self.policy) if self.recipe.critic else None
        self.models: Trainable | None = None
        self.replica: DDPReplica | None = None
        self.channel: WeightChannel | None = None  # rank 0 with weight_sync=broadcast

    def pid(self) -> int:
        return os.getpid()

    def device_name(self) -> str:
        return device_label(self.device)

    def address(self) -> str:
        """``host:port`` for the group's rendezvous (asked of rank 0); without Ray, this
        machine's loopback (all ranks on one machine)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        try:
            import ray
        except ImportError:
            return f"127.0.0.1:{port}"
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, address: str, state: dict) -> None:
        """Join the process group, load the driver's state, wrap the modules for
        ``train_parallel`` (DDP replicas or FSDP2 shards), then build the optimizers over
        the wrapped parameters and load the driver's optimizer state into them."""

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=self.rank,
                                world_size=self.size, timeout=COLLECTIVE_TIMEOUT,
                                **device_option(self.device))
        mode = self.cfg.train_parallel
        self.lm.load_state_dict(state["policy"])
        self.policy.to(self.device)
        # FSDP2's collectives follow the forward calls of each layer, and whether a
        # micro-batch shares a prompt differs between ranks: under FSDP2 no rank shares
        policy = wrap(mode, TokenScorer(self.lm, share_prompts=mode != "fsdp2",
                                        compile_layers=self.cfg.torch_compile),
                      decoder_layers(self.lm.model))
        critic = None
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic.to(self.device)
            critic = wrap(mode, ValueScorer(self.critic, share_prompts=mode != "fsdp2",
                                            compile_layers=self.cfg.torch_compile),
                          decoder_layers(self.critic.backbone))
        optimizer, critic_optimizer = make_optimizers(self.cfg, self.policy, self.critic)
        load_optimizer_state(optimizer, state["optimizer"])
        if critic_optimizer is not None:
            load_optimizer_state(critic_optimizer, state["critic_optimizer"])
        self.models = Trainable(policy, optimizer, critic, critic_optimizer)
        self.replica = make_replica(mode, self.rank, self.size,
                                    [m for m in (policy, critic) if m], self.device)
        # the same buckets on every rank (whole shapes, not gathered): the same collectives
        self.buckets = buckets(trainable_layout(self.lm), self.bucket_bytes)

    def update(self, batch: TrainBatch, settings: UpdateSettings, plan: list[Tensor],
               lr: float) -> list[RoundResult]:
        for group in self.models.optimizer.param_groups:
            group["lr"] = lr
        self.policy.train()
        settings = dataclasses.replace(settings, device=self.device, replica=self.replica,
                                       share_prompts=self.cfg.train_parallel != "fsdp2")
        return run_updates(self.models, batch, self.recipe, self.loss_cfg, settings, plan)

    # Under FSDP2 reading whole weights is a collective: every rank calls these; only rank
    # 0's copy is returned (the others return None, which costs nothing to ship).
    def _rank0(self, value):
        return value if self.rank == 0 else None

    def weights(self) -> dict[str, Tensor] | None:
        """The new trainable weights (rank 0's, as CPU copies); rank 0 also broadcasts them
        to the rollout actors when it holds the weight channel. Gathered (FSDP2) and sent
        one bucket at a time: rank 0 copies each to the CPU, the others drop it at once."""
        params = dict(self.lm.named_parameters())
        weights: dict[str, Tensor] = {}
        for part in self.buckets:
            bucket = gather_bucket(params, part)
            if self.channel is not None:
                self.channel.send(bucket)
            if self.rank == 0:
                weights.update((name, value.to("cpu", copy=True))
                               for name, value in bucket.items())
            del bucket  # before the next bucket is gathered
        return self._rank0(weights)

    def gpu_uuid(self) -> str | None:
        return gpu_uuid(self.device)

    def weight_layout(self) -> list[Layout]:
        """The buckets of a weight push: names, whole shapes and dtypes of the trainable
        weights (no gathering needed), in the order :meth:`weights` sends them."""
        return self.buckets

    def open_channel(self, address: str, size: int, backend: str) -> None:
        """Host the weight channel (rank 0 only): the rollout actors join it."""
        self.channel = WeightChannel(address, 0, size, backend, COLLECTIVE_TIMEOUT)

    def critic_weights(self) -> dict[str, Tensor] | None:
        if self.critic is None:
            return None
        return self._rank0(trainable_state(self.critic, keep=self.rank == 0))

    def optimizer_states(self) -> tuple[dict, dict | None] | None:
        """Rank 0's whole optimizer states on the CPU; the other ranks join the gathers
        (FSDP2) and keep nothing."""
        keep, critic_optimizer = self.rank == 0, self.models.critic_optimizer
        return self._rank0((to_cpu(self.models.optimizer.state_dict(), keep),
                            to_cpu(critic_optimizer.state_dict(), keep) if critic_optimizer
                            else None))


class TrainGroup:
    """The driver's handle on the W trainer actors. ``sharded`` (FSDP2): reading whole
    weights or optimizer moments is a collective, so every worker is asked, rank 0 answers."""

    def __init__(self, actors: list, resume_hint: str, sharded: bool = False) -> None:
        self.actors = actors
        self.names = [f"train worker {i + 1}/{len(actors)}" for i in range(len(actors))]
        self.resume_hint = resume_hint
        self.sharded = sharded

    def _all(self, method: str, *args) -> list:
        futures = [getattr(actor, method).remote(*args) for actor in self.actors]
        return gather(futures, self.names, self.resume_hint)

    def _from_rank0(self, method: str) -> tuple[Any, object]:
        """Rank 0's answer (its reference and value); every rank is asked when sharded."""
        asked = self.actors if self.sharded else self.actors[:1]
        futures = [getattr(actor, method).remote() for actor in asked]
        return futures[0], gather(futures, self.names[: len(asked)], self.resume_hint)[0]

    def join(self, state: Any) -> None:
        """Start the group from the driver's state (a ``ray.ObjectRef``)."""
        [address] = gather([self.actors[0].address.remote()], self.names[:1], self.resume_hint)
        self._all("join", address, state)

    def update(self, batch: TrainBatch, settings: UpdateSettings, plan: list[Tensor],
               lr: float) -> list[RoundResult]:
        """Every worker trains on its share; the results merged as one process's."""
        import ray

        return merge_replicas(self._all("update", ray.put(batch), settings, plan, lr))

    def weights(self) -> tuple[Any, dict[str, Tensor]]:
        """Rank 0's new trainable policy weights (all replicas are equal): their reference in
        the object store, for the rollout actors, and their value, for the driver."""
        return self._from_rank0("weights")

    def critic_weights(self) -> dict[str, Tensor] | None:
        return self._from_rank0("critic_weights")[1]

    def optimizer_states(self) -> tuple[dict, dict | None]:
        return self._from_rank0("optimizer_states")[1]
