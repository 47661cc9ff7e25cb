"""What a Ray worker's failure was: Ray's own, horolite's runtime's, or the training code's.

The classes are horolite-run's: an error that says the job cannot go on (a peer lost, a
stall, the world moved on: ``horolite.elastic.run.is_runtime_failure``) is the runtime's,
and an elastic job recovers from it; any other error the training code raised is its
own, and ends the job. Ray adds a third kind that horolite-run never sees: the actor's
process, node, scheduling, runtime environment or memory failed (``ActorDiedError``,
``NodeDiedError``, ``ActorUnschedulableError``, ``RuntimeEnvSetupError``,
``OutOfMemoryError``...). Those are failures of the place the worker ran, never the
training code's: an elastic job evicts the worker and goes on.

A worker classifies what its function raised itself (where horolite's runtime state
is) and marks the exception, which Ray carries to the driver as the task error's cause.
"""
from __future__ import annotations

from ray.exceptions import (ActorUnschedulableError, NodeDiedError, RayError, RayTaskError,
                            RuntimeEnvSetupError)

from horolite.errors import HorovodInternalError

__all__ = ["RAY", "RUNTIME", "USER", "classify", "mark", "node_failed"]

RAY, RUNTIME, USER = "ray", "runtime", "user"
_MARK = "horolite_runtime_failure"
# Ray's errors that say the node itself cannot hold a worker now: no newcomer starts
# there until it has cooled down (the elastic job's cooldown_range; for good without).
_NODE_ERRORS = (NodeDiedError, ActorUnschedulableError, RuntimeEnvSetupError)


def mark(error: BaseException) -> None:
    """In the worker: note on `error` whether it is the runtime's (horolite-run's rule)."""
    try:
        from horolite.elastic.run import is_runtime_failure
        setattr(error, _MARK, bool(is_runtime_failure(error)))
    except Exception:  # (an exception that takes no attribute: classify() falls back)
        pass


def classify(error: BaseException) -> str:
    """RAY, RUNTIME or USER for what ray.get raised for a worker's call."""
    if isinstance(error, RayTaskError):
        cause = getattr(error, "cause", None)
        cause = error if cause is None else cause
        marked = getattr(cause, _MARK, None)
        if marked is not None:
            return RUNTIME if marked else USER
        # (unmarked: is_runtime_failure's rule for the type alone)
        return RUNTIME if isinstance(cause, HorovodInternalError) and \
            not isinstance(cause, ValueError) else USER
    if isinstance(error, RayError):
        return RAY
    return USER


def node_failed(error: BaseException) -> bool:
    """A Ray error that makes the worker's node unfit for a newcomer for now."""
    return isinstance(error, _NODE_ERRORS)
