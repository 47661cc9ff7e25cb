"""Elastic TensorFlow jobs without MPI: kill -9 of a rank ten times in a row; each time the
survivors go on in their running processes and a new worker joins (a tf.function tape
step with TensorFlowState; Keras 3 fit with Adam, KerasState and the three elastic
callbacks), no process traces its step again, and training ends with NumPy's weights.
The traced step reads the world's size and rank when it runs: its sparse average and
hvd.size_op()/rank_op() follow the world through 3 -> 2 -> 3 ranks."""
import os
import re
import signal
import sys

import numpy as np
import pytest

from elastic_util import elastic_train
from launcher_util import REPO, wait_until_gone
from test_launcher_elastic_gloo import (NO_MPI, _at_rank, full_world, lines, pid, stepping,
                                        until, workers)

pytest.importorskip("tensorflow")

TF_TRAIN = os.path.join(REPO, "tests", "launcher_rank", "elastic_in_process_tf.py")


def trace_count(outdir, worker):
    return sum(1 for line in lines(outdir, "traces", worker) if line[0] == "trace")


def traces_after_both_sizes(outdir, worker):
    size_of = {s[0]: s[2] for s in lines(outdir, "steps", worker)}
    sizes, late = set(), 0
    for line in lines(outdir, "traces", worker):
        if line[0] == "step":
            sizes.add(size_of.get(line[1]))
        elif len(sizes) >= 2:
            late += 1
    return late


def sizes_of_kept_steps(outdir, last_step):
    """{step: the world's size when the step that counts was made}: a step made again
    after a restore was made in a later generation, and that one counts."""
    newest = {}
    for w in workers(outdir):
        for line in lines(outdir, "steps", w):
            gen, size, step = int(line[0]), int(line[2]), int(line[3])
            if step <= last_step and newest.get(step, (-1, 0))[0] < gen:
                newest[step] = (gen, size)
    assert sorted(newest) == list(range(1, last_step + 1))
    return {step: size for step, (_, size) in newest.items()}


def adam_reference(epochs, steps, lr):
    """Keras 3's Adam (its defaults) over `epochs` passes of the batches 0..steps-1."""
    w = np.zeros(elastic_train.DIM)
    m, v, t = np.zeros_like(w), np.zeros_like(w), 0
    for _ in range(epochs):
        for s in range(steps):
            g = elastic_train.gradient(w, *elastic_train.batch(s))
            t += 1
            alpha = lr * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
            m += (g - m) * (1 - 0.9)
            v += (g * g - v) * (1 - 0.999)
            w = w - (m * alpha) / (np.sqrt(v) + 1e-7)
    return w


def ten_kills(start, tmp_path, *args):
    """kill -9 of the rank k % 3 at the k-th of ten times, each once the world is whole
    again (the worker started in the freed slot joined); then every rank stops. Returns
    the workers that ended training, with their (equal) weights, and the job's stderr."""
    proc = start("--gloo", "-np", 3, "--min-np", 2, sys.executable, TF_TRAIN, tmp_path, *args,
                 "--sleep", 0.03, "--until-file", tmp_path / "stop", env=NO_MPI)
    killed = []
    for k in range(10):
        until(lambda: full_world(tmp_path, 3), proc, f"a whole world before kill {k}", 400)
        victim = _at_rank(tmp_path, k % 3)
        os.kill(pid(tmp_path, victim), signal.SIGKILL)
        killed.append(victim)
        until(lambda: stepping(tmp_path) and victim not in stepping(tmp_path), proc,
              f"the survivors of kill {k}", 400)
    until(lambda: full_world(tmp_path, 3), proc, "a whole world after the kills", 400)
    (tmp_path / "stop").write_text("")
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-4000:]
    assert len(re.findall(r"was killed by signal 9 \(SIGKILL\); generation \d+: 2 rank\(s\) go "
                          "on in their running processes", err)) == 10, err[-4000:]
    assert not wait_until_gone(str(tmp_path), 5)
    done = [w for w in workers(tmp_path) if os.path.exists(tmp_path / f"final.{w}.npy")]
    assert len(done) == 3 and not set(done) & set(killed), (done, killed)
    finals = [np.load(tmp_path / f"final.{w}.npy") for w in done]
    for w, got in zip(done, finals):
        assert np.array_equal(got, finals[0]), w
    for w in workers(tmp_path):  # every reset in the process that started: none restarted
        assert {r[2] for r in lines(tmp_path, "resets", w)} <= {str(pid(tmp_path, w))}, w
    return done, finals[0], err


def test_a_tape_step_goes_on_in_process_ten_kills_in_a_row_without_tracing_again(
        start, tmp_path):
    done, final, err = ten_kills(start, tmp_path, "--mode", "tape", "--steps", 10 ** 6)
    steps = {int((tmp_path / f"final_step.{w}").read_text()) for w in done}
    assert len(steps) == 1, steps
    last = steps.pop()
    np.testing.assert_allclose(final, elastic_train.reference(last), rtol=1e-12, atol=1e-12)
    # The traced step's hvd.size_op() and hvd.rank_op() were the world's at every step.
    for w in workers(tmp_path):
        for line in lines(tmp_path, "steps", w):
            assert line[5:7] == line[1:3], (w, line)
    # Rank r's embedding gradient is r + 1 on row 0: NumPy's average at n ranks is
    # (n + 1) / 2, at the size each kept step was made at (3 and 2 in turn).
    sizes = sizes_of_kept_steps(tmp_path, last)
    assert set(sizes.values()) == {2, 3}, sizes
    row = -sum((np.float64(n) + 1) / 2 for n in sizes.values())
    for w in done:
        emb = np.load(tmp_path / f"embedding.{w}.npy")
        np.testing.assert_allclose(emb[0], [row, row], rtol=1e-12)
        assert not emb[1:].any(), emb
    for w in workers(tmp_path):  # the step is traced once in each process's life
        assert trace_count(tmp_path, w) == 1, (w, lines(tmp_path, "traces", w)[:5])


def test_keras_fit_with_the_elastic_callbacks_goes_on_in_process_ten_kills_in_a_row(
        start, tmp_path):
    steps = 6
    done, final, err = ten_kills(start, tmp_path, "--mode", "fit", "--steps", steps,
                                 "--epochs", 10 ** 4)
    epochs = {int((tmp_path / f"epochs.{w}").read_text()) for w in done}
    assert len(epochs) == 1, epochs
    # Every epoch applies steps 0..steps-1 once each, with the Adam slots carried across
    # (a newcomer's were built and synced before its first step). Near the optimum Adam
    # divides gradients of rounding noise by their own size (averaged over 2 or 3 ranks
    # in turn): a few 1e-9 apart, where a step lost or made twice moves w by ~LR.
    np.testing.assert_allclose(final, adam_reference(epochs.pop(), steps, elastic_train.LR),
                               rtol=1e-7)
    for w_ in workers(tmp_path):
        # The per-rank batch goes from 4 rows to 6 and back: Keras traces its step again
        # for the new shape (with reduce_retracing, for any batch size); once a process
        # has stepped at both sizes, never again.
        assert traces_after_both_sizes(tmp_path, w_) == 0, w_

