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
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    started = time.monotonic()
    try:
        executor.start()
        took = time.monotonic() - started
        sums = executor.run(summed)
    finally:
        executor.shutdown()
    # More workers than the trial's bundles hold: a clear error, not a silent wait.
    executor = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=3),
                           num_workers=3)
    error = ""
    try:
        executor.start()
    except TimeoutError as e:
        error = str(e)
    finally:
        executor.shutdown()
    tune.report({"sums": sums, "start_s": took, "error": error})


def test_a_tune_trial_starts_a_ray_executor_in_its_placement_group(ray_cluster, tmp_path):
    # The trainable in bundle 0, with room for 2 workers beside it (capture on, as Tune does).
    resources = tune.PlacementGroupFactory([{"CPU": 1}] + [{"CPU": 1}] * 2)
    tuner = tune.Tuner(tune.with_resources(trial, resources),
                       # (a start() that waits for ever ends the trial, not the test run)
                       tune_config=tune.TuneConfig(time_budget_s=120),
                       run_config=tune.RunConfig(storage_path=str(tmp_path), name="t",
                                                 verbose=0))
    results = tuner.fit()
    assert not results.errors, results.errors
    got = results[0].metrics
    assert got.get("sums") == [3.0, 3.0], f"the trial reported: {got}"
    assert re.match(  # (how many started by then depends on the load)
        r"[0-2] of 3 workers \(\{'CPU': 1\} each\) started within 3 s "
        r"\(placement_group_timeout_s\) in the placement group this driver runs in "
        r"\(\[\{'CPU': 1.0\}, \{'CPU': 1.0\}, \{'CPU': 1.0\}\]\): Ray has \{.*'CPU': ",
        got["error"]), got


def train_loop(config):
    import horolite as hvd
    hvd.init()
    got = float(hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="t")[0])
    with open(f"{config['out']}/rank.{hvd.rank()}", "w") as f:
        f.write(f"{hvd.size()} {got}")


def train_trial(config):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from horolite.ray import HorovodConfig
    DataParallelTrainer(train_loop, train_loop_config=config,
                        backend_config=HorovodConfig(timeout_s=60),
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(storage_path=config["out"], name="inner")).fit()
    tune.report({"done": 1})


def test_a_tune_trial_runs_ray_train_with_horolite(ray_cluster, tmp_path):
    """Ray Train inside a Tune trial (Ray Train V2's way to tune a trainer): the trial
    holds a sliver of a CPU, the trainer's workers their own resources."""
    tuner = tune.Tuner(tune.with_resources(train_trial, {"cpu": 0.01}),
                       param_space={"out": str(tmp_path)},
                       tune_config=tune.TuneConfig(time_budget_s=120),
                       run_config=tune.RunConfig(storage_path=str(tmp_path), name="t",
                                                 verbose=0))
    results = tuner.fit()
    assert not results.errors, results.errors
    # rank 0 contributed 1, rank 1 contributed 2: NumPy's sum on each of the 2 ranks
    for r in range(2):
        assert (tmp_path / f"rank.{r}").read_text() == f"2 {1.0 + 2.0}", r
