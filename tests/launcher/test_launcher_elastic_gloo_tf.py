"""Elastic TensorFlow jobs without MPI: kill -9 of a rank, and the survivors go on in their
running processes (a tf.function tape step with TensorFlowState; Keras 3 fit with
KerasState and the three elastic callbacks), without tracing their step again, and end
with NumPy's weights."""
import os
import signal
import sys

import numpy as np
import pytest

from elastic_util import elastic_train
from launcher_util import REPO, wait_until_gone
from test_launcher_elastic_gloo import NO_MPI, lines, pid, until

pytest.importorskip("tensorflow")

TF_TRAIN = os.path.join(REPO, "tests", "launcher_rank", "elastic_in_process_tf.py")


def traces_before_and_after(outdir, worker):
    """Traces of the step made before the first step of generation 1, and after it."""
    before = after = 0
    seen_later = False
    for line in lines(outdir, "traces", worker):
        if line[0] == "step":
            seen_later = seen_later or line[1] != "0"
        elif seen_later:
            after += 1
        else:
            before += 1
    return before, after


def run_and_kill(start, tmp_path, *args, after_steps, join=False):
    """kill -9 of w1 once it made `after_steps` steps; with `join`, the worker started in its
    slot (w3) joins the survivors before the job is told to stop (fit: at an epoch's end)."""
    proc = start("--gloo", "-np", 3, "--min-np", 2, sys.executable, TF_TRAIN, tmp_path, *args,
                 *(["--until-file", tmp_path / "stop"] if join else ["--no-join"]), env=NO_MPI)
    until(lambda: len(lines(tmp_path, "steps", "w1")) >= after_steps, proc, "steps", 400)
    os.kill(pid(tmp_path, "w1"), signal.SIGKILL)
    if join:
        until(lambda: any(s[0] == "2" for s in lines(tmp_path, "steps", "w3")), proc,
              "w3's join", 400)
        (tmp_path / "stop").write_text("")
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-4000:]
    assert "rank 1 (w1, host localhost) was killed by signal 9 (SIGKILL); generation 1: 2 " \
           "rank(s) go on in their running processes" in err, err[-3000:]
    if not join:  # (the workers started in the free slot end at once: no TensorFlow import)
        assert "w3 (host localhost) exited with code 0 before it joined; no new worker " \
               "starts there while it is blacklisted" in err, err[-3000:]
        assert "w4 starts" not in err, err[-3000:]
    assert not wait_until_gone(str(tmp_path), 5)
    workers = ["w0", "w2"] + (["w3"] if join else [])
    finals = [np.load(tmp_path / f"final.{w}.npy") for w in workers]
    for w, got in zip(workers, finals):
        assert np.array_equal(got, finals[0]), w
    for w in ("w0", "w2"):
        assert [r[:2] for r in lines(tmp_path, "resets", w)] == \
            [["1", "2"]] + ([["2", "3"]] if join else [])
        assert {r[2] for r in lines(tmp_path, "resets", w)} == {str(pid(tmp_path, w))}
    return finals[0]


def test_a_tape_step_goes_on_in_process_without_tracing_again(start, tmp_path):
    final = run_and_kill(start, tmp_path, "--mode", "tape", "--steps", 120, "--sleep", 0.03,
                         after_steps=12)
    np.testing.assert_allclose(final, elastic_train.reference(120), rtol=1e-12, atol=1e-12)
    for w in ("w0", "w2"):
        assert traces_before_and_after(tmp_path, w) == (1, 0), w


def test_keras_fit_with_the_elastic_callbacks_goes_on_in_process_and_a_worker_joins(
        start, tmp_path):
    steps = 6
    final = run_and_kill(start, tmp_path, "--mode", "fit", "--steps", steps, "--epochs", 10 ** 4,
                         "--sleep", 0.03, after_steps=2 * steps + 2, join=True)
    epochs = {int((tmp_path / f"epochs.{w}").read_text()) for w in ("w0", "w2", "w3")}
    assert len(epochs) == 1, epochs
    w = np.zeros(elastic_train.DIM)
    for _ in range(epochs.pop()):  # every epoch applies steps 0..steps-1, once each
        for s in range(steps):
            x, y = elastic_train.batch(s)
            w = w - elastic_train.LR * elastic_train.gradient(w, x, y)
    np.testing.assert_allclose(final, w, rtol=1e-10)
    for w_ in ("w0", "w2"):
        before, after = traces_before_and_after(tmp_path, w_)
        # The per-rank batch went from 4 rows to 6, then 4: Keras traces its step once more,
        # for any batch size (reduce_retracing); a job with a fixed per-rank batch does not.
        assert before >= 1 and after <= 1, (w_, before, after)
