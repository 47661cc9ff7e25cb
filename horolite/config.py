"""Runtime configuration: one frozen object read once from the environment.

Every knob is ``HOROLITE_<NAME>``; the ``HOROVOD_<NAME>`` spelling is accepted
so Horovod users' job scripts keep working. An explicit argument beats the
environment, which beats the default.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping, Optional

__all__ = ["Config", "from_environ", "env_value", "VARIABLES"]

_log = logging.getLogger("horolite.config")

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}

# name -> (default, description). The README's table is generated from this.
VARIABLES = {
    "CYCLE_TIME": ("1", "Milliseconds between background cycles while work is flowing."),
    "FUSION_THRESHOLD": ("134217728", "Bytes of the fusion buffer; 0 disables fusion."),
    "CACHE_CAPACITY": ("1024", "Entries in the response cache; 0 disables it."),
    "STALL_CHECK_DISABLE": ("0", "1 turns the stall inspector off."),
    "STALL_CHECK_TIME_SECONDS": ("60", "Seconds a tensor may wait for other ranks before it is reported."),
    "STALL_SHUTDOWN_TIME_SECONDS": ("0", "Seconds after which a stalled job is shut down (0: never)."),
    "TIMELINE": ("", "Path of a Chrome trace JSON file written by every rank (rank suffix added past rank 0)."),
    "TIMELINE_MARK_CYCLES": ("0", "1 marks every background cycle in the timeline."),
    "LOG_LEVEL": ("WARNING", "Logging level: TRACE, DEBUG, INFO, WARNING, ERROR, FATAL."),
    "WAIT_MODE": ("poll", "How the background thread waits on MPI: poll (spin briefly, then sleep) or block."),
    "SHARED_MEMORY": ("1", "1 reduces through memory shared by the ranks when all are on one host; 0 always uses the ring over MPI."),
    "AUTOTUNE": ("0", "1 tunes fusion threshold and cycle time online."),
    "AUTOTUNE_LOG": ("", "CSV file where autotune writes its samples."),
    "AUTOTUNE_START": ("", "Where autotune starts, e.g. cycle_time_ms=50 (not held fixed)."),
    "HIERARCHICAL_ALLREDUCE": ("0", "1 sends allreduces through each host first (reduce in the host, one part per rank across hosts, spread in the host) where hosts hold equal blocks of several ranks."),
    "HIERARCHICAL_ALLGATHER": ("0", "1 sends allgathers through each host first, as for the allreduce."),
}


def env_value(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The value of HOROLITE_<name>, else HOROVOD_<name>, else None."""
    environ = os.environ if environ is None else environ
    for prefix in ("HOROLITE_", "HOROVOD_"):
        value = environ.get(prefix + name)
        if value is not None:
            return value
    return None


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"HOROLITE_{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _parse_number(name: str, raw: str, kind):
    try:
        value = kind(raw.strip())
    except ValueError:
        raise ValueError(f"HOROLITE_{name}={raw!r} is not a {kind.__name__}") from None
    if value < 0:
        raise ValueError(f"HOROLITE_{name}={raw!r} must not be negative")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    cycle_time_ms: float = 1.0
    fusion_threshold: int = 128 * 1024 * 1024
    cache_capacity: int = 1024
    stall_check_disable: bool = False
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0
    timeline: str = ""
    timeline_mark_cycles: bool = False
    log_level: str = "WARNING"
    wait_mode: str = "poll"
    shared_memory: bool = True
    autotune: bool = False
    autotune_log: str = ""
    autotune_start: str = ""
    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False
    # Names of the fields the user set explicitly (autotune holds them fixed).
    explicit: frozenset = frozenset()


_FIELDS = {
    "CYCLE_TIME": ("cycle_time_ms", float),
    "FUSION_THRESHOLD": ("fusion_threshold", int),
    "CACHE_CAPACITY": ("cache_capacity", int),
    "STALL_CHECK_DISABLE": ("stall_check_disable", bool),
    "STALL_CHECK_TIME_SECONDS": ("stall_check_time_seconds", float),
    "STALL_SHUTDOWN_TIME_SECONDS": ("stall_shutdown_time_seconds", float),
    "TIMELINE": ("timeline", str),
    "TIMELINE_MARK_CYCLES": ("timeline_mark_cycles", bool),
    "LOG_LEVEL": ("log_level", str),
    "WAIT_MODE": ("wait_mode", str),
    "SHARED_MEMORY": ("shared_memory", bool),
    "AUTOTUNE": ("autotune", bool),
    "AUTOTUNE_LOG": ("autotune_log", str),
    "AUTOTUNE_START": ("autotune_start", str),
    "HIERARCHICAL_ALLREDUCE": ("hierarchical_allreduce", bool),
    "HIERARCHICAL_ALLGATHER": ("hierarchical_allgather", bool),
}

_LOG_LEVELS = {"TRACE", "DEBUG", "INFO", "WARNING", "WARN", "ERROR", "FATAL", "CRITICAL"}


def from_environ(environ: Optional[Mapping[str, str]] = None, **overrides) -> Config:
    """Build the Config; keyword overrides win over the environment."""
    values = {}
    explicit = set()
    for name, (field, kind) in _FIELDS.items():
        raw = env_value(name, environ)
        if raw is None:
            continue
        explicit.add(field)
        if kind is bool:
            values[field] = _parse_bool(name, raw)
        elif kind is str:
            values[field] = raw.strip()
        else:
            values[field] = _parse_number(name, raw, kind)
    for field, value in overrides.items():
        if value is not None:
            values[field] = value
            explicit.add(field)
    level = values.get("log_level", "WARNING").upper()
    if level not in _LOG_LEVELS:
        _log.warning("unknown HOROLITE_LOG_LEVEL=%r, using WARNING", level)
        level = "WARNING"
    values["log_level"] = level
    mode = values.get("wait_mode", "poll").lower()
    if mode not in ("poll", "block"):
        raise ValueError(f"HOROLITE_WAIT_MODE={mode!r} must be poll or block")
    values["wait_mode"] = mode
    return Config(explicit=frozenset(explicit), **values)
