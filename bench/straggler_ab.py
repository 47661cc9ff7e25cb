"""The straggler record's cost (docs/stragglers.md): the same collectives with the record
on and off, in alternating blocks of one run, so both see the same machine. The issue's
bound is 2%; nothing asserts it (speed is never asserted), the ratios are printed, beside
an A/A ratio (off against off, in the same blocks) that shows how much this machine's
noise alone moves them. Used by `step_allreduce.py --stragglers-ab` and
`small_tensors.py --stragglers-ab`."""
from __future__ import annotations

from typing import Callable, Dict

import time

import numpy as np

import common

STATES = ("on", "off", "off again")


def compare(fns: Dict[str, Callable[[], object]], steps: int, blocks: int, comm) -> dict:
    """{name: {state: [median seconds in block b]}}: each block runs steps / blocks timed
    runs (the slowest rank's time) of each fn in each state, the states' order rotated
    every block. Off means the runtime notes nothing (StragglerRound.enabled), switched on
    every rank between collectives."""
    from horolite.api.basics import runtime
    record = runtime().stragglers
    per = max(1, -(-steps // blocks))
    out = {name: {state: [] for state in STATES} for name in fns}
    exchanges, spent, t0 = record.exchanges, record.exchange_seconds, time.monotonic()
    for block in range(blocks):
        k = block % len(STATES)
        for state in STATES[k:] + STATES[:k]:
            comm.Barrier()  # every rank's collectives are done before the switch
            record.enabled = state == "on"
            comm.Barrier()
            for name, fn in fns.items():
                out[name][state].append(float(np.median(common._times(fn, per, 1, comm))))
    record.enabled = True
    # The exchanges with rank 0 (about once a second while on): their share of the run.
    out["exchanges"] = {"count": record.exchanges - exchanges,
                        "seconds": record.exchange_seconds - spent,
                        "run_seconds": time.monotonic() - t0}
    return out


def _ratio(t: dict, a: str, b: str) -> str:
    """Median over blocks of a / b, with the middle half of the blocks' ratios."""
    r = np.array(t[a]) / np.array(t[b])
    low, high = np.percentile(r, [25, 75])
    return f"{np.median(r):.3f} ({low:.2f}-{high:.2f})"


def print_table(title: str, times: dict, comm) -> None:
    """Rank 0 prints each state's median and the block-wise ratios."""
    if comm.Get_rank():
        return
    rows = {name: t for name, t in times.items() if name != "exchanges"}
    blocks = len(next(iter(rows.values()))["on"])
    print(f"\n{title}: the straggler record on vs off (np {comm.Get_size()}, {blocks} blocks)")
    print(f"{'what':38s} {'on ms':>9s} {'off ms':>9s} {'on / off':>19s} {'A/A: off / off':>19s}")
    for name, t in rows.items():
        print(f"{name:38s} {np.median(t['on']) * 1e3:9.3f} {np.median(t['off']) * 1e3:9.3f} "
              f"{_ratio(t, 'on', 'off'):>19s} {_ratio(t, 'off again', 'off'):>19s}", flush=True)
    ex = times.get("exchanges")
    if ex:
        print(f"exchanges with rank 0 on rank 0: {ex['count']}, {ex['seconds'] * 1e3:.1f} ms in all "
              f"({ex['seconds'] * 1e3 / max(ex['count'], 1):.2f} ms each), "
              f"{100 * ex['seconds'] / ex['run_seconds']:.2f}% of the run", flush=True)
