"""RayExecutor inside a Ray Tune trial: the trial's placement group is borrowed (the
trainable holds one of its bundles), so the workers take any bundle with room; a start()
that cannot find room says so within placement_group_timeout_s."""
import re
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray import tune  # noqa: E402

from horolite.ray import RayExecutor  # noqa: E402


def summed():
    import horolite as hvd
    hvd.init()
    return float(hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="s")[0])


def trial(config):
    executor = RayExecutor(RayExecutor.create_settings(
        timeout_s=60, placement_group_timeout_s=config["wait"]),
        num_workers=config["workers"])
    started = time.monotonic()
    try:
        executor.start()
        took = time.monotonic() - started
        tune.report({"sums": executor.run(summed), "start_s": took, "error": ""})
    except TimeoutError as e:
        tune.report({"sums": [], "start_s": time.monotonic() - started, "error": str(e)})
    finally:
        executor.shutdown()


def run_trial(tmp_path, workers, wait):
    # The trainable in bundle 0, with room for 2 workers beside it (capture on, as Tune does).
    resources = tune.PlacementGroupFactory([{"CPU": 1}] + [{"CPU": 1}] * 2)
    tuner = tune.Tuner(tune.with_resources(trial, resources),
                       param_space={"workers": workers, "wait": wait},
                       # (a start() that waits for ever ends the trial, not the test run)
                       tune_config=tune.TuneConfig(time_budget_s=120),
                       run_config=tune.RunConfig(storage_path=str(tmp_path), name="t",
                                                 verbose=0))
    results = tuner.fit()
    assert not results.errors, results.errors
    assert "error" in results[0].metrics, f"the trial reported nothing: {results[0].metrics}"
    return results[0].metrics


def test_a_tune_trial_starts_a_ray_executor_in_its_placement_group(ray_cluster, tmp_path):
    got = run_trial(tmp_path, workers=2, wait=60)
    assert got["error"] == "" and got["sums"] == [3.0, 3.0], got
    # More workers than the trial's bundles hold: a clear error, not a silent wait.
    got = run_trial(tmp_path, workers=3, wait=3)
    assert got["sums"] == [] and re.match(  # (how many started by then depends on the load)
        r"[0-2] of 3 workers \(\{'CPU': 1\} each\) started within 3 s "
        r"\(placement_group_timeout_s\) in the placement group this driver runs in "
        r"\(\[\{'CPU': 1.0\}, \{'CPU': 1.0\}, \{'CPU': 1.0\}\]\): Ray has \{.*'CPU': ",
        got["error"]), got
