"""Drive the core runtime's rank-side tests under a real mpirun with 1, 2, 3 and 4 ranks."""
import os

import pytest

from mpirun import RANK_COUNTS, ROOT, run_pytest_file

PARALLEL = os.path.join(ROOT, "tests", "parallel")

VARIANTS = {
    "default": {},
    # All ranks share this host, so by default allreduce goes through shared memory;
    # across hosts it is the ring over MPI messages: run that path here too.
    "mpi-ring": {"HOROLITE_SHARED_MEMORY": "0"},
    "nocache-nofusion": {"HOROLITE_CACHE_CAPACITY": "0", "HOROLITE_FUSION_THRESHOLD": "0"},
    # A tiny fusion buffer and cache: the big tensors exceed it, evictions happen.
    "smallfusion-smallcache": {"HOROLITE_FUSION_THRESHOLD": "65536", "HOROLITE_CACHE_CAPACITY": "7",
                               "HOROVOD_CYCLE_TIME": "2"},
    # Agreed allreduces on the exchange lane's thread (on by default only across hosts).
    "lane": {"HOROLITE_EXCHANGE_PIPELINE": "1"},
    "lane-mpi-ring": {"HOROLITE_EXCHANGE_PIPELINE": "1", "HOROLITE_SHARED_MEMORY": "0"},
    # ... with rank 0 moving the fusion threshold while lists wait in the lane (the
    # cycle time held, so the threshold's turn comes at once).
    "lane-autotune": {"HOROLITE_EXCHANGE_PIPELINE": "1", "HOROLITE_SHARED_MEMORY": "0",
                      "HOROLITE_AUTOTUNE": "1", "HOROLITE_CYCLE_TIME": "1"},
}


# (lane-autotune: the lists' fusion under a moving threshold is test_exchange_lane's case;
# the whole collective file under it would add four long jobs to CI for nothing more.)
# The default path at np 1-4; each other variant (a setting that moves the same collectives
# onto another path) at np 2 or 3 in turn, an even or an odd ring (the rings under them run
# at np 1-4 by default): at np 1 nothing travels, and np 4 adds no path np 2 and 3 lack.
@pytest.mark.parametrize("np_,variant", [(n, "default") for n in RANK_COUNTS] + [
    (2 + i % 2, v) for i, v in enumerate(v for v in sorted(VARIANTS)
                                         if v not in ("default", "lane-autotune"))])
def test_collectives(np_, variant):
    run_pytest_file(os.path.join(PARALLEL, "test_collectives.py"), np_, VARIANTS[variant])


@pytest.mark.parametrize("np_,variant", [(n, "default") for n in RANK_COUNTS] + [(3, "lane-mpi-ring")])
def test_errors(np_, variant):
    run_pytest_file(os.path.join(PARALLEL, "test_errors.py"), np_, VARIANTS[variant])


@pytest.mark.parametrize("np_,variant", [(n, "default") for n in RANK_COUNTS] + [(3, "lane-mpi-ring")])
def test_lifecycle(np_, variant):
    run_pytest_file(os.path.join(PARALLEL, "test_lifecycle.py"), np_, VARIANTS[variant])


@pytest.mark.parametrize("np_,variant", [(n, "lane") for n in RANK_COUNTS]
                         + [(3, "lane-autotune"), (4, "pretend-hosts")])
def test_exchange_lane(np_, variant):
    # (pretend hosts: there `auto` turns the lane on; over MPI here, over horolite's TCP
    # connections in test_runtime_over_tcp, at 1+1 and 2+2; lane-autotune runs the lane
    # over the MPI ring, without shared memory)
    env = ({"HOROLITE_TEST_HOST_IDENTITY": "1+1" if np_ == 2 else "2+2",
            "HOROLITE_CROSS_HOST_TRANSPORT": "mpi"}
           if variant == "pretend-hosts" else VARIANTS[variant])
    run_pytest_file(os.path.join(PARALLEL, "test_exchange_lane.py"), np_, env)


LANE_SCRIPT = """
import os, sys
import horolite as hvd
from horolite.runtime import registry
hvd.init()
with open(os.path.join(sys.argv[1], "lane.%d" % hvd.rank()), "w") as out:
    out.write(str(registry.current().lane is not None))
"""


@pytest.mark.parametrize("env,on", [({}, False), ({"HOROLITE_TEST_HOST_IDENTITY": "1+1"}, True),
                                    ({"HOROLITE_TEST_HOST_IDENTITY": "1+1",
                                      "HOROVOD_EXCHANGE_PIPELINE": "0"}, False),
                                    ({"HOROLITE_EXCHANGE_PIPELINE": "1"}, True),
                                    ({"HOROLITE_EXCHANGE_PIPELINE": "1",
                                      "HOROLITE_MPI_THREADS_DISABLE": "1"}, False)])
def test_the_lane_is_on_across_hosts_by_default(env, on, tmp_path):
    import subprocess
    import sys
    from mpirun import mpirun_command
    proc = subprocess.run(mpirun_command(2) + [sys.executable, "-c", LANE_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"lane.{r}").read_text() for r in range(2)] == [str(on)] * 2


@pytest.mark.parametrize("env,warned", [({"HOROLITE_TEST_HOST_IDENTITY": "1+1"}, True),
                                        ({"HOROLITE_EXCHANGE_PIPELINE": "1"}, True), ({}, False)])
def test_block_wait_mode_where_the_lane_polls_is_a_warning(env, warned, tmp_path):
    import subprocess
    import sys
    from mpirun import mpirun_command
    from horolite.transport.mpi import oversubscribed
    if "HOROLITE_TEST_HOST_IDENTITY" not in env and oversubscribed(2):
        warned = False  # block was ignored already, with the other warning (ranks > cores)
    proc = subprocess.run(mpirun_command(2) + [sys.executable, "-c", LANE_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, HOROLITE_WAIT_MODE="block", **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"lane.{r}").read_text() for r in range(2)] == [str(bool(env))] * 2
    said = [line.split("rank ")[1][0] for line in proc.stderr.splitlines()
            if "WAIT_MODE=block ignored: the exchange lane" in line]
    assert sorted(said) == (["0", "1"] if warned else []), proc.stderr[-3000:]  # once each


EXIT_SCRIPT = """
import os, sys
import numpy as np
import horolite as hvd
hvd.init()
hvd.allreduce(np.ones(3), name="x")
# Left pending on purpose: only this rank submits it, and nobody calls shutdown().
h = hvd.allreduce_async(np.ones(3), name="orphan.%d" % hvd.rank())
with open("/proc/self/maps") as maps:  # MPI's and horolite's shared memory, to be gone after
    mapped = sorted({l.split()[-1] for l in maps if "/dev/shm/" in l and "(deleted)" not in l})
with open(os.path.join(sys.argv[1], "left.%d" % hvd.rank()), "w") as out:
    out.write(" ".join(mapped))
"""


@pytest.mark.parametrize("np_", [1, 3])
def test_interpreter_exit_without_shutdown_is_clean(np_, tmp_path):
    import subprocess
    import sys
    from mpirun import mpirun_command
    proc = subprocess.run(mpirun_command(np_) + [sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(f"left.{r}" for r in range(np_))
    # /dev/shm is left clean: nothing the ranks had mapped there is still linked
    mapped = {p for r in range(np_) for p in (tmp_path / f"left.{r}").read_text().split()}
    assert mapped or np_ == 1, "the ranks mapped nothing from /dev/shm: nothing was checked"
    assert not [p for p in mapped if os.path.exists(p)], mapped


@pytest.mark.parametrize("np_", RANK_COUNTS)
def test_adasum(np_):
    # np 3: Horovod's refusal of a count that is not a power of two, on every rank
    run_pytest_file(os.path.join(PARALLEL, "test_adasum.py"), np_,
                    pytest_args=["-k", "refused"] if np_ & (np_ - 1) else [])


@pytest.mark.parametrize("np_", RANK_COUNTS)
def test_shared_memory(np_):
    # Each rank builds every rank's inputs for its NumPy reference: the dtype x op x mode
    # matrices cost np^2. At np 3 and 4 they run for the float32, bfloat16 and int8 kernels
    # only (every dtype ran at np 2; the board's slots and modes are the same for all).
    args = ["-k", "not (test_matches_numpy or test_large_results or test_members_are_read) "
                  "or float32 or bfloat16 or int8"] if np_ >= 3 else []
    run_pytest_file(os.path.join(PARALLEL, "test_shared_memory.py"), np_, pytest_args=args)


@pytest.mark.parametrize("np_,variant", [(n, "default") for n in RANK_COUNTS] + [(3, "mpi-ring")])
def test_quorum(np_, variant):
    run_pytest_file(os.path.join(PARALLEL, "test_quorum.py"), np_, VARIANTS[variant])


@pytest.mark.parametrize("np_,variant", [(n, "default") for n in RANK_COUNTS]
                         + [(n, "mpi-ring") for n in (3, 5)])
def test_process_sets(np_, variant):
    # (np 5: sets of 3 and 4 ranks that are not the whole job; mpi-ring: each set's
    # collectives over the MPI ring, the path sets that span hosts take)
    run_pytest_file(os.path.join(PARALLEL, "test_process_sets.py"), np_, VARIANTS[variant])


SET_FAILURE_SCRIPT = """
import os, sys, time
import numpy as np
import horolite as hvd
pair = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[pair])
r = hvd.rank()
hvd.allreduce(np.ones(2), name="warm")
hvd.allreduce(np.ones(2), name="warm", process_set=pair) if r < 2 else None
with open("/proc/self/maps") as maps, open(os.path.join(sys.argv[1], "shm.%d" % r), "w") as out:
    out.write(" ".join(sorted({l.split()[-1] for l in maps if "/dev/shm/" in l
                                and "(deleted)" not in l})))
open(os.path.join(sys.argv[1], "ready.%d" % r), "w").close()
if r == 2:  # once ranks 0 and 1 are past the set's warm-up (its failure would be outside try)
    while not all(os.path.exists(os.path.join(sys.argv[1], "ready.%d" % q)) for q in (0, 1)):
        time.sleep(0.01)
    raise RuntimeError("bad batch")
try:
    if r == 0:  # rank 1 never submits it: only rank 2's failure can end this wait
        time.sleep(float(sys.argv[2]))  # (long enough: submitted after the failure is known)
        hvd.allreduce(np.ones(2), name="pending", process_set=pair)
    else:  # rank 2 never submits it
        hvd.allreduce(np.ones(2), name="never")
except Exception as e:
    if r == 0:  # a handler that takes its time (a checkpoint, say) still runs to its end
        time.sleep(1.0)
    open(os.path.join(sys.argv[1], "rank.%d" % r), "w").write("%s: %s" % (type(e).__name__, e))
    raise
"""


@pytest.mark.parametrize("late", [0.0, 1.0], ids=["pending", "submitted-after"])
def test_a_failure_outside_a_process_set_fails_its_pending_collectives(tmp_path, late):
    """Whether the set's collective waits when the failure comes, or is submitted after
    it, its error names the set, the tensor and the rank that failed."""
    import subprocess
    import sys
    from mpirun import mpirun_command
    proc = subprocess.run(mpirun_command(3) + [sys.executable, "-c", SET_FAILURE_SCRIPT,
                                               str(tmp_path), str(late)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    for r in range(3):  # a rank that ends this way leaves MPI's segments behind: remove them
        listed = tmp_path / f"shm.{r}"
        for path in (listed.read_text().split() if listed.exists() else ()):
            if os.path.exists(path):
                os.remove(path)
    assert proc.returncode != 0
    told = {r: tmp_path / f"rank.{r}" for r in (0, 1)}
    assert all(path.exists() for path in told.values()), proc.stdout + proc.stderr
    seen = told[0].read_text()
    assert seen.startswith("HorovodInternalError: process set 1 (job ranks [0, 1])"), seen
    assert "tensor 'pending'" in seen and "rank 2" in seen and "bad batch" in seen, seen
    seen = told[1].read_text()
    assert "tensor 'never'" in seen and "rank 2" in seen and "bad batch" in seen, seen


@pytest.mark.parametrize("np_", RANK_COUNTS)
def test_ring_pieces(np_):
    run_pytest_file(os.path.join(PARALLEL, "test_ring_pieces.py"), np_)


# Pretend hosts (HOROLITE_TEST_HOST_IDENTITY, horolite/core/hosts.py): ranks of this machine
# look like hosts of these sizes, so the default multi-host path runs here: hierarchical
# collectives where hosts hold several ranks each (2+2), the flat MPI ring with no shared
# memory elsewhere. The runtime's whole matrix runs on each (test_collectives.py checks the
# path each layout must take), and the hierarchical pieces where they apply. (Two hosts of
# one rank each: test_runtime_over_tcp and test_collectives_over_mpi_across_hosts; an
# uneven layout whose first host holds one rank: 1+3.)
LAYOUTS = ["2+1", "1+3", "2+2", "1+1+1+1"]


def ranks_of(layout):
    return sum(int(n) for n in layout.split("+"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pretend_hosts_collectives(layout):
    run_pytest_file(os.path.join(PARALLEL, "test_collectives.py"), ranks_of(layout),
                    {"HOROLITE_TEST_HOST_IDENTITY": layout})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pretend_hosts_hierarchical_pieces(layout):
    run_pytest_file(os.path.join(PARALLEL, "test_ring_pieces.py"), ranks_of(layout),
                    {"HOROLITE_TEST_HOST_IDENTITY": layout}, pytest_args=["-k", "hierarchical"])


@pytest.mark.parametrize("layout", ["2+2", "1+3"])
def test_pretend_hosts_process_sets(layout):
    run_pytest_file(os.path.join(PARALLEL, "test_process_sets.py"), ranks_of(layout),
                    {"HOROLITE_TEST_HOST_IDENTITY": layout})


@pytest.mark.parametrize("np_,variant", [(n, "default") for n in RANK_COUNTS] + [(3, "mpi-ring")])
def test_small_collectives(np_, variant):
    # (mpi-ring: no shared memory, so no board: neither carried nor on the caller's turn;
    # one rank has nobody to share a board with)
    board = "1" if variant == "default" and np_ > 1 else "0"
    run_pytest_file(os.path.join(PARALLEL, "test_small_collectives.py"), np_,
                    dict(VARIANTS[variant], HOROLITE_TEST_EXPECT_BOARD=board))


@pytest.mark.parametrize("np_,variant", [(n, "default") for n in RANK_COUNTS] + [(3, "mpi-ring")]
                         + [(n, "pretend-hosts") for n in (2, 4)])
def test_gradient_buckets(np_, variant):
    # (pretend hosts: buckets and the exchange lane as across hosts, by default)
    env = ({"HOROLITE_TEST_HOST_IDENTITY": "1+1" if np_ == 2 else "2+2"}
           if variant == "pretend-hosts" else VARIANTS[variant])
    run_pytest_file(os.path.join(PARALLEL, "test_buckets.py"), np_, env)


# The straggler record: a short window (2 s) so a phase of a few seconds fills it.
STRAGGLERS = {"HOROLITE_STRAGGLER_REPORT_SECONDS": "2"}


# (over the MPI ring rather than shared memory: the pretend hosts' layouts below)
@pytest.mark.parametrize("np_,variant", [(n, "default") for n in RANK_COUNTS])
def test_stragglers(np_, variant):
    run_pytest_file(os.path.join(PARALLEL, "test_stragglers.py"), np_,
                    dict(VARIANTS[variant], **STRAGGLERS))


@pytest.mark.parametrize("layout", ["2+2"])  # (uneven layouts: the collectives at 1+3)
def test_pretend_hosts_stragglers(layout):
    run_pytest_file(os.path.join(PARALLEL, "test_stragglers.py"), ranks_of(layout),
                    dict(STRAGGLERS, HOROLITE_TEST_HOST_IDENTITY=layout))


# horolite's own TCP connections between hosts (transport/tcp.py), on pretend hosts over
# loopback: the transport's own tests, then the runtime's over it (the default across
# pretend hosts too), and the matrix over MPI's messages across them (the other choice).
TCP_LAYOUTS = {2: "1+1", 3: "1+1+1", 4: "2+2"}


def tcp_env(layout):
    return {"HOROLITE_TEST_HOST_IDENTITY": layout, "HOROLITE_CROSS_HOST_TRANSPORT": "tcp"}


# (np 4 at 2+1+1 only: it has a host of two ranks as 2+2 does, and an uneven ring)
@pytest.mark.parametrize("np_,layout", [(2, "1+1"), (3, "1+1+1"), (4, "2+1+1")])
def test_tcp_link(np_, layout):
    run_pytest_file(os.path.join(PARALLEL, "test_tcp_link.py"), np_,
                    {"HOROLITE_TEST_HOST_IDENTITY": layout})


@pytest.mark.parametrize("np_", [3, 4])  # (1+1: the flat ring over MPI, as 1+1+1 and mpi-ring)
def test_collectives_over_mpi_across_hosts(np_):
    run_pytest_file(os.path.join(PARALLEL, "test_collectives.py"), np_,
                    dict(tcp_env(TCP_LAYOUTS[np_]), HOROLITE_CROSS_HOST_TRANSPORT="mpi"))


@pytest.mark.parametrize("np_,test", [(2, "test_exchange_lane.py"), (4, "test_exchange_lane.py"),
                                      (3, "test_errors.py"), (3, "test_lifecycle.py")])
def test_runtime_over_tcp(np_, test):
    run_pytest_file(os.path.join(PARALLEL, test), np_, tcp_env(TCP_LAYOUTS[np_]))


TRANSPORT_SCRIPT = """
import os, sys
import horolite as hvd
from horolite.runtime import registry
hvd.init()
with open(os.path.join(sys.argv[1], "tcp.%d" % hvd.rank()), "w") as out:
    out.write(str(registry.current().transport.cross_host is not None))
"""


@pytest.mark.parametrize("env,on,why", [
    ({}, False, None),
    ({"HOROLITE_TEST_HOST_IDENTITY": "1+1"}, True, "horolite's TCP connections: no RDMA device"),
    ({"HOROLITE_TEST_HOST_IDENTITY": "1+1", "HOROLITE_CROSS_HOST_TRANSPORT": "mpi"}, False,
     "over MPI: HOROLITE_CROSS_HOST_TRANSPORT=mpi"),
    ({"HOROLITE_TEST_HOST_IDENTITY": "1+1", "HOROVOD_CROSS_HOST_TRANSPORT": "tcp"}, True,
     "horolite's TCP connections: HOROLITE_CROSS_HOST_TRANSPORT=tcp")])
def test_the_cross_host_transport_is_chosen_and_said(env, on, why, tmp_path):
    """`auto` (the default): horolite's connections across (pretend) hosts with no RDMA
    device; `mpi` keeps MPI; the choice and why logged once by rank 0; never on one host;
    HOROVOD_ spelling accepted."""
    import subprocess
    import sys
    from mpirun import mpirun_command
    proc = subprocess.run(mpirun_command(2) + [sys.executable, "-c", TRANSPORT_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, HOROLITE_LOG_LEVEL="INFO", **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"tcp.{r}").read_text() for r in range(2)] == [str(on)] * 2
    said = [line for line in proc.stderr.splitlines() if "across hosts the rings' pieces" in line]
    if why is None:
        assert not said
    else:
        assert len(said) == 1 and why in said[0], said
