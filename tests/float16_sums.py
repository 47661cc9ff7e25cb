"""float16 inputs for checking how a reduction rounds, whatever order ranks are added in."""
import numpy as np


def rounding_sums(shape, size: int, seed: int):
    """One float16 input per rank whose sums over any proper subset of ranks are exact in
    float16, but whose sum over all ranks (odd, 2049..2199 in magnitude) is not: the
    reduced value rounds exactly once in any adding order. Returns (inputs, exact sum)."""
    rng = np.random.RandomState(seed)
    total = (2049 + 2 * rng.randint(0, 76, size=shape)) * rng.choice([-1, 1], size=shape)
    ranks = [np.fix(total / size) + np.sign(total) * (r < np.abs(total) % size)
             for r in range(size)]
    return [v.astype(np.float16) for v in ranks], sum(ranks)
