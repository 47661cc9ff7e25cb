"""The straggler record (coordination/straggler.py): which rank comes last, and how long.

Runs on every rank under mpirun (tests/test_matrix_core.py: 1-4 ranks, the MPI ring, and
pretend hosts 2+2 and 1+3) with HOROLITE_STRAGGLER_REPORT_SECONDS=2. One rank is made
slow by a delay before each submit (a sleep, or a busy loop that takes its core); what
the runtime reports is compared with that injected delay, never with its own numbers.
Every claim is read from straggler_report(), rank 0's log or the timeline.
"""
import json
import logging
import os
import tempfile
import time

import numpy as np
import pytest

import horolite as hvd
from horolite.core.timeline import read_events
from horolite.api.process_sets import runtime_for
from horolite.runtime import registry

SIZE_AT_INIT = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE")
                   or os.environ.get("HOROLITE_SIZE") or 1)
SUBSET = [1, SIZE_AT_INIT - 1] if SIZE_AT_INIT >= 3 else None
SUBSET_SET = hvd.ProcessSet(SUBSET) if SUBSET else None
hvd.init(process_sets=[SUBSET_SET] if SUBSET_SET else None)
RANK, SIZE = hvd.rank(), hvd.size()
RT = registry.global_runtime()
SLOW = SIZE - 1
DELAY = 0.06  # seconds the slow rank is late at each step
STEP = 0.1  # seconds of "compute" every rank spends per step in a balanced job
OUTDIR = os.environ.get("HOROLITE_TEST_OUTDIR") or tempfile.mkdtemp()
WINDOW = float(os.environ.get("HOROLITE_STRAGGLER_REPORT_SECONDS", "60"))


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


LOG = Lines()
logging.getLogger("horolite.coordination.straggler").addHandler(LOG)


def settle(runtime=RT, timeout=10.0):
    """Wait until every round this rank noted has reached rank 0 and the report is back."""
    time.sleep(0.05)
    deadline = time.monotonic() + timeout
    while runtime.stragglers.ages.count:
        assert time.monotonic() < deadline, "the straggler record was never exchanged"
        time.sleep(0.02)


def totals(process_set=None):
    report = hvd.straggler_report(process_set)
    return report, {r: v["total"] for r, v in report["ranks"].items()}


def late(seconds, spin):
    if spin:  # takes its core, as a busy data loader would
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(seconds)


def phase(steps, delay_of, spin=False, process_set=None, name="straggle"):
    """Run `steps` allreduces, this rank first waiting delay_of(step); the change in the
    report's totals (per job rank: rounds last, seconds of waiting caused)."""
    runtime = RT if process_set is None else runtime_for(process_set, "test")
    settle(runtime)
    _, before = totals(process_set)
    for step in range(steps):
        delay = delay_of(step)
        if delay:
            late(delay, spin)
        hvd.allreduce(np.full(4, float(RANK)), name=name, process_set=process_set)
    settle(runtime)
    report, after = totals(process_set)
    last = {r: after[r]["last"] - before[r]["last"] for r in after}
    wait = {r: after[r]["wait_seconds"] - before[r]["wait_seconds"] for r in after}
    return report, last, wait


def slow_rank(step):
    return DELAY if RANK == SLOW else 0.0


def check_named(last, wait, steps, slow=SLOW, delay=DELAY):
    assert last[slow] >= 0.8 * steps, (last, wait)
    measured = wait[slow] / last[slow]
    assert abs(measured - delay) <= 0.2 * delay, (measured, delay, last, wait)
    assert sum(last[r] for r in last if r != slow) <= 0.2 * steps, last


def needs_two():
    if SIZE < 2:
        pytest.skip("needs a straggler: at least two ranks")


def test_a_balanced_job_names_no_rank():
    # Every rank does the same work; run longer than the window, so it holds nothing else.
    if SIZE < 2:
        report, last, wait = phase(20, lambda s: 0.01)
        assert report["straggler"] == {"window": None, "total": None}
        assert sum(last.values()) == 0  # one rank waits for nobody
        return
    steps = int(WINDOW / STEP) + 5
    report, last, wait = phase(steps, lambda s: STEP)
    assert report["straggler"]["window"] is None, report
    # Nobody was late by anything like an injected delay.
    assert max(wait.values()) <= 0.2 * DELAY * steps, wait


@pytest.mark.parametrize("spin", [False, True], ids=["sleep", "busy"])
def test_a_slow_rank_is_named_with_its_delay(spin):
    needs_two()
    LOG.lines.clear()
    steps = int(WINDOW / DELAY) + 10  # longer than the window: the log line comes in it
    report, last, wait = phase(steps, slow_rank, spin)
    check_named(last, wait, steps)
    assert report["straggler"]["window"] == SLOW, report
    if RANK == 0:
        assert any(f"rank {SLOW} (host " in line and "was last in" in line
                   for line in LOG.lines), LOG.lines
    # The share and mean are what straggler_report() says too, over the window.
    mine = report["ranks"][SLOW]["window"]
    assert abs(mine["mean_wait_seconds"] - DELAY) <= 0.2 * DELAY, mine
    assert mine["wait_share"] > 0.5, mine


def test_a_rank_slow_for_a_while_is_named_then_not():
    needs_two()
    steps = int(WINDOW / DELAY) + 5
    report, last, wait = phase(steps, slow_rank)
    check_named(last, wait, steps)
    assert report["straggler"]["window"] == SLOW, report
    # Then balanced for longer than the window: the window forgets the slow rank.
    calm = int(WINDOW / STEP) + 5
    report, last, wait = phase(calm, lambda s: STEP)
    assert report["straggler"]["window"] is None, report
    assert wait[SLOW] <= 0.2 * DELAY * calm, wait
    assert report["ranks"][SLOW]["window"]["last"] < 0.8 * report["rounds"]["window"], report


def test_the_timeline_shows_when_each_rank_submitted():
    needs_two()
    path = os.path.join(OUTDIR, "stragglers.json")
    hvd.start_timeline(path)
    steps = 10
    try:
        phase(steps, slow_rank, name="timed")
    finally:
        hvd.stop_timeline()
    if RANK != 0:
        return
    events = read_events(path)
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    mine = [e for e in events if e.get("ph") == "X" and e["name"] == "timed"
            and rows.get(e["tid"], "").startswith("submitted: rank ")]
    by_rank = {}
    for e in mine:
        by_rank.setdefault(int(rows[e["tid"]].split()[-1]), []).append(e["args"]["after_first_ms"])
    assert sorted(by_rank) == list(range(SIZE)), rows
    late_ms = sorted(by_rank[SLOW])[len(by_rank[SLOW]) // 2]  # the median step
    assert abs(late_ms - 1e3 * DELAY) <= 0.2 * 1e3 * DELAY, by_rank[SLOW]
    assert max(sorted(v)[len(v) // 2] for r, v in by_rank.items() if r != SLOW) \
        <= 0.2 * 1e3 * DELAY, by_rank


def test_a_process_set_reports_its_own_ranks():
    if SUBSET is None:
        pytest.skip("a subset of two ranks needs a third outside it")
    if RANK not in SUBSET:
        pytest.skip("not a member")
    slow = SUBSET[-1]
    steps = 15
    report, last, wait = phase(steps, lambda s: DELAY if RANK == slow else 0.0,
                               process_set=SUBSET_SET, name="subset")
    assert sorted(report["ranks"]) == SUBSET, report
    check_named(last, wait, steps, slow)
    assert report["straggler"]["total"] == slow or report["straggler"]["window"] == slow, report
    json.dumps(report)  # plain numbers and strings


def test_a_quiet_stretch_ages_the_window_out():
    # Finding 9: after a slow phase, no collectives for longer than the window. The report
    # must not keep naming the old straggler: rank 0 asks for an exchange (with no rounds)
    # once the window's oldest rounds are older than the window.
    needs_two()
    steps = int(WINDOW / DELAY) + 5
    report, last, wait = phase(steps, slow_rank, name="before.quiet")
    assert report["straggler"]["window"] == SLOW, report
    time.sleep(WINDOW + 1.5)  # no collective here (idle cycles only)
    deadline = time.monotonic() + 5.0  # a loaded machine's idle cycles come 0.1 s apart
    report = hvd.straggler_report()
    while report["rounds"]["window"] and time.monotonic() < deadline:
        time.sleep(0.1)
        report = hvd.straggler_report()
    assert report["straggler"]["window"] is None, report
    assert report["rounds"]["window"] == 0, report
    assert report["ranks"][SLOW]["window"]["wait_seconds"] == 0.0, report
    assert report["straggler"]["total"] == SLOW  # the totals keep it


def test_joining_is_not_straggling():
    # Finding 10: the last rank to join() is not charged with the time the others spent
    # joined (uneven data is what join is for), nor anyone with a barrier's wait.
    needs_two()
    extra, each = 10, 0.1
    settle()
    _, before = totals()
    if RANK == SLOW:
        for step in range(extra):
            time.sleep(each)
            hvd.allreduce(np.full(4, float(RANK)), name=f"uneven.{step}")
    hvd.join()
    if RANK == 0:
        time.sleep(extra * each)  # a checkpoint written before the others pass the barrier
    hvd.barrier()
    settle()
    _, after = totals()
    grew = {r: after[r]["wait_seconds"] - before[r]["wait_seconds"] for r in after}
    assert max(grew.values()) < 0.3 * extra * each, grew
