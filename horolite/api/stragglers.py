"""straggler_report(): which rank holds the job back, a horolite addition (Horovod has
no such call). The record itself is kept by the runtime (coordination/straggler.py)."""
from __future__ import annotations

from .process_sets import runtime_for

__all__ = ["straggler_report"]


def straggler_report(process_set=None) -> dict:
    """Per rank of `process_set` (default: the whole job), over the last
    HOROLITE_STRAGGLER_REPORT_SECONDS (default 60) and since init(): how often it was the
    last to submit (``last``, ``last_share``) and how long the first-ready rank waited
    for it (``wait_seconds``, ``mean_wait_seconds`` per time last, ``wait_share``), and
    ``straggler``: the rank that accounts for most of the waiting, or None. The same on
    every rank; as of the last exchange, at most about a second old. A new dict each call
    (built from the runtime's compact copy, which the caller cannot change)."""
    runtime = runtime_for(process_set, "straggler_report")
    return runtime.stragglers.report.as_dict()
