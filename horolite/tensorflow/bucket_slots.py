"""What each position of a gradient bucket sends, so every rank cuts the same buckets.

With buckets (the default), every reduced variable has a position in the plan,
whatever its gradient is on this rank: a dense tensor (sent in its bucket), None
(an empty placeholder of shape (0,)), or tf.IndexedSlices (an empty marker of
shape (0, 0); its rows go apart as allgathers, once that bucket is back). A
position is sized from its variable where the gradient is not dense, so the plan,
and with it every bucket's name and members, is the same on every rank. A
gradient whose kind differs between ranks then differs in its bucket's member
shapes: every rank gets that mismatch at once, with the variables and the ranks
named (`naming_members`), instead of waiting for requests the others never send.
"""
from __future__ import annotations

import ast
import re
from typing import List, Optional

import tensorflow as tf

from horolite.api.buckets import settle
from horolite.core.handle import Handle

__all__ = ["slot_nbytes", "placeholder", "sparse_marker", "naming_members"]

# The shapes a position sends where its gradient is not dense (what a mismatch shows).
NONE_SHAPE, SPARSE_SHAPE = "(0,)", "(0, 0)"


def nbytes(g) -> int:
    """A gradient's bytes from its static shape (unknown: as large as a bucket may be)."""
    n = g.shape.num_elements()
    return (1 << 62) if n is None else n * g.dtype.size


def slot_nbytes(g, variable) -> int:
    """A plan position's bytes: its dense gradient's, or where it has none (None,
    IndexedSlices) its variable's (the dense gradient it may have on another rank)."""
    if g is not None and not isinstance(g, tf.IndexedSlices):
        return nbytes(g)
    if variable is None or getattr(variable, "shape", None) is None:
        return 0
    n = tf.TensorShape(variable.shape).num_elements()
    return (1 << 62) if n is None else n * dtype_of(variable).size


def dtype_of(variable) -> tf.DType:
    try:
        return tf.as_dtype(variable.dtype).base_dtype
    except (TypeError, AttributeError):
        return tf.float32


def placeholder(variable) -> tf.Tensor:
    """What a None gradient sends in its bucket: shape (0,), its variable's dtype. Where
    every rank has None it carries nothing (docs/tensorflow.md says what it costs); where
    another rank has a gradient, the bucket's member shapes differ and every rank gets the
    mismatch naming both. Its static shape
    stays unknown: TensorFlow replaces an op whose output it knows to be empty with a
    constant, and the wait that raises the mismatch would not run."""
    return _empty(variable, [0])


def sparse_marker(variable) -> tf.Tensor:
    """What an IndexedSlices gradient sends in its bucket: shape (0, 0), which no dense
    gradient of the variable and no None placeholder has."""
    return _empty(variable, [0, 0])


def _empty(variable, shape) -> tf.Tensor:
    empty = tf.zeros(shape, dtype_of(variable) if variable is not None else tf.float32)
    return tf.compat.v1.placeholder_with_default(empty, [None] * len(shape))


def naming_members(handle: Handle, member_labels: List[str]) -> Handle:
    """`handle`, or one that completes as it does, whose mismatch of shapes (the ranks'
    buckets differ) also names the variables whose shapes differ."""
    if not member_labels:
        return handle
    proxy = Handle(handle.name)

    def done(h: Handle) -> None:
        error = h.exception()
        if error is not None:
            text = _with_members(str(error), member_labels)
            if text is not None:
                error.args = (text,) + tuple(error.args[1:])
        settle(proxy, h)
    handle.add_done_callback(done)
    return proxy


def _with_members(text: str, member_labels: List[str]) -> Optional[str]:
    """`text` (a mismatch listing each rank's member shapes) with the variables whose
    shapes differ named, or None where it is not such a message."""
    if "(the gradients of" in text:
        return None
    try:
        if "mismatched group member shapes" in text:
            lists = [ast.literal_eval(m) for m in re.findall(r"had (\[[^\]]*\])", text)]
        elif "mismatched shape:" in text and len(member_labels) == 1:
            lists = [[ast.literal_eval(m)] for m in re.findall(r"had (\([^)]*\))", text)]
        else:
            return None
    except (ValueError, SyntaxError):
        return None
    if len(lists) < 2 or any(len(x) != len(member_labels) for x in lists):
        return None
    differ = [k for k in range(len(member_labels)) if len({tuple(x[k]) for x in lists}) > 1]
    if not differ:
        return None
    shown = {str(tuple(x[k])) for x in lists for k in differ}
    notes = [f"{NONE_SHAPE}: None on that rank"] if NONE_SHAPE in shown else []
    if SPARSE_SHAPE in shown:
        notes.append(f"{SPARSE_SHAPE}: tf.IndexedSlices on that rank, its rows sent apart")
    names = ", ".join(member_labels[k] for k in differ[:8]) + (" and more" if len(differ) > 8 else "")
    return f"{text} (the gradients of {names}{'; ' if notes else ''}{'; '.join(notes)})"
