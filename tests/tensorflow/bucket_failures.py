"""Helpers the bucket tests share for a step that fails on one rank: a layer whose backprop
raises on demand, the error the other ranks must see, and the check that every rank still
holds the same weights."""
import keras
import numpy as np
import tensorflow as tf
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

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
                return tf.reshape(tf.reshape(dy, shape), tf.shape(dy))
            return tf.identity(x), grad
        return identity(x)


def same_on_every_rank(variables, what):
    """Every rank holds the same values of `variables` (gathered with mpi4py)."""
    mine = [np.asarray(v) for v in variables]
    every = MPI.COMM_WORLD.allgather(mine)
    for r, theirs in enumerate(every):
        for k, (a, b) in enumerate(zip(theirs, every[0])):
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {k}: rank {r} differs from rank 0")
