"""Where Keras 3 itself must cooperate with a DistributedOptimizer: installed once, when
`horolite.tensorflow.keras` is imported, and acting only on models and loss-scale
optimizers that hold a horolite DistributedOptimizer.

- XLA: `Model.compile(jit_compile=True)` (and `"auto"`, which Keras turns on by itself on
  GPU machines) would compile the train step with XLA, which cannot run horolite's
  collectives (Python ops). For a model whose optimizer is a DistributedOptimizer,
  compile turns XLA off for that model, with one warning saying why.
- Mixed precision: `LossScaleOptimizer(DistributedOptimizer(opt))` (the nesting Keras
  builds itself for a `mixed_float16` model) applies the inner optimizer only when
  this rank's gradients are finite. Ranks would then disagree about whether to
  reduce, and hang; so such a loss-scale optimizer decides on finiteness over all
  ranks (one small allreduce), and every rank takes the same branch.
- Keras 2 (`TF_USE_LEGACY_KERAS=1` with tf_keras) is refused with a clear message:
  horolite's Keras wrappers are written for Keras 3.
"""
from __future__ import annotations

import logging

import tensorflow as tf

from horolite.core.ops import ReduceOp

__all__ = ["install", "check_keras_version"]

_log = logging.getLogger("horolite.tensorflow")
_installed = False
_warned = set()


def check_keras_version() -> None:
    version = getattr(tf.keras, "__version__", None) or getattr(tf.keras, "version", lambda: "")()
    if str(version).startswith("2."):
        raise ImportError(
            f"horolite.tensorflow.keras needs Keras 3, but tf.keras is Keras {version} "
            "(TF_USE_LEGACY_KERAS=1 with tf_keras installed). Unset TF_USE_LEGACY_KERAS, or "
            "use horolite.tensorflow (DistributedGradientTape) with your Keras 2 model.")


def install(distributed_mixin: type) -> None:
    """Patch keras.Model.compile and LossScaleOptimizer.check_finite (once)."""
    global _installed
    if _installed:
        return
    _installed = True
    keras = tf.keras
    lso_cls = keras.optimizers.LossScaleOptimizer

    def is_distributed(opt) -> bool:
        return isinstance(opt, distributed_mixin) or (
            isinstance(opt, lso_cls) and isinstance(opt.inner_optimizer, distributed_mixin))

    # Patched where Keras defines it (its Trainer), not on keras.Model: loading a model
    # compiles it only if `compile` is the Trainer's own.
    owner = next(c for c in keras.Model.__mro__ if "compile" in vars(c))
    original_compile = owner.compile

    def compile(self, *args, **kwargs):
        original_compile(self, *args, **kwargs)
        if is_distributed(getattr(self, "optimizer", None)) and self.jit_compile:
            self.jit_compile = False
            if self.name not in _warned:
                _warned.add(self.name)
                _log.warning("model %r: XLA turned off (jit_compile=False): its train step runs "
                             "horolite's collectives, which are Python ops that XLA cannot "
                             "compile", self.name)

    compile.__doc__ = original_compile.__doc__
    owner.compile = compile

    original_check_finite = lso_cls.check_finite

    def check_finite(self, grads):
        finite = original_check_finite(self, grads)
        if not isinstance(self.inner_optimizer, distributed_mixin):
            return finite
        from ..mpi_ops import _allreduce
        agreed = _allreduce(tf.cast(finite, tf.int32), ReduceOp.MIN)
        return tf.cast(agreed, tf.bool)

    lso_cls.check_finite = check_finite
