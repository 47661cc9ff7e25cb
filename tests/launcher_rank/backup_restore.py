"""Keras 3 fit with keras.callbacks.BackupAndRestore in a horolite job (least squares with a
known result, as elastic_tf.py --mode fit). Each rank gets its own backup_dir
(OUTDIR/backup-<rank>), as on hosts without a shared file system; --interrupt-at E
raises at the start of epoch E on every rank. Writes OUTDIR/epochs.<run>.<rank> (the
epochs this run trained) and final.<rank>.npy."""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_train import DIM, GLOBAL, LR, batch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("run")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--interrupt-at", type=int, default=-1)
    args = p.parse_args()
    import keras
    import horolite.tensorflow.keras as hvd
    keras.config.set_floatx("float64")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    parts = []
    for s in range(args.steps):
        x, y = batch(s)
        parts.append((x[rank * GLOBAL // size:(rank + 1) * GLOBAL // size],
                      y[rank * GLOBAL // size:(rank + 1) * GLOBAL // size]))
    x = np.concatenate([a for a, _ in parts])
    y = np.concatenate([b for _, b in parts])[:, None]
    log = open(os.path.join(args.outdir, f"epochs.{args.run}.{rank}"), "w")

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == args.interrupt_at:
                raise RuntimeError(f"interrupted at epoch {epoch}")
            log.write(f"{epoch}\n")
            log.flush()

    backup = keras.callbacks.BackupAndRestore(os.path.join(args.outdir, f"backup-{rank}"),
                                              delete_checkpoint=False)
    model.fit(x, y, batch_size=GLOBAL // size, shuffle=False, epochs=args.epochs, verbose=0,
              callbacks=[backup, Epochs()])
    np.save(os.path.join(args.outdir, f"final.{rank}.npy"), model.get_weights()[0][:, 0])


if __name__ == "__main__":
    sys.exit(main())
