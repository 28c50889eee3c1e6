"""What runs where with ``launcher=ray``, and the traffic of one training step.

The driver (the ``Trainer`` process) keeps everything that is not generation or the update:
prompts, rewards, filters, advantages, the reference and old-policy forwards, checkpoints,
metrics, evaluation. R rollout actors generate the prompts of each round in slices; W trainer
actors form a ``torch.distributed`` group and train DDP replicas. After each training step
rank 0's new trainable weights go into the Ray object store once; every rollout actor and the
driver's own copy of the policy read them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

import postrl
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

    def update(self, batch, settings: UpdateSettings, plan: list[torch.Tensor],
               lr: float) -> list[RoundResult]:
        """Train every worker on its share, then send the new weights to the rollout actors
        and into the driver's copy (for the next step's forwards, evaluation, checkpoints)."""
        results = self.trainers.update(batch, settings, plan, lr)
        reference, weights = self.trainers.weights()
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
        return cluster
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        if owns_ray:
            ray.shutdown()
        raise
