"""Scaling out on Ray (docs/scaling.md): rollout actors, data-parallel trainer workers, and
the weight sync between them. Used with ``launcher=ray``; nothing here is imported otherwise
(``weights.py`` alone needs no Ray).

Reading path: ``cluster.py`` (what starts where, one step's traffic), ``rollout.py`` (prompts
in contiguous slices over the rollout actors), ``training.py`` (trainer workers running the
trainer's own update loop on their share of the rows), ``parallel.py`` (DDP or FSDP2),
``broadcast.py`` (weights from train rank 0 to the rollout actors), ``failures.py`` (a dead
actor named).
"""
