"""What runs where with ``launcher=ray``, and the traffic of one training step.

The driver (the ``Trainer`` process) keeps everything that is not generation or the update:
prompts, rewards, filters, advantages, the reference and old-policy forwards, checkpoints,
metrics, evaluation. R rollout actors generate the prompts of each round in slices; W trainer
actors form a ``torch.distributed`` group and train DDP replicas or FSDP2 shards. After each
training step rank 0's new trainable weights go into the Ray object store once; the driver's
own copy of the policy reads them from there, and so do the rollout actors, unless rank 0
broadcasts the weights to them over a group of their own (``weight_sync``, ``broadcast.py``).
Actors that reserve GPUs are placed by a placement group, at most one trainer worker per GPU
(``placement.py``); once all are up, the driver says which device each one computes on.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import ray
import torch

import postrl
from postrl.config import TrainConfig
from postrl.errors import ConfigError
from postrl.train.distributed.broadcast import choose_backend
from postrl.train.distributed.failures import gather
from postrl.train.distributed.placement import Placement, plan_placement
from postrl.train.distributed.rollout import RolloutPool, RolloutWorker
from postrl.train.distributed.training import TrainGroup, TrainWorker, adopt_state
from postrl.train.distributed.weights import load_trainable, to_cpu
from postrl.train.replicas import RoundResult
from postrl.train.state import RunObjects
from postrl.train.update import UpdateSettings


@dataclass
class Cluster:
    rollout: RolloutPool
    trainers: TrainGroup
    driver_policy: torch.nn.Module  # the driver's causal LM, kept equal to the replicas
    driver_critic: torch.nn.Module | None
    owns_ray: bool  # started a local Ray instance (shut down on close)
    broadcast: bool = False  # weights reach the rollout actors by train rank 0's broadcast
    push_rollouts: bool = True  # False: overlap_sampling's thread pushes them (staleness.py)
    placement_group: Any = None  # holds the actors' GPUs (worker_gpus > 0)

    def update(self, batch, settings: UpdateSettings, plan: list[torch.Tensor],
               lr: float) -> list[RoundResult]:
        """Train every worker on its share, then send the new weights to the rollout actors
        (a broadcast from rank 0, or the object store; not with ``push_rollouts`` off) and
        into the driver's copy (for the next step's forwards, evaluation, checkpoints)."""
        results = self.trainers.update(batch, settings, plan, lr)
        receiving = self.rollout.start_receiving() if self.broadcast else None
        reference, weights = self.trainers.weights()  # rank 0 broadcasts while it answers
        if receiving is not None:
            self.rollout.finish_receiving(receiving)
        elif self.push_rollouts:
            self.rollout.load_weights(reference)
        load_trainable(self.driver_policy, weights)
        if self.driver_critic is not None:
            load_trainable(self.driver_critic, self.trainers.critic_weights())
        return results

    def pull_optimizer_states(self, optimizer, critic_optimizer) -> None:
        """Rank 0's optimizer moments into the driver's optimizers (before a checkpoint)."""
        policy_state, critic_state = self.trainers.optimizer_states()
        adopt_state(optimizer, policy_state)
        if critic_optimizer is not None:
            adopt_state(critic_optimizer, critic_state)

    def close(self) -> None:
        stop(self.rollout.actors + self.trainers.actors, self.placement_group, self.owns_ray)


def stop(actors: list, placement_group, owns_ray: bool) -> None:
    for actor in actors:
        ray.kill(actor)
    if placement_group is not None:
        ray.util.remove_placement_group(placement_group)
    if owns_ray:
        ray.shutdown()


def connect(address: str | None) -> bool:
    """Join the Ray session of this process, a running cluster (``address``), or start a
    local instance. Returns whether a local instance was started here."""
    if ray.is_initialized():  # whoever called ray.init made postrl importable on the workers
        return False
    # the workers import the same postrl as this driver, on every node of the cluster
    ray.init(address=address, include_dashboard=False, runtime_env={"py_modules": [postrl]})
    return address is None


def actor_resources(cfg, actors: int) -> tuple[float, Placement | None]:
    """The CPUs each actor reserves (``worker_cpus=null`` shares the cluster's CPUs evenly)
    and, with ``worker_gpus > 0``, the plan of their GPUs. A cluster that can never hold
    every actor is an error naming the option (one that is busy with other work holds the
    actors back until it has room, as Ray does)."""
    total = ray.cluster_resources()
    cpus = cfg.worker_cpus if cfg.worker_cpus is not None else total.get("CPU", 0) / actors
    if cpus <= 0 or cpus * actors > total.get("CPU", 0) + 1e-9:
        raise ConfigError(f"worker_cpus: {actors} actors (rollout_workers + train_workers) "
                          f"x {cpus:g} CPUs do not fit the {total.get('CPU', 0):g} CPUs "
                          "of the Ray cluster; lower worker_cpus or the worker counts")
    return cpus, plan_placement(cfg.rollout_workers, cfg.train_workers, cpus, cfg.worker_gpus,
                                total.get("GPU", 0))


def place(plan: Placement | None, cpus: float, gpus: float, rollout_workers: int,
          train_workers: int) -> tuple[Any, list[dict], list[dict]]:
    """``(placement group, options of each rollout actor, of each trainer)`` for ``plan``
    (None: no group, plain reservations). The actors wait for the group to be placed."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if plan is None:
        plain = {"num_cpus": cpus, "num_gpus": gpus}
        return None, [plain] * rollout_workers, [plain] * train_workers
    group = placement_group(plan.bundles)

    def options(bundle: int) -> dict:
        return {"num_cpus": cpus, "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=bundle)}

    return group, [options(b) for b in plan.rollout], [options(b) for b in plan.train]


def device_lines(names: list[str], labels: list[str]) -> list[str]:
    """One line per actor: ``postrl: train worker 1/2: cuda:0 (NVIDIA H200)``."""
    return [f"postrl: {name}: {label}" for name, label in zip(names, labels, strict=True)]


def open_weight_channel(cluster: Cluster, weight_sync: str, hint: str) -> bool:
    """Build the broadcast group of train rank 0 and the rollout actors when ``weight_sync``
    asks for it (``auto``: only when every member has a GPU of its own; see
    ``broadcast.choose_backend``). Returns whether weights will be broadcast."""
    if weight_sync == "object_store":
        return False
    rank0, rollout = cluster.trainers.actors[0], cluster.rollout.actors
    members, names = [rank0, *rollout], [cluster.trainers.names[0], *cluster.rollout.names]
    backend = choose_backend(weight_sync, gather([m.gpu_uuid.remote() for m in members],
                                                 names, hint), names)
    if backend is None:
        return False
    address, slots = gather([rank0.address.remote(), rank0.weight_layout.remote()],
                            names[:1] * 2, hint)
    size = len(members)
    gather([rank0.open_channel.remote(address, size, backend)]
           + [actor.open_channel.remote(address, rank, size, backend, slots)
              for rank, actor in enumerate(rollout, start=1)], names, hint)
    return True


def resume_hint(cfg) -> str:
    if not cfg.save_every:
        return ("This run writes no checkpoints (save_every=0), so it must start again; "
                "set save_every to make it resumable with resume=auto")
    return "The run can continue from its last checkpoint: rerun it with resume=auto"


def start_cluster(cfg: TrainConfig, start: RunObjects, pad_id: int | None) -> Cluster:
    """Start the rollout actors and trainer workers from the driver's weights and optimizer
    states in ``start`` (fresh or resumed), wait until all are ready. ``pad_id``: the
    tokenizer's (None: 0)."""
    owns_ray = connect(cfg.ray_address)
    actors: list = []
    group = None
    try:
        rollout_workers, train_workers = cfg.rollout_workers, cfg.train_workers
        cpus, plan = actor_resources(cfg, rollout_workers + train_workers)
        threads = cfg.threads or max(1, int(cpus))
        group, rollout_options, train_options = place(plan, cpus, cfg.worker_gpus,
                                                      rollout_workers, train_workers)
        policy_state = ray.put(to_cpu(start.policy.state_dict()))  # the driver may be on a GPU
        rollout_actor, train_actor = ray.remote(RolloutWorker), ray.remote(TrainWorker)
        rollout = [rollout_actor.options(**options).remote(
                       cfg, policy_state, threads, f"rollout worker {i + 1}/{rollout_workers}")
                   for i, options in enumerate(rollout_options)]
        train = [train_actor.options(**options).remote(cfg, rank, train_workers, threads)
                 for rank, options in enumerate(train_options)]
        actors = rollout + train
        hint = resume_hint(cfg)
        trainers = TrainGroup(train, hint, sharded=cfg.train_parallel == "fsdp2")
        cluster = Cluster(RolloutPool(rollout, 0 if pad_id is None else pad_id, hint),
                          trainers, start.policy, start.critic, owns_ray,
                          placement_group=group)
        cluster.trainers.join(ray.put({
            "policy": to_cpu(start.policy.state_dict()),
            "critic": to_cpu(start.critic.state_dict()) if start.critic else None,
            "optimizer": to_cpu(start.optimizer.state_dict()),
            "critic_optimizer": (to_cpu(start.critic_optimizer.state_dict())
                                 if start.critic_optimizer else None)}))
        names = cluster.rollout.names + cluster.trainers.names
        labels = gather([a.device_name.remote() for a in actors], names, hint)  # all up
        if not cfg.quiet:
            print("\n".join(device_lines(names, labels)), file=sys.stderr, flush=True)
        if cfg.overlap_sampling:  # the sampler thread pushes each version it draws with
            cluster.push_rollouts = False
        else:
            cluster.broadcast = open_weight_channel(cluster, cfg.weight_sync, hint)
        return cluster
    except BaseException:
        stop(actors, group, owns_ray)
        raise
