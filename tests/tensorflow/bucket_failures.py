"""Helpers the bucket tests share for a step that fails on one rank: a layer whose backprop
raises on demand, a model and batches around it, the error the other ranks must see, the
check that every rank still holds the same weights, and a bound on a hang."""
import faulthandler
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

WIDTH, LAYERS = 128, 8

PEER_FAILED = (r"rank 1 will never send it: its previous run of this step failed there "
               r"after \d+ of \d+ buckets had left")


class FailOnFlag(keras.layers.Layer):
    """Identity forward; its backward fails (a reshape that cannot fit) while `flag` is set:
    an op of backprop raising on one rank after the later layers' buckets left."""

    def __init__(self, flag, **kwargs):
        super().__init__(**kwargs)
        self.flag = flag

    def call(self, x):
        flag = self.flag

        @tf.custom_gradient
        def identity(x):
            def grad(dy):
                shape = tf.where(flag > 0.5, tf.constant([-1, 7]), tf.shape(dy))
                # (times a 1 read from the flag: Grappler folds a reshape of a reshape back
                # to its input's shape into nothing, and then nothing fails)
                one = tf.cast(flag < 2.0, dy.dtype)
                return tf.reshape(tf.reshape(dy, shape) * one, tf.shape(dy))
            return tf.identity(x), grad
        return identity(x)


def same_on_every_rank(variables, what):
    """Every rank holds the same values of `variables` (gathered with mpi4py)."""
    mine = [np.asarray(v) for v in variables]
    every = MPI.COMM_WORLD.allgather(mine)
    for r, theirs in enumerate(every):
        for k, (a, b) in enumerate(zip(theirs, every[0])):
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {k}: rank {r} differs from rank 0")


def failing_model(flag, layers=LAYERS):
    """Dense, FailOnFlag, `layers` Dense layers, Dense(4). At a 0.3 MB cap the first bucket
    holds only layers above FailOnFlag where `layers` >= 5: it leaves before the failure."""
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(WIDTH, activation="tanh"),
                             FailOnFlag(flag)] +
                            [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(layers)] +
                            [keras.layers.Dense(4)])


def batch(r, rows):
    rng = np.random.RandomState(1000 * rows + r)
    return (tf.constant(rng.normal(size=(rows, WIDTH)).astype(np.float32)),
            tf.constant(rng.normal(size=(rows, 4)).astype(np.float32)))


def fail_on_rank_1(flag, run, batch):
    """One step of `run` in which rank 1 fails (FailOnFlag) and every other rank's step
    fails naming it."""
    rank = MPI.COMM_WORLD.Get_rank()
    flag.assign(1.0 if rank == 1 else 0.0)
    if rank == 1:
        with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
            run(batch)
    else:
        with pytest.raises(tf.errors.OpError, match=PEER_FAILED):
            run(batch)


def fail_if_hung(seconds):
    """A hang ends this rank after `seconds`, every thread's stack in its log (pytest's
    capture would lose them): the test fails fast instead of waiting for the driver."""
    outdir = os.environ.get("HOROLITE_TEST_OUTDIR")
    out = open(os.path.join(outdir, f"rank{MPI.COMM_WORLD.Get_rank()}.log"), "a") if outdir else None
    faulthandler.dump_traceback_later(seconds, exit=True, file=out or sys.__stderr__)
    return out
