"""Every example runs under horolite-run on 2 ranks (the main job of the README among them)."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

pytest.importorskip("horolite.launcher")


def run_example(name, np_, *args, timeout=600, env=None, stderr=False):
    cmd = [sys.executable, "-m", "horolite.launcher", "-np", str(np_), sys.executable,
           os.path.join(EXAMPLES, name), *args]
    # Not from the checkout's root: there `horolite` is the source folder, without the launcher.
    proc = subprocess.run(cmd, cwd=EXAMPLES, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return (proc.stdout, proc.stderr) if stderr else proc.stdout


def test_numpy_logistic_regression():
    out = run_example("numpy_logistic_regression.py", 2)
    assert float(re.search(r"test accuracy=([\d.]+)", out).group(1)) > 0.95


needs_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                              reason="TensorFlow is not installed")


# What a first run must not print: AutoGraph's complaints about horolite's own functions
# (it once converted them while the native ops were built during tracing), and any warning
# or error of horolite's logger. TensorFlow's own start-up lines (oneDNN, no CUDA driver)
# are not horolite's.
NOT_ON_A_FIRST_RUN = re.compile(r"AutoGraph|report this to the TensorFlow team|do_not_convert"
                                r"|(WARNING|ERROR).*horolite|horolite.*(WARNING|ERROR)")


@needs_tf
def test_digits_same_accuracy_on_one_and_two_ranks(tmp_path):
    acc = {}
    for np_ in (1, 2):
        # The README's main job on 2 ranks, on a fresh cache: the native ops are built now.
        cache = tmp_path / f"tf_ops{np_}"
        out, err = run_example("tensorflow2_digits.py", np_, env={"HOROLITE_TF_OPS_CACHE": str(cache)},
                               stderr=True)
        assert list(cache.glob("*/horolite_ops.so")), "the native ops were not built on this run"
        printed = [line for line in (out + err).splitlines() if NOT_ON_A_FIRST_RUN.search(line)]
        assert not printed, "\n".join(printed[:20])
        acc[np_] = float(re.search(r"test accuracy: ([\d.]+)", out).group(1))
    # Same data, same global batches: only float reduction order differs (TensorFlow's own
    # kernels are not bit-reproducible run to run either), so a few of 360 test images may flip.
    assert acc[1] > 0.9 and abs(acc[1] - acc[2]) <= 0.02, acc


@needs_tf
@pytest.mark.parametrize("name", ["tensorflow1_legacy_optimizer.py", "keras_fit.py",
                                  "tensorflow2_synthetic_benchmark.py"])
def test_tensorflow_examples(name):
    out = run_example(name, 2)
    assert "[0]<stdout>:" in out
    if name == "tensorflow1_legacy_optimizer.py":  # 4 passes per update, and it learns
        rows = [(int(p), int(u), float(a)) for p, u, a in re.findall(
            r"\[0\]<stdout>:pass (\d+), update (\d+): accuracy on the shards ([\d.]+)", out)]
        assert [p for p, _, _ in rows] == [100, 200, 300], out[-3000:]
        assert all(p // 4 - 1 <= u <= p // 4 for p, u, _ in rows), rows
        assert rows[-1][2] > rows[0][2] and rows[-1][2] > 0.9, rows
    if name == "tensorflow2_synthetic_benchmark.py":  # every iteration timed, totals add up
        assert re.search(r"\[0\]<stdout>:model \w+, \d+ gradient tensors, batch \d+ per rank, "
                         r"2 ranks", out), out[-3000:]
        rates = [float(r) for r in re.findall(r"\[0\]<stdout>:iter #\d+: ([\d.]+) img/sec per rank",
                                              out)]
        mean = re.search(r"\[0\]<stdout>:img/sec per rank: ([\d.]+) \+-", out)
        total = re.search(r"\[0\]<stdout>:total img/sec on 2 rank\(s\): ([\d.]+) \+-", out)
        assert len(rates) == 3 and all(r > 0 for r in rates) and mean and total, out[-3000:]
        assert abs(float(mean.group(1)) - sum(rates) / 3) <= 0.15  # (printed to 0.1)
        assert abs(float(total.group(1)) - 2 * float(mean.group(1))) <= 0.2
    if name == "keras_fit.py":  # the resume from rank 0's checkpoint carries on training
        saved = re.search(r"test accuracy: [\d.]+ at iteration (\d+)", out)
        resumed = re.search(r"resumed from digits.keras at iteration (\d+): test accuracy: ([\d.]+)", out)
        assert saved and resumed, out[-3000:]
        # 6 epochs saved, 8 after the resume: the loaded optimizer kept its iteration count
        assert int(resumed.group(1)) * 6 == int(saved.group(1)) * 8 > 0, out[-3000:]
        assert float(resumed.group(2)) > 0.8


@needs_tf
def test_wrapper_optimizers_digits():
    out = run_example("wrapper_optimizers_digits.py", 2, "--epochs", "2", "--straggler-ms", "5")
    rows = re.findall(r"\| (\w+)\(?[^|]*\| ([\d.]+) \| ([\d.]+) \|", out)
    assert [name for name, _, _ in rows] == ["DistributedOptimizer", "ModelAverageOptimizer",
                                             "ElasticAverageOptimizer", "SyncReplicasOptimizer"], out[-3000:]
    assert all(float(acc) > 0.8 and float(sec) > 0 for _, acc, sec in rows), rows
