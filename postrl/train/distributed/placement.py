"""Which GPU each actor goes to (``worker_gpus > 0``), as a plan of Ray placement-group
bundles.

Ray places actors that reserve fractions of a GPU wherever they fit, so with
``worker_gpus=0.5`` two trainer workers could land on one GPU, and NCCL refuses two ranks of
one group on the same GPU. A bundle here stands for one GPU (or, at ``worker_gpus >= 1``, one
actor's whole GPUs): it holds at most one trainer worker, with rollout actors beside it, so
no two trainer ranks ever share a GPU. Pure: ``cluster.place`` turns a plan into a placement
group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from postrl.errors import ConfigError

EPS = 1e-9


@dataclass(frozen=True)
class Placement:
    bundles: list[dict[str, float]]  # the resources of each bundle (one GPU, or one actor's)
    rollout: list[int]  # the bundle of each rollout actor
    train: list[int]  # the bundle of each trainer worker (all different)


def plan_placement(rollout_workers: int, train_workers: int, cpus: float, gpus: float,
                   cluster_gpus: float) -> Placement | None:
    """The bundles for R rollout actors and W trainer workers that reserve ``cpus`` CPUs and
    ``gpus`` GPUs each, on a cluster of ``cluster_gpus`` GPUs; None on the CPU (Ray places
    CPU actors freely). Trainer ``t`` takes bundle ``t``; each rollout actor goes to the
    bundle with the fewest actors, so the GPUs are shared evenly. A layout that does not fit
    is a ConfigError naming the options."""
    if gpus <= 0:
        return None
    if gpus > 1 and abs(gpus - round(gpus)) > EPS:
        raise ConfigError(f"worker_gpus={gpus:g}: above 1 an actor's GPUs must be a whole "
                          "number (Ray shares only single GPUs)")
    per_gpu = math.floor(1 / gpus + EPS) if gpus < 1 else 1  # actors a bundle holds
    bundle_gpus = 1.0 if gpus < 1 else float(round(gpus))
    count = max(train_workers, math.ceil((rollout_workers + train_workers) / per_gpu))
    if count * bundle_gpus > cluster_gpus + EPS:
        raise ConfigError(_too_few_gpus(rollout_workers, train_workers, gpus, per_gpu,
                                        count * bundle_gpus, cluster_gpus))
    members = [1] * train_workers + [0] * (count - train_workers)
    rollout = []
    for _ in range(rollout_workers):
        bundle = members.index(min(members))
        members[bundle] += 1
        rollout.append(bundle)
    bundles = [{"CPU": cpus * n, "GPU": bundle_gpus} for n in members]
    return Placement(bundles, rollout, list(range(train_workers)))


def _too_few_gpus(rollout_workers: int, train_workers: int, gpus: float, per_gpu: int,
                  needed: float, cluster_gpus: float) -> str:
    layout = (f"each GPU holds at most {per_gpu} actors and one trainer worker, since NCCL "
              "cannot put two ranks of the trainers' group on one GPU" if gpus < 1 else
              f"{gpus:g} GPU{'s' * (gpus != 1)} of its own for each actor")
    return (f"worker_gpus={gpus:g}: rollout_workers={rollout_workers} and "
            f"train_workers={train_workers} need {needed:g} GPUs ({layout}), and the Ray "
            f"cluster has {cluster_gpus:g}; lower rollout_workers or train_workers, or "
            "change worker_gpus")
