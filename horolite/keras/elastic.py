"""`hvd.elastic` of `horolite.keras` (Horovod's `horovod.keras.elastic`): the same as
`horolite.tensorflow.keras.elastic`."""
from horolite.tensorflow.keras.elastic import (CommitStateCallback, KerasState,
                                               UpdateBatchStateCallback,
                                               UpdateEpochStateCallback, run)

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
