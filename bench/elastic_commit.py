"""The cost of an elastic `state.commit()` for a ResNet-50 (25.6M float32 weights), against
its training step: the target is <= 5% of a step at one commit every 10 steps.

One process: a Keras 3 ResNet50 (weights=None) with SGD + momentum (so the state holds
the weights and as many momentum slots), TensorFlowKerasState, and a commit written to
host memory as under horolite-run's elastic mode. The commit is split into save() (the
in-memory copy Horovod also makes) and the write to /dev/shm.

    python bench/elastic_commit.py [--batch 32] [--steps 3] [--commits 5]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--commits", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    job = f"bench{uuid.uuid4().hex[:8]}"
    os.environ["HOROLITE_ELASTIC_JOB"] = job
    import keras
    import numpy as np
    import tensorflow as tf
    import horolite.tensorflow as hvd
    from horolite.elastic import protocol
    hvd.init()
    model = keras.applications.ResNet50(weights=None)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    x = tf.random.uniform((args.batch, 224, 224, 3))
    y = tf.random.uniform((args.batch,), maxval=1000, dtype=tf.int64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step()  # builds the optimizer's slots, traces the step
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step().numpy()
        steps.append(time.perf_counter() - t)
    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
    nbytes = sum(int(np.prod(v.shape)) * v.dtype.size for v in
                 [*state._saved_model_state, *state._saved_optimizer_state])
    saves, writes, commits = [], [], []
    for _ in range(args.commits):
        t = time.perf_counter()
        state.commit()
        commits.append(time.perf_counter() - t)
        writes.append(state.last_commit_seconds)
        t = time.perf_counter()
        state.save()
        saves.append(time.perf_counter() - t)
    shutil.rmtree(protocol.job_dir(job), ignore_errors=True)
    step_s, commit_s = statistics.median(steps), statistics.median(commits)
    share = commit_s / (10 * step_s + commit_s)
    params = sum(int(np.prod(v.shape)) for v in model.variables)
    print(f"ResNet50: {params / 1e6:.1f}M model values, state {nbytes / 1e6:.0f} MB "
          f"(weights + momentum), batch {args.batch}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"  step (median of {args.steps})      {step_s:8.3f} s")
    print(f"  commit (median of {args.commits})    {commit_s:8.3f} s  "
          f"(save {statistics.median(saves):.3f} s + write {statistics.median(writes):.3f} s, "
          f"{nbytes / 1e9 / statistics.median(writes):.2f} GB/s)")
    print(f"  one commit every 10 steps: {100 * share:.2f}% of the time "
          f"(target <= 5%: {'met' if share <= 0.05 else 'missed'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_s": step_s, "commit_s": commit_s, "save_s": statistics.median(saves),
                       "write_s": statistics.median(writes), "state_bytes": nbytes,
                       "share_at_1_in_10": share, "batch": args.batch}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
