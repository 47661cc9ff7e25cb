"""Slot forwarding shared by the wrappers of a tf.compat.v1.train.Optimizer: the slots
(momentum, Adam's moments) live in the wrapped optimizer, so a caller asking the wrapper
for them (Horovod's wrappers answer too) gets the wrapped optimizer's."""

__all__ = ["ForwardSlots"]


class ForwardSlots:
    """Mixed into a wrapper that keeps the wrapped optimizer as `self._optimizer`."""

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
