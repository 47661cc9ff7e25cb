"""Horovod's Adasum in NumPy (float64), the reference the Adasum tests compare with."""
import numpy as np

_TINY = np.sqrt(np.finfo(np.float64).tiny)


def pair(a, b):
    """Adasum of two vectors: each scaled by 1 - a.b / (2 |itself|^2) (1 where it is ~0)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    dot, na, nb = a @ b, a @ a, b @ b
    ac = 1 - dot / (2 * na) if na >= _TINY else 1.0
    bc = 1 - dot / (2 * nb) if nb >= _TINY else 1.0
    return ac * a + bc * b


def tree(vectors):
    """Level by level: neighbours (0, 1), (2, 3)..., then the pairs' results, and so on."""
    level = list(vectors)
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]
