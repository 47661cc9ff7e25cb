"""Data-parallel logistic regression with the NumPy API: no framework needed.

Each rank trains on its shard of scikit-learn's digits (0 vs. rest) when
scikit-learn is installed, else on a fixed synthetic set; gradients are
averaged with horolite.allreduce, so every rank holds the same weights.

    horolite-run -np 2 python examples/numpy_logistic_regression.py
"""
import numpy as np

import horolite as hvd


def load():
    try:
        from sklearn.datasets import load_digits
        digits = load_digits()
        x, y = digits.data / 16.0, (digits.target == 0).astype(np.float64)
    except ImportError:
        rng = np.random.RandomState(0)
        x = rng.randn(1500, 64)
        y = (x @ rng.randn(64) > 0).astype(np.float64)
    order = np.random.RandomState(1).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def main():
    hvd.init()
    (x, y), (x_test, y_test) = load()
    # Shard the training set by rank: every example is seen by exactly one rank.
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    w = hvd.broadcast(np.random.RandomState(hvd.rank()).randn(x.shape[1]) * 0.01, root_rank=0, name="w0")
    for step in range(200):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (p - y) / len(x)
        w -= 0.5 * hvd.allreduce(grad, name="grad")
    acc = float(((x_test @ w > 0) == (y_test > 0.5)).mean())
    same = hvd.allgather(w[None, :], name="check")
    assert np.allclose(same, same[0]), "ranks diverged"
    if hvd.rank() == 0:
        print(f"ranks={hvd.size()} test accuracy={acc:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
