"""Timeline, stall inspector, shutdown with pending work, re-init, init on a subset.

Tests run in file order and re-initialize the runtime with new settings.
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

OUTDIR = os.environ.get("HOROLITE_TEST_OUTDIR") or tempfile.mkdtemp()
TIMELINE = os.path.join(OUTDIR, "timeline.json")
os.environ["HOROLITE_TIMELINE"] = TIMELINE
os.environ["HOROLITE_STALL_CHECK_TIME_SECONDS"] = "1"
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
multi = pytest.mark.skipif(SIZE == 1, reason="needs at least two ranks")


class Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def reinit(**env):
    hvd.shutdown()
    for key in [k for k in os.environ if k.startswith("HOROLITE_") and k != "HOROLITE_TEST_OUTDIR"
                and k != "HOROLITE_UNDER_MPIRUN"]:
        del os.environ[key]
    os.environ.update(env)
    hvd.init()


def test_timeline_is_json_with_every_phase():
    handles = [hvd.allreduce_async(np.ones(100, np.float32), name=f"tl.{i}") for i in range(4)]
    for h in handles:
        h.result()
    hvd.allgather(np.ones((1, 2)), name="tl.gather")
    path = TIMELINE if RANK == 0 else TIMELINE.replace(".json", f".rank{RANK}.json")
    # Readable while the runtime is still writing (an open array); events reach the
    # file at the end of the cycle that recorded them, so wait for that cycle.
    deadline = time.monotonic() + 10
    while True:
        events = read_events(path)
        rows = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
        if {"tl.0", "tl.3", "tl.gather"} <= set(rows) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert {"tl.0", "tl.3", "tl.gather"} <= set(rows)
    phases = {e["name"] for e in events if e.get("ph") == "X" and e["tid"] == rows["tl.1"]}
    # (no MEMCPY_OUT_FUSION_BUFFER on the host: a fused tensor's result is a view of the
    # batch; through shared memory no MEMCPY_IN either: the members are read where they lie)
    # A tensor alone in its batch is reduced from where it lies, straight into its result:
    # no copy in either. Whether tl.1 shared its batch (the four may reach the background
    # thread in one cycle or in several): its ALLREDUCE span is another member's too.
    from horolite.api.basics import runtime
    reduced = {tid: e["ts"] for e in events if e.get("name") == "ALLREDUCE"
               for tid in [e["tid"]]}
    fused = any(reduced.get(rows[f"tl.{k}"]) == reduced[rows["tl.1"]] for k in (0, 2, 3))
    packed = fused and not runtime().transport.reads_parts
    assert {"NEGOTIATE", "QUEUE", "ALLREDUCE"} <= phases
    assert ("MEMCPY_IN_FUSION_BUFFER" in phases) == packed, (phases, fused)
    assert "ALLGATHER" in {e["name"] for e in events if e.get("tid") == rows["tl.gather"]}


def test_timeline_starts_and_stops_at_run_time():
    # Horovod's start_timeline/stop_timeline: a second file for a window of collectives,
    # valid JSON once stopped, then nothing more is written to it.
    path = os.path.join(OUTDIR, "window.json")
    mine = path if RANK == 0 else path.replace(".json", f".rank{RANK}.json")
    hvd.start_timeline(path, mark_cycles=True)
    np.testing.assert_allclose(hvd.allreduce(np.full(8, RANK + 1.0), op=hvd.Sum, name="window.in"),
                               np.full(8, SIZE * (SIZE + 1) / 2))
    hvd.stop_timeline()
    hvd.allreduce(np.ones(8), name="window.after")
    events = json.load(open(mine))  # closed: plain JSON
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "window.in" in names and "window.after" not in names
    assert any(e.get("name") == "CYCLE_START" for e in events)
    with pytest.raises(ValueError, match="file_path"):
        hvd.start_timeline("")
    # ... and the runtime goes on as before
    np.testing.assert_allclose(hvd.allreduce(np.ones(3), op=hvd.Sum, name="window.later"), np.full(3, SIZE))


def test_capabilities_say_what_this_install_has():
    # horolite-run --gloo sets HOROLITE_RANK: that job runs without MPI (Horovod's Gloo mode)
    without_mpi = "HOROLITE_RANK" in os.environ
    assert hvd.mpi_built() and hvd.gloo_built()
    assert hvd.mpi_enabled() != without_mpi and hvd.gloo_enabled() == without_mpi
    assert not (hvd.rocm_built() or hvd.ddl_built() or hvd.ccl_built())
    try:
        import cupy  # noqa: F401
        has_cupy = True
    except ImportError:
        has_cupy = False
    assert hvd.cuda_built() == has_cupy
    assert hvd.nccl_built() <= hvd.cuda_built()


@multi
def test_stall_is_reported_with_missing_ranks():
    capture = Capture()
    logging.getLogger("horolite").addHandler(capture)
    try:
        if RANK == 0:
            handle = hvd.allreduce_async(np.ones(2), name="late.tensor")
            time.sleep(3.0)
        else:
            time.sleep(3.0)
            handle = hvd.allreduce_async(np.ones(2), name="late.tensor")
        np.testing.assert_allclose(handle.result(), np.ones(2))
    finally:
        logging.getLogger("horolite").removeHandler(capture)
    if RANK == 0:
        missing = ", ".join(str(r) for r in range(1, SIZE))
        text = "\n".join(capture.messages)
        assert "stall detected" in text and "tensor 'late.tensor'" in text, text
        assert f"submitted by rank 0, missing on rank{'s' if SIZE > 2 else ''} {missing}" in text, text


def test_shutdown_with_pending_work_fails_it_everywhere():
    reinit()
    # Each rank waits on a tensor no other rank submits (on one rank, on nobody else).
    pending = hvd.allreduce_async(np.ones(2), name=f"orphan.{RANK}") if SIZE > 1 else None
    hvd.barrier()
    hvd.shutdown()
    if pending is not None:
        with pytest.raises(hvd.ShutdownError, match=f"tensor 'orphan.{RANK}'.*shut down"):
            pending.result(timeout=30)
    with pytest.raises(hvd.NotInitializedError, match=r"call horolite.init\(\) first"):
        hvd.allreduce(np.ones(2), name="after.shutdown")
    assert not hvd.is_initialized()


def test_reinit_works():
    hvd.init()
    np.testing.assert_allclose(hvd.allreduce(np.ones(3), op=hvd.Sum, name="reinit"), np.full(3, SIZE))


def test_init_on_a_subset_of_ranks():
    hvd.shutdown()
    members = list(range(0, SIZE, 2))  # even ranks
    if RANK in members:
        hvd.init(comm=members)
        assert hvd.size() == len(members) and hvd.rank() == members.index(RANK)
        got = hvd.allreduce(np.full(2, RANK, np.float64), op=hvd.Sum, name="subset")
        np.testing.assert_allclose(got, np.full(2, sum(members)))
        hvd.shutdown()
    else:
        with pytest.raises(ValueError, match=f"world rank {RANK} is not in the list"):
            hvd.init(comm=members)
    hvd.init()
    hvd.barrier()


def test_every_rank_adopts_rank0_settings():
    # Fusion planning must be identical everywhere: rank 0's threshold and cycle time rule.
    reinit(HOROLITE_FUSION_THRESHOLD=str(1000 * (RANK + 1)), HOROLITE_CYCLE_TIME=str(RANK + 1))
    hvd.allreduce(np.ones(2), name="adopt")
    rt = hvd.api.basics.runtime()
    assert rt.executor.fusion_threshold == 1000
    assert rt._cycle_seconds == pytest.approx(0.001)


def test_peer_connections_are_watched_only_across_hosts():
    # links.py guards sends to peers on other hosts; ranks on one host share memory,
    # and watching costs every thread that sends a look at this process's sockets.
    from horolite.core.hosts import host_name
    from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
    hosts = set(MPI.COMM_WORLD.allgather(host_name()))
    rt = hvd.api.basics.runtime()
    assert (rt.links is not None) == (len(hosts) > 1), hosts


def test_over_tcp_the_control_exchange_goes_over_tcp_too():
    # (transport/tcp_control.py: among every rank, or among the hosts' leaders)
    rt = hvd.api.basics.runtime()
    transport = rt.transport
    if transport.cross_host is None:
        assert transport.control_tcp is None
        return
    host_control = transport.host_control
    if host_control is None:
        assert transport.control_tcp is not None
    else:
        assert transport.control_tcp is None
        assert (host_control.tcp is not None) == host_control.leader


@multi
def test_stall_shutdown_ends_the_job_with_the_message():
    reinit(HOROLITE_STALL_CHECK_TIME_SECONDS="0.5", HOROLITE_STALL_SHUTDOWN_TIME_SECONDS="1.5")
    # Every rank waits on a tensor only it submitted: rank 0 shuts the job down.
    handle = hvd.allreduce_async(np.ones(2), name=f"stuck.{RANK}")
    with pytest.raises(hvd.StallError) as info:
        handle.result(timeout=60)
    msg = str(info.value)
    assert f"tensor 'stuck.{RANK}'" in msg and "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS" in msg
    assert "submitted by rank" in msg and "missing on" in msg
    with pytest.raises(hvd.StallError):
        hvd.allreduce(np.ones(2), name="after.stall")
    hvd.shutdown()
