"""Process sets: every collective over a subset of ranks, against NumPy references
from each rank's known inputs; disjoint and overlapping sets, dynamic add/remove,
sets submitted in different orders on different ranks, errors that name the set."""
import os
import re

import numpy as np
import pytest

import horolite as hvd
from horolite.api import process_sets as ps_mod

os.environ["HOROLITE_DYNAMIC_PROCESS_SETS"] = "1"  # add/remove below; the list works as well

SIZE_HINT = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE",
                                                         os.environ.get("HOROLITE_SIZE", "1"))))
# Sets of 1 to 4 ranks (4: at np 5), contiguous or not: "spread" is 3 ranks with a gap.
SPECS = {"even": list(range(0, SIZE_HINT, 2)), "odd": list(range(1, SIZE_HINT, 2)),
         "low": [0, 1], "high": list(range(1, SIZE_HINT)), "spread": [0, 2, 3]}
SETS = {}
_by_ranks = {}
for _name, _ranks in SPECS.items():
    if not _ranks or max(_ranks) >= SIZE_HINT or _ranks == list(range(SIZE_HINT)):
        continue  # empty, beyond the job, or the global set itself
    SETS[_name] = _by_ranks.setdefault(tuple(_ranks), hvd.ProcessSet(_ranks))
if SIZE_HINT >= 4 and "HOROLITE_RANK" not in os.environ:  # a set made from an mpi4py
    # communicator (an MPI job's only: horolite-run --gloo starts no MPI): job ranks 0 and 3
    from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
    _world = MPI.COMM_WORLD.Get_rank()
    SETS["comm"] = _by_ranks[(0, 3)] = hvd.ProcessSet(
        MPI.COMM_WORLD.Split(0 if _world in (0, 3) else MPI.UNDEFINED, _world))
hvd.init(process_sets=list(_by_ranks.values()))
RANK, SIZE = hvd.rank(), hvd.size()
assert SIZE == SIZE_HINT
MINE = [(n, s) for n, s in sorted(SETS.items()) if RANK in s.ranks]
multi = pytest.mark.skipif(SIZE < 3, reason="a subset of two ranks needs a third outside it")


def data(rank, shape, key):
    """Rank `rank`'s input for `key`: known on every rank, so references need no MPI."""
    seed = (rank + 1) * 7919 + sum(map(ord, key))
    return np.random.default_rng(seed).standard_normal(shape)


def test_a_set_from_a_communicator_learns_its_ranks():
    if "HOROLITE_RANK" in os.environ:
        pytest.skip("an mpi4py communicator needs a job MPI started")
    if "comm" not in SETS:
        pytest.skip("needs 4 ranks")
    assert SETS["comm"].ranks == [0, 3] and SETS["comm"].mpi_comm is not None


def test_set_queries():
    table = ps_mod.get_process_set_ids_and_ranks()
    assert table[0] == list(range(SIZE)) == hvd.global_process_set.ranks
    assert hvd.global_process_set.size() == SIZE and hvd.global_process_set.rank() == RANK
    ids = {s.process_set_id for s in SETS.values()}
    assert 0 not in ids and None not in ids and len(ids) == len(_by_ranks)
    for name, s in SETS.items():
        assert table[s.process_set_id] == s.ranks
        assert s.size() == len(s.ranks)
        assert s.included() == (RANK in s.ranks)
        if RANK in s.ranks:
            assert s.rank() == s.ranks.index(RANK)
        else:
            with pytest.raises(ValueError, match="not part of provided process set"):
                s.rank()
    assert hvd.ProcessSet([2, 0]).ranks == [0, 2] and hvd.ProcessSet([2, 0]).size() is None


@pytest.mark.parametrize("name", sorted(SETS) or ["(none)"])
def test_every_collective(name):
    if name not in SETS:  # one rank: the global set is the only set there is
        pytest.skip("a set other than the global one needs at least two ranks")
    s = SETS[name]
    if RANK not in s.ranks:
        pytest.skip("not a member")
    members, me, n = s.ranks, s.ranks.index(RANK), len(s.ranks)
    key = f"{name}.{s.process_set_id}"
    got = hvd.allreduce(data(RANK, (5, 3), key), op=hvd.Sum, name=f"ar.{key}", process_set=s)
    np.testing.assert_allclose(got, sum(data(r, (5, 3), key) for r in members))
    got = hvd.allreduce(data(RANK, 4, key), process_set=s)  # Average, a generated name
    np.testing.assert_allclose(got, sum(data(r, 4, key) for r in members) / n)
    a, b = hvd.grouped_allreduce([data(RANK, 3, key + "a"), data(RANK, (2, 2), key + "b")],
                                 op=hvd.Sum, name=f"gar.{key}", process_set=s)
    np.testing.assert_allclose(a, sum(data(r, 3, key + "a") for r in members))
    np.testing.assert_allclose(b, sum(data(r, (2, 2), key + "b") for r in members))
    # allgather: rows differ per rank; results in set-rank order
    got = hvd.allgather(data(RANK, (RANK + 1, 2), key), name=f"ag.{key}", process_set=s)
    np.testing.assert_allclose(got, np.concatenate([data(r, (r + 1, 2), key) for r in members]))
    g1, g2 = hvd.grouped_allgather([np.full(2, RANK), np.full((1, 3), -RANK)], process_set=s)
    assert g1.tolist() == [r for r in members for _ in range(2)]
    assert g2.tolist() == [[-r] * 3 for r in members]
    # broadcast: root_rank is a job rank, as in Horovod
    root = members[-1]
    got = hvd.broadcast(data(RANK, 6, key), root_rank=root, name=f"bc.{key}", process_set=s)
    np.testing.assert_allclose(got, data(root, 6, key))
    # alltoall: row d goes to set rank d
    send = np.array([100 * RANK + d for d in range(n) for _ in range(2)], np.int64)
    got = hvd.alltoall(send, name=f"a2a.{key}", process_set=s)
    assert got.tolist() == [100 * r + me for r in members for _ in range(2)]
    splits = [d + 1 for d in range(n)]
    send = np.concatenate([np.full(d + 1, 10 * RANK + d) for d in range(n)])
    got, received = hvd.alltoall(send, splits=splits, name=f"a2s.{key}", process_set=s)
    assert received.tolist() == [me + 1] * n
    assert got.tolist() == [10 * r + me for r in members for _ in range(me + 1)]
    # reducescatter: set rank r keeps the r-th part
    full = sum(data(r, (2 * n, 3), key) for r in members)
    got = hvd.reducescatter(data(RANK, (2 * n, 3), key), op=hvd.Sum, name=f"rs.{key}",
                            process_set=s)
    np.testing.assert_allclose(got, full[2 * me:2 * me + 2])
    (got,) = hvd.grouped_reducescatter([data(RANK, (2 * n, 3), key)], op=hvd.Average,
                                       process_set=s)
    np.testing.assert_allclose(got, full[2 * me:2 * me + 2] / n)
    handle = hvd.allreduce_async(np.full(2, 1.0), op=hvd.Sum, name=f"async.{key}", process_set=s)
    hvd.barrier(process_set=s)
    np.testing.assert_allclose(hvd.synchronize(handle), np.full(2, float(n)))


def test_non_member_gets_an_error_naming_the_set():
    for name, s in sorted(SETS.items()):
        if RANK in s.ranks:
            continue
        with pytest.raises(hvd.InvalidCollectiveError,
                           match=re.escape(f"allreduce: rank {RANK} is not a member of process "
                                           f"set {s.process_set_id} (job ranks {s.ranks})")):
            hvd.allreduce(np.ones(2), name="outsider", process_set=s)
        with pytest.raises(hvd.InvalidCollectiveError, match=f"process set {s.process_set_id}"):
            hvd.barrier(process_set=s)
    unregistered = hvd.ProcessSet([0])
    with pytest.raises(hvd.InvalidCollectiveError, match="not registered"):
        hvd.allgather(np.ones(1), process_set=unregistered)
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.outsider"),
                               np.full(2, float(SIZE)))


@multi
def test_broadcast_root_outside_the_set():
    s = SETS["low"]
    if RANK not in s.ranks:
        pytest.skip("not a member")
    with pytest.raises(hvd.InvalidCollectiveError, match=r"root_rank 2 is not a member of process set"):
        hvd.broadcast(np.ones(1), root_rank=2, process_set=s)


@multi
def test_sets_submitted_in_different_orders_do_not_deadlock():
    # Rank 0 submits low's tensor, then the global one; rank 1 the other way round.
    low = SETS["low"]
    handles = {}
    order = ["low", "global"] if RANK == 0 else ["global", "low"]
    for which in order:
        if which == "low" and RANK in low.ranks:
            handles[which] = hvd.allreduce_async(np.full(3, RANK + 1.0), op=hvd.Sum, name="order",
                                                 process_set=low)
        elif which == "global":
            handles[which] = hvd.allreduce_async(np.full(3, RANK + 1.0), op=hvd.Sum, name="order")
    np.testing.assert_allclose(handles["global"].result(timeout=60), np.full(3, SIZE * (SIZE + 1) / 2))
    if "low" in handles:
        np.testing.assert_allclose(handles["low"].result(timeout=60), np.full(3, 3.0))
    # Two overlapping subsets, in opposite orders on the rank they share.
    even, high = SETS["even"], SETS["high"]
    mine = [s for s in ([even, high] if RANK % 4 == 2 else [high, even]) if RANK in s.ranks]
    hs = [(s, hvd.allgather_async(np.array([RANK]), name="both", process_set=s)) for s in mine]
    for s, h in hs:
        assert h.result(timeout=60).tolist() == s.ranks


@multi
def test_each_set_has_its_own_shared_memory():
    # A set whose members share a host has its control exchange and its allreduce in
    # regions of its own, shared only by its members (control_board.py,
    # shared_memory.py), so a rank's sets run at once without waiting on each other's
    # rounds; other sets (across hosts, or shared memory off) go over MPI.
    off = os.environ.get("HOROLITE_SHARED_MEMORY", "1").lower() in ("0", "false")
    seen = {ps_mod.runtime_for(hvd.global_process_set, "allreduce").queue.wake.address}
    mine = {id(s): (name, s) for name, s in MINE}.values()  # two names may share a set
    handles = []
    for name, s in mine:
        rt = ps_mod.runtime_for(s, "allreduce")
        if off or len(s.ranks) == 1 or rt.topology.local_size != len(s.ranks):
            assert rt.transport.board is None and rt.transport.shared_memory is None
        else:
            assert rt.transport.board.size == rt.transport.shared_memory.size == len(s.ranks)
            assert rt.queue.wake.address not in seen
            seen.add(rt.queue.wake.address)
        handles.append((name, s, hvd.allreduce_async(data(RANK, (300,), "own" + name),
                                                     op=hvd.Sum, name="own", process_set=s)))
    for name, s, h in handles:
        np.testing.assert_allclose(h.result(timeout=60),
                                   sum(data(r, (300,), "own" + name) for r in s.ranks))


@multi
def test_mismatch_names_the_set_and_job_ranks_and_the_set_keeps_working():
    s = SETS["high"]  # job ranks 1.., numbered 0.. within the set
    if RANK not in s.ranks:
        pytest.skip("not a member")
    with pytest.raises(hvd.TensorMismatchError) as info:
        hvd.allreduce(np.ones(1 + RANK), name="ps.mm", process_set=s)
    shapes = ", ".join(f"rank {r} had ({1 + r},)" for r in s.ranks)
    assert str(info.value) == (f"process set {s.process_set_id} (job ranks {s.ranks}): "
                               f"tensor 'ps.mm': mismatched shape: {shapes}")
    got = hvd.allreduce(np.full(2, RANK + 1.0), op=hvd.Sum, name="ps.mm.after", process_set=s)
    np.testing.assert_allclose(got, np.full(2, float(sum(r + 1 for r in s.ranks))))


def test_dynamic_add_and_remove():
    table = ps_mod.get_process_set_ids_and_ranks()
    candidates = [[0, SIZE - 1], [SIZE - 1], [0]]
    fresh = next((c for c in candidates if sorted(set(c)) not in table.values()), None)
    if fresh is None:  # one rank: every set is the global one
        with pytest.raises(ValueError, match="duplicate process set"):
            hvd.add_process_set([0])
        assert hvd.remove_process_set(hvd.global_process_set) is False
        return
    with pytest.raises(ValueError, match="differs by rank"):
        hvd.add_process_set([0] if RANK == 0 else [SIZE - 1])
    added = hvd.add_process_set(fresh)
    assert added.process_set_id not in table and added.size() == len(set(fresh))
    assert ps_mod.get_process_set_ids_and_ranks()[added.process_set_id] == sorted(set(fresh))
    if RANK in added.ranks:
        got = hvd.allreduce(np.full(2, RANK), op=hvd.Sum, name="dyn", process_set=added)
        assert got.tolist() == [sum(added.ranks)] * 2
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set(hvd.ProcessSet(fresh))
    old_id = added.process_set_id
    assert hvd.remove_process_set(added) is True
    assert added.process_set_id is None and added.size() is None
    assert old_id not in ps_mod.get_process_set_ids_and_ranks()
    assert hvd.remove_process_set(added) is False
    assert hvd.remove_process_set(hvd.global_process_set) is False
    with pytest.raises(hvd.InvalidCollectiveError, match="not registered"):
        hvd.allreduce(np.ones(1), process_set=added)
    again = hvd.add_process_set(fresh)  # the same ranks may come back
    if RANK in again.ranks:
        hvd.barrier(process_set=again)
    assert hvd.remove_process_set(again) is True
    np.testing.assert_allclose(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.dyn"), [SIZE])


def test_add_needs_dynamic(monkeypatch):
    monkeypatch.setattr(ps_mod, "_dynamic", False)
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])
    registered = hvd.ProcessSet([0])
    registered.process_set_id = 99
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.remove_process_set(registered)
    assert registered.process_set_id is None  # Horovod forgets the id before it asks
    # a set without an id, or the global one, is False at once, as in Horovod
    assert hvd.remove_process_set(hvd.ProcessSet([0])) is False
    assert hvd.remove_process_set(hvd.global_process_set) is False


def test_init_again_binds_registered_sets_and_refuses_new_ones(monkeypatch):
    # While initialized, init() starts nothing; its process_sets must be registered ones.
    same = [hvd.ProcessSet(s.ranks) for s in SETS.values()]
    hvd.init(process_sets=same)
    assert [s.process_set_id for s in same] == [s.process_set_id for s in SETS.values()]
    if same:
        assert same[0].size() == len(same[0].ranks)
    table = ps_mod.get_process_set_ids_and_ranks()
    fresh = next((c for c in ([0, SIZE - 1], [SIZE - 1], [0]) if sorted(set(c)) not in table.values()),
                 None)
    if fresh is not None:
        with pytest.raises(ValueError, match=r"already initialized .*call shutdown\(\) first"):
            hvd.init(process_sets=[hvd.ProcessSet(fresh)])
        assert ps_mod.get_process_set_ids_and_ranks() == table
    monkeypatch.setattr(ps_mod, "_dynamic", False)
    with pytest.raises(ValueError, match="without dynamic process sets"):
        hvd.init(process_sets="dynamic")
    np.testing.assert_allclose(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.reinit"), [SIZE])


def test_set_collectives_reach_the_timeline_and_follow_the_global_setting(tmp_path_factory):
    # One timeline per process (the global set's), rows of a set named "process set N/...";
    # a set runs with the global set's current fusion threshold and cycle time, as the
    # autotuner would set them.
    from horolite.api import basics
    from horolite.core.timeline import read_events
    leader = basics.runtime()
    path = os.path.join(str(tmp_path_factory.getbasetemp()), "sets_timeline.json")
    from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
    path = MPI.COMM_WORLD.bcast(path, 0)
    hvd.start_timeline(path, mark_cycles=False)
    saved = leader._setting
    leader._setting = (1 << 20, 2.0)  # what rank 0's autotuner would publish
    hvd.allreduce(np.ones(2), name="tl.global")
    for name, s in MINE:
        for i in range(2):
            hvd.allreduce(np.ones(3), name=f"tl.{name}.{i}", process_set=s)
        rt = ps_mod.runtime_for(s, "test")
        assert (rt.executor.fusion_threshold, round(rt._cycle_seconds * 1000, 6)) == (1 << 20, 2.0)
    # Every rank done checking before rank 0 publishes the old setting again (a set whose
    # first rank is another would otherwise pick it up mid-check): mpi4py's barrier.
    MPI.COMM_WORLD.Barrier()
    leader._setting = saved
    hvd.barrier()
    hvd.stop_timeline()
    events = read_events(path if RANK == 0 else path.replace(".json", f".rank{RANK}.json"))
    rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "tl.global" in rows
    for name, s in MINE:
        assert f"process set {s.process_set_id}/tl.{name}.0" in rows
    hvd.allreduce(np.ones(2), name="tl.after")  # the setting goes back on the next cycle
