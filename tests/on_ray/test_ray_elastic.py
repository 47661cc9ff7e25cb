"""Elastic training on Ray (RayExecutor with min_workers/max_workers): a worker's actor
killed with SIGKILL mid-training; the survivors go on in their running processes, a new
actor joins in the freed slot, and the weights are NumPy's for the sizes each step had."""
import os
import signal
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from horolite.errors import TensorMismatchError  # noqa: E402
from horolite.ray import RayExecutor  # noqa: E402

DIM = 4


def elastic_train(marks):
    import horolite as hvd
    from horolite.elastic import ObjectState, run_fn
    from horolite.ray import ray_logger
    hvd.init()
    with open(os.path.join(marks, f"pid.{os.getpid()}"), "w") as f:
        f.write(str(hvd.rank()))
    state = ObjectState(hvd.broadcast_object, hvd.rank, step=0, w=np.zeros(DIM), sizes=[])

    @run_fn
    def loop(state):
        while True:
            sizes = state.sizes
            # Done once the world was back at its full size for 10 steps after shrinking.
            if len(sizes) >= 20 and min(sizes) < max(sizes) and sizes[-10:] == [3] * 10:
                return
            if len(sizes) > 400:
                raise RuntimeError(f"the world never grew back: {sizes[-20:]}")
            g = hvd.allreduce(np.full(DIM, state.step + hvd.rank(), dtype=np.float64),
                              name="grad")
            state.w = state.w - 0.01 * g
            state.sizes = sizes + [hvd.size()]
            state.step += 1
            open(os.path.join(marks, f"step.{state.step}"), "w").close()
            time.sleep(0.05)
            state.commit()
            ray_logger.log({"step": state.step, "size": hvd.size()})
    loop(state)
    return {"rank": hvd.rank(), "w": state.w, "sizes": state.sizes, "pid": os.getpid()}


def numpy_weights(sizes):
    w = np.zeros(DIM)
    for step, n in enumerate(sizes):
        w = w - 0.01 * np.full(DIM, step + (n - 1) / 2.0)  # the mean of step + rank
    return w


def test_a_killed_actor_is_replaced_while_the_survivors_go_on(ray_cluster, tmp_path):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2,
                           max_workers=3, cpus_per_worker=1)
    executor.start()
    killed = []

    def kill_one():
        deadline = time.monotonic() + 120
        while not (tmp_path / "step.5").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        victims = sorted(p.name for p in tmp_path.glob("pid.*")
                         if (tmp_path / p.name).read_text() == "1")
        pid = int(victims[0].split(".")[1])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    logged = []
    try:
        results = executor.run(elastic_train, args=[str(tmp_path)], callbacks=[logged.append])
    finally:
        executor.shutdown()
    killer.join(5)
    assert killed, "nobody was killed"
    assert [r["rank"] for r in results] == [0, 1, 2]
    sizes = results[0]["sizes"]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    assert all(r["sizes"] == sizes for r in results)
    for r in results:
        np.testing.assert_allclose(r["w"], numpy_weights(sizes), rtol=1e-12)
    # rank 0's log reached the driver through every generation (sizes 3, 2, then 3)
    assert {entry["size"] for entry in logged} == {2, 3}, logged
    assert logged[-1] == {"step": len(sizes), "size": 3}, logged[-3:]
    pids = [r["pid"] for r in results]
    assert killed[0] not in pids
    started = {int(p.name.split(".")[1]) for p in tmp_path.glob("pid.*")}
    assert len(started) == 4 and set(pids) < started  # 3 first, then 1 in the freed slot
    # Every actor of the job is gone: the cluster's CPUs are free again for the next job.
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, (ray.available_resources(), ray.cluster_resources())
        time.sleep(0.2)


def failing_train():
    import horolite as hvd
    from horolite.elastic import ObjectState, run_fn
    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, step=0)

    @run_fn
    def loop(state):
        while state.step < 1000:
            # at step 3 the ranks' shapes differ: every rank raises TensorMismatchError,
            # a HorovodInternalError that is the code's own (a ValueError), not a failure
            shape = hvd.rank() + 1 if state.step == 3 else 4
            hvd.allreduce(np.ones(shape), name="grad")
            state.step += 1
            state.commit()
            time.sleep(0.02)
    loop(state)


def test_an_error_of_the_training_code_ends_the_elastic_job_as_ray_raised_it(ray_cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2,
                           max_workers=2, elastic_timeout=60)
    executor.start()
    try:
        started = time.monotonic()
        with pytest.raises(TensorMismatchError, match="grad"):
            executor.run(failing_train)
        assert time.monotonic() - started < 30  # (not a target: no elastic_timeout wait)
        with pytest.raises(NotImplementedError, match="execute"):
            executor.execute_single(lambda w: 1)
    finally:
        executor.shutdown()
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, (ray.available_resources(), ray.cluster_resources())
        time.sleep(0.2)
