"""Keras 3 model.fit with the horolite DistributedOptimizer and callbacks.

    horolite-run -np 2 python examples/keras_fit.py
"""
import os

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
    model.fit(x_train, y_train, batch_size=32, epochs=8, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
