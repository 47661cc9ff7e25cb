"""GPUs on Ray: each worker of a node sees all of that node's workers' GPUs, in local-rank
order, so ``gpus[hvd.local_rank()]`` and horolite's own device choice pick each rank's
own. Node b of the suite's cluster says it has 2 GPUs (Ray gives their ids; none is
needed): RayExecutor fixed and elastic, each with 2 workers there (Ray Train's: in
test_ray_train.py's fit)."""
import os

import pytest

ray = pytest.importorskip("ray")

from horolite.ray import RayExecutor  # noqa: E402
from horolite.ray.gpus import shared_gpus  # noqa: E402
from horolite.ray.layout import NodeInfo, place  # noqa: E402


def what_a_rank_sees(_=None):
    """This rank's view: its local rank, what it sees, what Ray gave it, and the
    device horolite picks among what it sees (the rule of horolite/core/device.py)."""
    import horolite as hvd
    from horolite.core.device import device_for_rank
    hvd.init()
    visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    import ray as ray_
    return {"local_rank": hvd.local_rank(), "visible": visible,
            "own": [str(g) for g in ray_.get_gpu_ids()],
            "horolite_picks": visible[device_for_rank(hvd.local_rank(), len(visible))]}


def check_each_rank_picks_its_own(seen):
    assert sorted(s["local_rank"] for s in seen) == [0, 1], seen
    owns = [s["own"] for s in sorted(seen, key=lambda s: s["local_rank"])]
    assert sorted(o[0] for o in owns) == ["0", "1"], seen  # one GPU each, both of node b's
    for s in seen:
        assert s["visible"] == [o[0] for o in owns], seen  # all, in local-rank order
        assert s["visible"][s["local_rank"]] == s["own"][0], seen  # gpus[hvd.local_rank()]
        assert s["horolite_picks"] == s["own"][0], seen


def test_a_worker_sees_its_machines_gpus_in_local_rank_order():
    assert shared_gpus([], [[], []], 1) == {}
    assert shared_gpus(["3"], [["5"], ["3"]], 1) == {"CUDA_VISIBLE_DEVICES": "5,3"}
    # two GPUs each: the local rank alone would not find its own; horolite is told
    assert shared_gpus(["2", "3"], [["0", "1"], ["2", "3"]], 1) == {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3", "HOROLITE_GPU_DEVICE": "2",
        "HOROVOD_GPU_DEVICE": "2"}
    assert "HOROLITE_GPU_DEVICE" not in shared_gpus(["2", "3"], [["0", "1"], ["2", "3"]], 1,
                                                    pick=False)
    # an elastic worker (-1): always named, whatever its local rank becomes
    assert shared_gpus(["1"], [["0"], ["1"]], -1)["HOROLITE_GPU_DEVICE"] == "1"
    # place(): machines apart, each in its local-rank order (Ray's ids in any order)
    nodes = [NodeInfo(f"{m}{i:040x}", "198.18.0.1", m, 10 + i, ids)
             for i, (m, ids) in enumerate([("a", ("1",)), ("b", ("0",)), ("a", ("0",))])]
    placed = place(nodes, ("h", 1), bytes(32), 30.0)
    assert [(p.worker, p.env["HOROLITE_LOCAL_RANK"], p.env["CUDA_VISIBLE_DEVICES"])
            for p in placed] == [(0, "0", "1,0"), (2, "1", "1,0"), (1, "0", "0")]
    assert "HOROLITE_JOB_KEY" not in repr(placed)


def test_the_executors_workers_share_their_nodes_gpus(ray_cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2,
                           use_gpu=True)
    executor.start()
    try:
        check_each_rank_picks_its_own(executor.execute(what_a_rank_sees))
    finally:
        executor.shutdown()


def elastic_sees():
    seen = what_a_rank_sees()
    import horolite as hvd
    hvd.allreduce(float(hvd.rank()), name="x")  # (the world formed)
    return seen


def test_an_elastic_executors_workers_share_their_nodes_gpus(ray_cluster, monkeypatch):
    """Also: the driver is taken for a Ray Client (outside the cluster), so the job's
    rendezvous runs in an actor there; none is served in this process."""
    import ray.util.client
    from horolite.world import rendezvous
    monkeypatch.setattr(ray.util.client.ray, "is_connected", lambda: True)

    def not_here(*args, **kwargs):
        raise AssertionError("a rendezvous served in the driver")
    monkeypatch.setattr(rendezvous, "RendezvousServer", not_here)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2,
                           max_workers=2, use_gpu=True)
    executor.start()
    try:
        check_each_rank_picks_its_own(executor.run(elastic_sees))
    finally:
        executor.shutdown()
