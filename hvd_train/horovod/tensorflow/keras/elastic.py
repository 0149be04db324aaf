"""Horovod's `horovod.tensorflow.keras.elastic` on Keras 3 (implementation: `_elastic`)."""

from hvd_train.horovod._elastic import (
    CommitStateCallback,
    KerasState,
    TensorFlowKerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "TensorFlowKerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
