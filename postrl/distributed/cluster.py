"""What runs where with ``launcher=ray``, and the traffic of one training step.

The driver (the ``Trainer`` process) keeps everything that is not generation or the update:
prompts, rewards, filters, advantages, the reference and old-policy forwards, checkpoints,
metrics, evaluation. R rollout actors generate the prompts of each round in slices; W trainer
actors form a ``torch.distributed`` group and train DDP replicas or FSDP2 shards. After each
training step rank 0's new trainable weights go into the Ray object store once; the driver's
own copy of the policy reads them from there, and so do the rollout actors, unless rank 0
broadcasts the weights to them over a group of their own (``weight_sync``, ``broadcast.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

import postrl
from postrl.distributed.broadcast import choose_backend
from postrl.distributed.failures import gather
from postrl.distributed.rollout import RolloutPool, RolloutWorker
from postrl.distributed.training import TrainGroup, TrainWorker, adopt_state
from postrl.distributed.weights import load_trainable
from postrl.errors import ConfigError
from postrl.train.update import RoundResult, UpdateSettings


@dataclass
class Cluster:
    rollout: RolloutPool
    trainers: TrainGroup
    driver_policy: torch.nn.Module  # the driver's causal LM, kept equal to the replicas
    driver_critic: torch.nn.Module | None
    owns_ray: bool  # started a local Ray instance (shut down on close)
    broadcast: bool = False  # weights reach the rollout actors by train rank 0's broadcast

    def update(self, batch, settings: UpdateSettings, plan: list[torch.Tensor],
               lr: float) -> list[RoundResult]:
        """Train every worker on its share, then send the new weights to the rollout actors
        (a broadcast from rank 0, or the object store) and into the driver's copy (for the
        next step's forwards, evaluation, checkpoints)."""
        results = self.trainers.update(batch, settings, plan, lr)
        receiving = self.rollout.start_receiving() if self.broadcast else None
        reference, weights = self.trainers.weights()  # rank 0 broadcasts while it answers
        if receiving is None:
            self.rollout.load_weights(reference)
        else:
            self.rollout.finish_receiving(receiving)
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
        for actor in self.rollout.actors + self.trainers.actors:
            ray.kill(actor)
        if self.owns_ray:
            ray.shutdown()


def connect(address: str | None) -> bool:
    """Join the Ray session of this process, a running cluster (``address``), or start a
    local instance. Returns whether a local instance was started here."""
    if ray.is_initialized():  # whoever called ray.init made postrl importable on the workers
        return False
    # the workers import the same postrl as this driver, on every node of the cluster
    ray.init(address=address, include_dashboard=False, runtime_env={"py_modules": [postrl]})
    return address is None


def actor_resources(cfg, actors: int) -> tuple[float, float]:
    """``(cpus, gpus)`` each actor reserves; ``worker_cpus=null`` shares the cluster's CPUs
    evenly. A cluster that can never hold every actor is an error naming the option (one that
    is busy with other work holds the actors back until it has room, as Ray does)."""
    total = ray.cluster_resources()
    cpus = cfg.worker_cpus if cfg.worker_cpus is not None else total.get("CPU", 0) / actors
    if cpus <= 0 or cpus * actors > total.get("CPU", 0) + 1e-9:
        raise ConfigError(f"worker_cpus: {actors} actors (rollout_workers + train_workers) "
                          f"x {cpus:g} CPUs do not fit the {total.get('CPU', 0):g} CPUs "
                          "of the Ray cluster; lower worker_cpus or the worker counts")
    if cfg.worker_gpus * actors > total.get("GPU", 0) + 1e-9:
        raise ConfigError(f"worker_gpus: {actors} actors x {cfg.worker_gpus:g} GPUs do not fit "
                          f"the {total.get('GPU', 0):g} GPUs of the Ray cluster")
    return cpus, cfg.worker_gpus


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


def start_cluster(trainer) -> Cluster:
    """Start the rollout actors and trainer workers from the trainer's current state (fresh or
    resumed), wait until all are ready."""
    cfg = trainer.cfg
    owns_ray = connect(cfg.ray_address)
    actors: list = []
    try:
        cpus, gpus = actor_resources(cfg, cfg.rollout_workers + cfg.train_workers)
        threads = cfg.threads or max(1, int(cpus))
        options = {"num_cpus": cpus, "num_gpus": gpus}
        policy_state = ray.put(trainer.lm.state_dict())
        rollout_actor = ray.remote(RolloutWorker).options(**options)
        rollout = [rollout_actor.remote(cfg, policy_state, threads)
                   for _ in range(cfg.rollout_workers)]
        train_actor = ray.remote(TrainWorker).options(**options)
        train = [train_actor.remote(cfg, rank, cfg.train_workers, threads)
                 for rank in range(cfg.train_workers)]
        actors = rollout + train
        hint = resume_hint(cfg)
        pad_id = trainer.tokenizer.pad_token_id
        trainers = TrainGroup(train, hint, sharded=cfg.train_parallel == "fsdp2")
        cluster = Cluster(RolloutPool(rollout, 0 if pad_id is None else pad_id, hint),
                          trainers, trainer.lm, trainer.critic, owns_ray)
        cluster.trainers.join(ray.put({
            "policy": trainer.lm.state_dict(),
            "critic": trainer.critic.state_dict() if trainer.critic else None,
            "optimizer": trainer.optimizer.state_dict(),
            "critic_optimizer": (trainer.critic_optimizer.state_dict()
                                 if trainer.critic_optimizer else None)}))
        gather([a.pid.remote() for a in rollout], cluster.rollout.names, hint)  # all up
        cluster.broadcast = open_weight_channel(cluster, cfg.weight_sync, hint)
        return cluster
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        if owns_ray:
            ray.shutdown()
        raise
