"""Keras 3 model.fit with the horolite DistributedOptimizer and callbacks, then a
resume from the checkpoint rank 0 saved (hvd.load_model keeps the optimizer's state).

    horolite-run -np 2 python examples/keras_fit.py
"""
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horolite.tensorflow.keras as hvd

keras = tf.keras


def main():
    hvd.init()
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    lr = 0.02 * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9))
    # jit_compile=False: the collectives are Python ops, which XLA cannot compile.
    model.compile(optimizer=opt, jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # same start on every rank
        hvd.callbacks.MetricAverageCallback(),               # logs averaged over ranks
        hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=2, verbose=1),
    ]
    # Checkpoints from rank 0 only (every rank holds the same model).
    path = os.path.join(tempfile.mkdtemp(), "digits.keras") if hvd.rank() == 0 else None
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(path))
    model.fit(x_train, y_train, batch_size=32, epochs=6, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} at iteration {int(model.optimizer.iterations.numpy())}")

    # Resume, as after a restart: every rank loads rank 0's checkpoint (the broadcast
    # returns once rank 0 has written it) and trains two more epochs.
    path = hvd.broadcast_object(path, root_rank=0)
    model = hvd.load_model(path)
    model.fit(x_train, y_train, batch_size=32, initial_epoch=6, epochs=8, verbose=0,
              callbacks=[hvd.callbacks.MetricAverageCallback()])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"resumed from {os.path.basename(path)} at iteration "
              f"{int(model.optimizer.iterations.numpy())}: test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
