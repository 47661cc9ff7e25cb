"""Exceptions the runtime raises; every one names the tensor it concerns."""
from __future__ import annotations

__all__ = ["HorovodInternalError", "TensorMismatchError", "InvalidCollectiveError",
           "AdasumUnsupportedError", "DuplicateNameError",
           "ShutdownError", "StallError", "NotInitializedError", "ControlMessageError",
           "HostsUpdatedInterrupt", "prefixed"]


class HorovodInternalError(RuntimeError):
    """A collective failed. Same name as Horovod's so `except` clauses carry over."""


class TensorMismatchError(HorovodInternalError, ValueError):
    """Ranks submitted the same tensor name with different parameters."""


class InvalidCollectiveError(HorovodInternalError, ValueError):
    """A collective's arguments are wrong on their own (bad root, unsupported dtype...)."""


class AdasumUnsupportedError(InvalidCollectiveError, NotImplementedError):
    """Adasum asked where Horovod refuses it with NotImplementedError: a number of ranks
    that is not a power of two, or a process set other than the global one."""


class DuplicateNameError(HorovodInternalError, ValueError):
    """A tensor name was submitted again while the first one is in flight."""


class ShutdownError(HorovodInternalError):
    """The runtime shut down before this collective completed."""


class StallError(ShutdownError):
    """The stall inspector shut the job down because some ranks never submitted a tensor."""


class NotInitializedError(ValueError):
    """A collective was called before `horolite.init()` (or after `shutdown()`)."""


class ControlMessageError(HorovodInternalError):
    """A control message from another rank could not be decoded (corrupt or foreign bytes)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic jobs: the set of hosts changed (raised by `state.check_host_updates()` on every
    rank at once). Horovod's meaning: keep the current state (no restore to the last commit);
    `skip_sync` is True when hosts were only removed."""

    def __init__(self, skip_sync):
        super().__init__("the set of hosts of this elastic job changed")
        self.skip_sync = skip_sync


def prefixed(error: BaseException, prefix: str) -> BaseException:
    """A copy of `error` whose message starts with `prefix` (a tensor's or a process set's
    name), blaming the same peer and keeping its cause; `error` itself where its type
    takes other arguments, since a copy must still be caught as the original was."""
    try:
        named = type(error)(f"{prefix}: {error}")
    except Exception:
        return error
    named.horolite_peer = getattr(error, "horolite_peer", None)
    named.__cause__ = error.__cause__
    return named
