"""Elastic TensorFlow jobs end to end: kill -9 of a rank, then the job resumes from the last
commit (TensorFlowState with DistributedGradientTape; Keras 3 fit with KerasState and the
three elastic callbacks) and ends with NumPy's weights on every rank."""
import os
import shutil
import sys

import numpy as np
import pytest

from elastic_util import elastic_train, generations, kill9, resumed, wait_for_steps
from launcher_util import REPO

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.skipif(
    shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    is None, reason="no mpirun installed")

TF_TRAIN = os.path.join(REPO, "tests", "launcher_rank", "elastic_tf.py")
COOLDOWN = ("--blacklist-cooldown-range", "1", "1")


def _finals(outdir, size):
    finals = [np.load(os.path.join(outdir, f"final.{r}.npy")) for r in range(size)]
    for r, w in enumerate(finals):
        assert np.array_equal(w, finals[0]), f"rank {r} differs from rank 0"
    return finals[0]


def test_tensorflow_state_with_gradient_tape_survives_kill9(start, tmp_path):
    proc = start("-np", 2, "--min-np", 2, "-H", "localhost:2", *COOLDOWN, sys.executable,
                 TF_TRAIN, tmp_path, "--mode", "tape", "--steps", 30, "--commit-every", 5)
    wait_for_steps(tmp_path, 0, 8, proc, seconds=400)
    kill9(tmp_path, 0, 0)
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-4000:]
    assert generations(tmp_path) == [0, 1]
    assert set(resumed(tmp_path, 1).values()) in ({(5, 1)}, {(10, 1)}), resumed(tmp_path, 1)
    np.testing.assert_allclose(_finals(tmp_path, 2), elastic_train.reference(30), rtol=1e-12)


def test_keras_fit_with_kerasstate_and_callbacks_resumes_at_the_committed_epoch(start, tmp_path):
    steps, epochs = 4, 6
    proc = start("-np", 2, "--min-np", 2, "-H", "localhost:2", *COOLDOWN, sys.executable,
                 TF_TRAIN, tmp_path, "--mode", "fit", "--steps", steps, "--epochs", epochs,
                 "--sleep", 0.2)
    wait_for_steps(tmp_path, 0, 2 * steps + 2, proc, seconds=400)  # inside the third epoch
    kill9(tmp_path, 0, 1)
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-4000:]
    assert generations(tmp_path) == [0, 1]
    (epoch, resets), = set(resumed(tmp_path, 1).values())
    assert epoch in (2, 3) and resets == 1
    w = np.zeros(elastic_train.DIM)
    for _ in range(epochs):  # every epoch applies steps 0..steps-1, once each
        for s in range(steps):
            x, y = elastic_train.batch(s)
            w = w - elastic_train.LR * elastic_train.gradient(w, x, y)
    np.testing.assert_allclose(_finals(tmp_path, 2), w, rtol=1e-10)


@pytest.mark.parametrize("np_", [2, 3])
def test_backup_and_restore_rank0_writes_every_rank_resumes_at_its_epoch(np_, run, tmp_path):
    script = os.path.join(REPO, "tests", "launcher_rank", "backup_restore.py")
    first = run("-np", np_, sys.executable, script, tmp_path, 1, "--interrupt-at", 3,
                timeout=600)
    assert first.returncode != 0 and "interrupted at epoch 3" in first.stderr
    # Only rank 0 wrote a backup (each rank was given a directory of its own).
    assert os.path.exists(tmp_path / "backup-0" / "latest.weights.h5")
    assert not any(os.path.exists(tmp_path / f"backup-{r}") for r in range(1, np_))
    second = run("-np", np_, sys.executable, script, tmp_path, 2, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    for r in range(np_):
        assert (tmp_path / f"epochs.1.{r}").read_text().split() == ["0", "1", "2"]
        assert (tmp_path / f"epochs.2.{r}").read_text().split() == ["3", "4", "5"]
    w = np.zeros(elastic_train.DIM)
    for _ in range(6):
        for s in range(4):
            x, y = elastic_train.batch(s)
            w = w - elastic_train.LR * elastic_train.gradient(w, x, y)
    np.testing.assert_allclose(_finals(tmp_path, np_), w, rtol=1e-10)
