"""Horovod's `horovod.keras.callbacks`: the callbacks of horolite.tensorflow.keras."""
from horolite.tensorflow.keras.callbacks import (BestModelCheckpoint,
                                                 BroadcastGlobalVariablesCallback,
                                                 LearningRateScheduleCallback,
                                                 LearningRateWarmupCallback,
                                                 MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]
