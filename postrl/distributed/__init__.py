"""Scaling out on Ray (docs/scaling.md): rollout actors, data-parallel trainer workers, and
the weight sync between them. Imported only with ``launcher=ray``.

Reading path: ``cluster.py`` (what starts where, one step's traffic), ``rollout.py`` (prompts
in contiguous slices over the rollout actors), ``training.py`` (DDP workers running the
trainer's own update loop on their share of the rows), ``failures.py`` (a dead actor named).
"""

from postrl.distributed.cluster import Cluster, start_cluster
from postrl.distributed.failures import WorkerError

__all__ = ["Cluster", "WorkerError", "start_cluster"]
