"""A Keras optimizer's whole update waits for every gradient horolite reduced in buckets.

A graph step of several requests can fail at one of its buckets after others came
back (a rank whose backprop raised tells the others at its next step). Every reduced
gradient waits for every request (gradients._after_every_request), so what is made
from the gradients runs on every rank or on none. Part of a Keras optimizer's update
needs no gradient: `iterations`, AdamW's weight decay (`weight_decay=`), an EMA of
the weights. With DistributedGradientTape and the user's own Keras optimizer, those
ran during a failed step on every rank that was not held up by its error, and on the
failing rank depending on its scheduling.

`mark` tags the gradients that wait for every request; `install` (once) makes Keras 3's
`BaseOptimizer.apply` run its whole update after them when any gradient it is given
is tagged: with one control input per op, through one NoOp. The optimizer is built
first, outside that dependency (built under it, its slots' initializers would depend
on the gradients, which tf.function cannot lift out of the step). Gradients from
anywhere else are left alone. `after_all` is the one-NoOp dependency every barrier of
a step uses (the reduced gradients, the waits, the Keras and aggregated updates).
"""
from __future__ import annotations

from typing import List, Sequence

import tensorflow as tf

__all__ = ["mark", "install", "after_all"]

_TAG = "_horolite_waits_for_every_request"
_installed = False


def mark(tensors) -> None:
    """Tag graph tensors that wait for every request of their step."""
    for t in tensors:
        try:
            setattr(t, _TAG, True)
        except AttributeError:  # (an eager tensor: an eager step is one request)
            pass


def _tagged(grads) -> list:
    out = []
    for g in grads:
        t = g.values if isinstance(g, tf.IndexedSlices) else g
        if t is not None and getattr(t, _TAG, False):
            out.append(t)
    return out


def install() -> None:
    """Patch Keras 3's BaseOptimizer.apply (once; nothing where Keras 3 is absent)."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from keras.src.optimizers.base_optimizer import BaseOptimizer
        from keras.src import backend
    except ImportError:
        return
    original = BaseOptimizer.apply

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        tagged = _tagged(grads) if not tf.executing_eagerly() else []
        if not tagged:
            return original(self, grads, trainable_variables)
        if not self.built and trainable_variables is not None:
            variables = list(trainable_variables)
            with backend.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
            trainable_variables = variables
        with tf.control_dependencies(after_all(tagged)):
            return original(self, grads, trainable_variables)

    apply.__doc__ = original.__doc__
    BaseOptimizer.apply = apply


def after_all(deps: Sequence) -> List:
    """Control inputs that make an op wait for every one of `deps` through one NoOp: each
    op made under them gets one edge, not one per dependency (an update of N variables
    under N gradients was N^2 edges: 1.35 M at 300 variables, seconds of tracing)."""
    deps = [d for d in deps if d is not None]
    if tf.executing_eagerly() or len(deps) <= 1:
        return deps
    return [tf.group(*deps)]
