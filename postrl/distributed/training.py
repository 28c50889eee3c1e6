"""Data-parallel trainer workers: W Ray actors in one ``torch.distributed`` group (gloo on
the CPU, NCCL on GPUs), each holding a DDP replica of the policy (and PPO's critic).

Every worker runs the trainer's own update loop (``postrl.train.update``) on its contiguous
share of each minibatch, with the loss normalised by the counts of the WHOLE minibatch and
scaled by W, so that DDP's gradient average is the full-batch gradient (ALGORITHMS.md §3):
the gradient of a step does not depend on W. The driver draws the plan (which rows make each
optimizer step) and merges the workers' diagnostics into the metrics of the whole batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
from contextlib import ExitStack
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from postrl.config import TrainConfig
from postrl.distributed.failures import gather
from postrl.distributed.weights import to_cpu, trainable_state, worker_device
from postrl.train.batch import TrainBatch
from postrl.train.update import (
    Replica,
    RoundResult,
    TokenScorer,
    Trainable,
    UpdateSettings,
    ValueScorer,
    merge_replicas,
    run_updates,
)

COLLECTIVE_TIMEOUT = timedelta(minutes=30)


class DDPReplica(Replica):
    """Rank ``rank`` of ``size``: gradients synchronise (DDP's all-reduce) on the last
    micro-batch of a step only, and every rank skips a non-finite step or none does."""

    def __init__(self, rank: int, size: int, modules: list[DistributedDataParallel],
                 device: str) -> None:
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


def replicate(module: torch.nn.Module) -> DistributedDataParallel:
    """DDP without a buffer broadcast in every forward: the buffers (rotary tables) are
    equal everywhere, and that broadcast is a collective that ranks running different numbers
    of micro-batches would not match up."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    keyword = "forward_sync_buffers" if "forward_sync_buffers" in parameters else (
        "broadcast_buffers")  # torch < 2.13
    return DistributedDataParallel(module, **{keyword: False})


def adopt_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a replica's optimizer moments into ``optimizer``, keeping its own param groups
    (the driver's learning-rate schedule stays the authority)."""
    merged = optimizer.state_dict()
    merged["state"] = state["state"]
    optimizer.load_state_dict(merged)


class TrainWorker:
    """The body of one trainer actor."""

    def __init__(self, cfg: TrainConfig, rank: int, size: int, threads: int) -> None:
        from postrl.models.policy import ValueModel, causal_lm
        from postrl.train.trainer import load_trained_policy

        torch.set_num_threads(threads)
        self.cfg, self.rank, self.size = cfg, rank, size
        self.recipe = cfg.build_recipe()
        self.loss_cfg = self.recipe.policy_loss_config(cfg.max_new_tokens)
        self.device = worker_device(cfg)
        self.policy, _ = load_trained_policy(cfg)
        self.lm = causal_lm(self.policy)
        self.critic = ValueModel(self.policy) if self.recipe.critic else None
        self.models: Trainable | None = None
        self.replica: DDPReplica | None = None

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> str:
        """``host:port`` for the group's rendezvous (asked of rank 0)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, address: str, state: dict) -> None:
        """Join the process group, load the driver's state, wrap the modules in DDP."""
        from postrl.train.trainer import make_optimizers

        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=self.rank,
                                world_size=self.size, timeout=COLLECTIVE_TIMEOUT)
        self.lm.load_state_dict(state["policy"])
        self.policy.to(self.device)
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic.to(self.device)
        optimizer, critic_optimizer = make_optimizers(self.cfg, self.policy, self.critic)
        optimizer.load_state_dict(state["optimizer"])
        policy = replicate(TokenScorer(self.lm))
        critic = None
        if self.critic is not None:
            critic_optimizer.load_state_dict(state["critic_optimizer"])
            critic = replicate(ValueScorer(self.critic))
        self.models = Trainable(policy, optimizer, critic, critic_optimizer)
        self.replica = DDPReplica(self.rank, self.size, [m for m in (policy, critic) if m],
                                  self.device)

    def update(self, batch: TrainBatch, settings: UpdateSettings, plan: list[Tensor],
               lr: float) -> list[RoundResult]:
        for group in self.models.optimizer.param_groups:
            group["lr"] = lr
        self.policy.train()
        settings = dataclasses.replace(settings, device=self.device)
        return run_updates(self.models, batch, self.recipe, self.loss_cfg, settings, plan,
                           self.replica)

    def weights(self) -> dict[str, Tensor]:
        return trainable_state(self.lm)

    def critic_weights(self) -> dict[str, Tensor] | None:
        return trainable_state(self.critic) if self.critic is not None else None

    def optimizer_states(self) -> tuple[dict, dict | None]:
        critic_optimizer = self.models.critic_optimizer
        return (to_cpu(self.models.optimizer.state_dict()),
                to_cpu(critic_optimizer.state_dict()) if critic_optimizer else None)


class TrainGroup:
    """The driver's handle on the W trainer actors."""

    def __init__(self, actors: list, resume_hint: str) -> None:
        self.actors = actors
        self.names = [f"train worker {i + 1}/{len(actors)}" for i in range(len(actors))]
        self.resume_hint = resume_hint

    def _all(self, method: str, *args) -> list:
        futures = [getattr(actor, method).remote(*args) for actor in self.actors]
        return gather(futures, self.names, self.resume_hint)

    def join(self, state: ray.ObjectRef) -> None:
        [address] = gather([self.actors[0].address.remote()], self.names[:1], self.resume_hint)
        self._all("join", address, state)

    def update(self, batch: TrainBatch, settings: UpdateSettings, plan: list[Tensor],
               lr: float) -> list[RoundResult]:
        """Every worker trains on its share; the results merged as one process's."""
        return merge_replicas(self._all("update", ray.put(batch), settings, plan, lr))

    def weights(self) -> tuple[ray.ObjectRef, dict[str, Tensor]]:
        """Rank 0's new trainable policy weights (all replicas are equal): their reference in
        the object store, for the rollout actors, and their value, for the driver."""
        reference = self.actors[0].weights.remote()
        [weights] = gather([reference], self.names[:1], self.resume_hint)
        return reference, weights

    def critic_weights(self) -> dict[str, Tensor] | None:
        [weights] = gather([self.actors[0].critic_weights.remote()], self.names[:1],
                           self.resume_hint)
        return weights

    def optimizer_states(self) -> tuple[dict, dict | None]:
        [states] = gather([self.actors[0].optimizer_states.remote()], self.names[:1],
                          self.resume_hint)
        return states
