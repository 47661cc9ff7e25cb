"""Elastic training by restart: Horovod's State/ObjectState and run loop, framework-neutral.

The framework states (TensorFlowState, TensorFlowKerasState, KerasState) and the Keras
callbacks are in the adapters; the driver that restarts the job is launcher/elastic.py.
"""
from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from .run import resume, run_fn
from .state import ObjectState, State

__all__ = ["State", "ObjectState", "run_fn", "resume", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
