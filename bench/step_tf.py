"""The TensorFlow part of bench/step_allreduce.py: issue 28's 100 x Dense(500) model.

Every rank trains the same model at once (batch 32 of synthetic data, SGD, one
TensorFlow thread per process), in interleaved blocks of:
- plain TensorFlow (no exchange: what the ranks reach as independent processes),
  a GradientTape step eagerly and in tf.function, and Keras fit;
- plain TensorFlow in tf.function with every gradient computed before the first
  update, as exchanging the step's gradients as one group (the default) requires
  (in a plain step TensorFlow updates each variable as soon as its gradient is
  ready, while the gradient is still in cache);
- horolite: DistributedGradientTape eagerly and in tf.function, and Keras fit with
  horolite.keras.DistributedOptimizer;
- the NumPy step of the same gradients (one grouped_allreduce), for what the
  adapters add on top of the exchange itself.
A tape step is timed as one call (ranks start together); a fit step as the median
time between consecutive batch ends inside one fit call of --fit-batches batches
(the slowest rank's), so fit's own per-call setup is not counted.
"""
from __future__ import annotations

import os
import time

import numpy as np

import common
from common import Target

WIDTH, DEPTH, BATCH, CLASSES = 500, 100, 32, 10
SYNCED = "plain, tf.function, every gradient before the update"
TAPE = ["plain, tf.function", SYNCED, "DistributedGradientTape, tf.function",
        "plain, eager", "DistributedGradientTape, eager"]
FIT = ["plain, Keras fit", "DistributedOptimizer, Keras fit"]


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def _model(tf, width: int, depth: int):
    keras = tf.keras
    layers = [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu")
                                        for _ in range(depth)]
    return keras.Sequential(layers + [keras.layers.Dense(CLASSES)])


def run(hvd, comm, args, shapes, blocked_times) -> dict:
    tf = _tf()
    import horolite.keras as hk
    import horolite.tensorflow as htf
    tiny = args.tiny
    width, depth = (64, 5) if tiny else (WIDTH, DEPTH)
    rng = np.random.default_rng(comm.Get_rank())
    x = tf.constant(rng.standard_normal((BATCH, width)).astype(np.float32))
    y = tf.constant(rng.integers(0, CLASSES, BATCH))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def tape_step(distributed: bool, compiled: bool, synced: bool = False):
        model = _model(tf, width, depth)
        opt = tf.keras.optimizers.SGD(0.001)

        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if distributed:
                tape = htf.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            if synced:
                with tf.control_dependencies(grads):  # identity forwards, copies nothing
                    grads = [tf.identity(g) for g in grads]
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        fn = tf.function(step) if compiled else step
        return lambda: fn().numpy()

    steps_seen = []

    class Steps(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps_seen.append(time.perf_counter())

    fit_batches = 4 if tiny else args.fit_batches
    data = tf.data.Dataset.from_tensors((x, y)).repeat()

    def fit_step(distributed: bool):
        model = _model(tf, width, depth)
        opt = tf.keras.optimizers.SGD(0.001)
        model.compile(optimizer=hk.DistributedOptimizer(opt) if distributed else opt,
                      loss=loss_fn)

        def fit():
            steps_seen.clear()
            model.fit(data, epochs=1, steps_per_epoch=fit_batches, verbose=0,
                      callbacks=[Steps()])
            return float(np.median(np.diff(steps_seen)))
        return fit

    arrays = [np.ones(s, np.float32) for s in shapes]
    fns = {"plain, tf.function": tape_step(False, True),
           SYNCED: tape_step(False, True, synced=True),
           "DistributedGradientTape, tf.function": tape_step(True, True),
           "plain, eager": tape_step(False, False),
           "DistributedGradientTape, eager": tape_step(True, False),
           "NumPy step, grouped": lambda: hvd.grouped_allreduce(arrays, name="tf.numpy.group")}
    fits = {"plain, Keras fit": fit_step(False), "DistributedOptimizer, Keras fit": fit_step(True)}
    for fit in fits.values():
        fit()  # traces
    times = {name: [] for name in [*fns, *fits]}
    per = max(1, -(-args.tf_steps // args.blocks))
    t0 = time.monotonic()
    for _ in range(args.blocks):
        block = blocked_times(fns, per, 1, comm)
        for name, t in block.items():
            times[name] += t
        for name, fit in fits.items():
            common.polite_barrier(comm)
            times[name].append(comm.allreduce(fit(), op=_max()))
    return {"width": width, "depth": depth, "batch": BATCH, "fit_batches": fit_batches,
            "block_medians_s": times, "load": round(common.other_busy_so_far(), 3),
            "seconds": round(time.monotonic() - t0, 1)}


def _max():
    from mpi4py import MPI
    return MPI.MAX


def _ratio(t, a, b):
    return float(np.median(np.array(t[a]) / np.array(t[b])))


def _bound(t):
    """What this machine allows a step that exchanges its gradients once: plain / (a
    plain step that computes every gradient before the first update + the NumPy step
    of the same gradients), median over blocks; then those three steps' medians in ms.
    None for a run without the synced variant."""
    if SYNCED not in t:
        return None
    plain, synced, numpy_ = (np.array(t[k]) for k in ("plain, tf.function", SYNCED,
                                                      "NumPy step, grouped"))
    return (float(np.median(plain / (synced + numpy_))), float(np.median(plain)) * 1e3,
            float(np.median(synced)) * 1e3, float(np.median(numpy_)) * 1e3)


def _bound_text(t, ratio: float) -> str:
    b = _bound(t)
    if b is None:
        return ""
    best, plain, synced, numpy_ = b
    return (f"a step that exchanges its gradients as one group (the default) can reach at "
            f"most {best:.2f} here, measured in the same run: plain ({plain:.1f} ms) / (a plain "
            f"step that computes every gradient before the first update, as such an exchange "
            f"needs, {synced:.1f} ms, + the NumPy step of the same 100 MB, {numpy_:.1f} ms); "
            f"horolite reaches {ratio / best:.2f} of that. With one TensorFlow thread per rank "
            f"on 2 cores no core is idle to overlap the exchange with backprop, and the "
            f"exchange is bound by memory bandwidth (one tensor of the step's bytes: "
            f"11-13 ms quiet); one request per gradient, which would let updates start "
            f"early, costs more than it saves here (0.39 of plain)")


def report(r: dict, n: int):
    t = r["block_medians_s"]
    model = f"{r['depth']} x Dense({r['width']}), batch {r['batch']}, 1 TF thread"
    rows, head = [], model
    plain = {"DistributedGradientTape, tf.function": "plain, tf.function",
             SYNCED: "plain, tf.function",
             "DistributedGradientTape, eager": "plain, eager",
             "DistributedOptimizer, Keras fit": "plain, Keras fit"}
    for v in [*TAPE, *FIT, "NumPy step, grouped"]:
        if v not in t:
            continue  # a run from before the variant existed (--render)
        vs = f"{_ratio(t, plain[v], v):.2f} of plain" if v in plain else ""
        rows.append([head, v, f"{np.median(t[v]) * 1e3:.2f}", vs, "", f"{r['load']:.2f}"])
        head = ""
    targets = []
    for v, short in (("DistributedGradientTape, tf.function", "DistributedGradientTape (tf.function)"),
                     ("DistributedOptimizer, Keras fit", "Keras fit + DistributedOptimizer")):
        ratio = _ratio(t, plain[v], v)
        limits = _bound_text(t, ratio)
        if v in LIMITS:
            limits = f"{limits}; {LIMITS[v]}" if limits else LIMITS[v]
        targets.append(Target(f"{short}: throughput / plain processes' (np {n}, load "
                              f"{r['load']:.2f})", ratio, 0.8, "", True, limits))
        added = np.median((np.array(t[v]) - np.array(t[plain[v]])) / np.array(t["NumPy step, grouped"]))
        targets.append(Target(f"{short}: step time added beyond the NumPy step / the NumPy step",
                              float(added - 1), 0.2, "", False, _added_text(t, v)))
    return rows, targets


def _added_text(t, v: str) -> str:
    base = LIMITS[("adds", v)]
    if SYNCED not in t:
        return base
    plain, synced = np.median(t["plain, tf.function"]), np.median(t[SYNCED])
    return (f"of the time added, {(synced - plain) * 1e3:.1f} ms is plain TensorFlow's own "
            f"when every gradient is computed before the first update (the synced plain "
            f"step: the updates no longer read each gradient from cache); {base}")


# What limits a missed target (docs/benchmarks.md, "One training step"), besides the bound
# measured in the run.
_SKEW = ("a distributed step is backprop up to the enqueue op (as plain), the exchange (as "
         "the NumPy step, plus the wait for the later rank: the ranks reach it 2-13 ms apart, "
         "median) and the optimizer's update after the wait op (as the synced plain step); "
         "the adapters' own ops take under 1 ms (probes on the quiet VM, docs/benchmarks.md)")
LIMITS = {
    "DistributedGradientTape, tf.function": _SKEW,
    "DistributedOptimizer, Keras fit": "a fit step is timed inside fit, without a barrier: "
        "plain processes each run at their own pace, while horolite's ranks wait for the slower "
        "one every step",
    ("adds", "DistributedGradientTape, tf.function"): _SKEW,
    ("adds", "DistributedOptimizer, Keras fit"):
        "as the tape's, plus the wait for the slower rank every step (see the throughput "
        "row), which the NumPy step, timed from a barrier, does not include",
}
