"""Waiting on Ray actors, and saying which one failed.

A dead actor (killed, out of memory, its node lost) is reported by name, e.g. ``rollout
worker 2/2``, with what to do next: the driver keeps checkpoints, so the run continues from
the last one with ``resume=auto``. An error a user can act on (a ``PostRLError`` raised inside
a worker, its constructor included) is re-raised as it is; any other exception in a worker is
a bug and keeps Ray's traceback. Ray is imported where it is used: the workers' modules
import this one and must load without Ray.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from postrl.errors import PostRLError

# once one worker has failed, how long its peers get to report (a peer blocked in a
# collective with a dead worker usually fails within this; if not, the dead one is named)
GRACE_S = 3.0
# how long a collective of postrl's process groups (the trainers', the weight broadcast's)
# waits for a peer before it fails
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


class WorkerError(PostRLError):
    """A Ray actor of the run (rollout or trainer worker) died."""


def gather(futures: Sequence[Any], names: Sequence[str], resume_hint: str) -> list[Any]:
    """``ray.get`` of every future (``ray.ObjectRef``), in order. The first failure raises: a
    dead actor as a :class:`WorkerError` naming it (preferred over errors of its peers), a
    ``PostRLError`` from inside a worker as itself."""
    import ray

    pending = list(futures)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        failure = _failure(done[0])
        if failure is not None:
            more, _ = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S)
            failures = [(done[0], failure)] + [(f, e) for f in more
                                               if (e := _failure(f)) is not None]
            _raise(failures, futures, names, resume_hint)
    return ray.get(list(futures))


def _failure(future) -> Exception | None:
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        ray.get(future)
    except (RayActorError, RayTaskError) as err:
        return err
    return None


def _raise(failures, futures, names, resume_hint: str) -> None:
    from ray.exceptions import RayActorError

    index = {future: i for i, future in enumerate(futures)}
    dead = [(f, e) for f, e in failures if isinstance(e, RayActorError)]
    future, err = (dead or failures)[0]
    name = names[index[future]]
    refused = _constructor_error(err)
    if refused is not None:
        raise refused from None
    if isinstance(err, RayActorError):
        raise WorkerError(f"{name} died ({_reason(err)}; killed, out of memory or crashed). "
                          f"{resume_hint}") from None
    cause = getattr(err, "cause", None)
    if isinstance(cause, PostRLError):
        raise cause from None
    raise err


def _constructor_error(err: Exception) -> PostRLError | None:
    """The ``PostRLError`` an actor's constructor raised (e.g. a GPU it cannot see), rebuilt
    from its text: Ray keeps only the text of a failed constructor's exception."""
    if not getattr(err, "actor_init_failed", False):
        return None
    found = re.findall(r"^(postrl(?:\.\w+)*)\.(\w+): (.*)$", str(err), re.MULTILINE)
    if not found:
        return None
    module, name, message = found[-1]
    try:
        kind = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    if not (isinstance(kind, type) and issubclass(kind, PostRLError)):
        return None
    return kind(message)


def _reason(err) -> str:
    """What Ray says about a dead actor, in one sentence (its messages run to many lines)."""
    text = " ".join(str(err).split())
    detail = re.search(r"exit detail: ([^.]*)", text)
    sentence = detail.group(1) if detail else text.split(". ")[0]
    return f"its process ended: {sentence.strip()[:200]}"
