"""Ray's own failures are failures of the place a worker ran, not the training code's:
classified as horolite-run classifies errors (horolite/ray/failures.py); an elastic job
evicts such a worker, cools its node down and goes on."""
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.exceptions import (ActorDiedError, ActorUnschedulableError, NodeDiedError,  # noqa: E402
                            OutOfMemoryError, RayTaskError, RuntimeEnvSetupError)

from horolite.errors import HorovodInternalError, TensorMismatchError  # noqa: E402
from horolite.ray import RayExecutor  # noqa: E402
from horolite.ray import elastic  # noqa: E402
from horolite.ray.failures import RAY, RUNTIME, USER, classify, node_failed  # noqa: E402


def task_error(cause):
    return RayTaskError("execute", "Traceback ...", cause).as_instanceof_cause()


def test_errors_are_classified_as_horolite_run_classifies_them():
    for error in (ActorUnschedulableError("no node"), RuntimeEnvSetupError("pip failed"),
                  OutOfMemoryError("killed"), NodeDiedError("gone"), ActorDiedError()):
        assert classify(error) == RAY, error
    assert node_failed(ActorUnschedulableError("x")) and node_failed(NodeDiedError("x"))
    assert not node_failed(ActorDiedError())  # (a process killed: its node stays usable)
    assert classify(task_error(ValueError("bad batch"))) == USER
    # horolite's errors that are the code's own (bad arguments) are its own too
    assert classify(task_error(TensorMismatchError("shapes differ"))) == USER
    assert classify(task_error(HorovodInternalError("rank 1 died"))) == RUNTIME
    # what the worker marked it as (it read its runtime's state) wins
    told = ValueError("a framework's error around a peer's failure")
    told.horolite_runtime_failure = True
    assert classify(task_error(told)) == RUNTIME


class FakeActor:
    class execute:
        @staticmethod
        def remote(fn):
            return "ref"


def test_a_ray_failure_evicts_the_worker_and_is_never_the_codes_error(monkeypatch):
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (refs, []))

    def get(ref, timeout=None):
        raise ActorUnschedulableError("The node specified via NodeAffinitySchedulingStrategy "
                                      "doesn't exist any more")
    monkeypatch.setattr(ray, "get", get)
    said = []
    worker = elastic._RayWorker("w0", "198.18.0.9 node deadbeef", 0, FakeActor(), None,
                                lambda w, e: said.append(e))
    assert worker.proc.poll() == -9 and worker.failed()
    assert said == []
    assert worker.how().startswith("failed in Ray: ActorUnschedulableError: The actor is not")


GHOST = "198.18.0.9 node deadbeef"  # a node Ray lists no more: its worker is unschedulable


def two_for_a_while():
    import horolite as hvd
    from horolite.elastic import ObjectState, run_fn
    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, sizes=[])

    @run_fn
    def loop(state):
        while len(state.sizes) < 150:
            hvd.allreduce(np.ones(2), name="g")
            state.sizes = state.sizes + [hvd.size()]
            time.sleep(0.02)
            state.commit()
    loop(state)
    return hvd.rank(), state.sizes


def test_a_newcomer_ray_cannot_place_is_not_the_codes_error(ray_cluster, monkeypatch, capfd):
    """The review's case: the pool still lists a node that is gone (here a made-up one,
    from the second look on); the newcomer started there fails with Ray's
    ActorUnschedulableError. Its node is blacklisted and the job goes on."""
    found, looks = elastic.RayNodes.find, []

    def with_a_ghost(self):
        looks.append(1)
        if len(looks) < 2:
            return found(self)
        self.node_ids[GHOST] = "de" * 28
        return dict(found(self), **{GHOST: 1})
    monkeypatch.setattr(elastic.RayNodes, "find", with_a_ghost)
    # (2 CPUs a worker: one on each real node, and a free slot only on the ghost)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2,
                           max_workers=3, cpus_per_worker=2, elastic_timeout=60)
    executor.start()
    try:
        results = executor.run(two_for_a_while)
    finally:
        executor.shutdown()
    assert [rank for rank, _ in results] == [0, 1]
    assert set(results[0][1]) == {2}, results[0][1]
    err = capfd.readouterr().err
    assert f"w2 (host {GHOST}) failed in Ray: ActorUnschedulableError" in err, err[-3000:]
