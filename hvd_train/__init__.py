"""hvd_train: distributed training for Keras on Horovod.

The public API for a user's own `model.fit()` code:

    import hvd_train
    hvd_train.init()                                   # Horovod, GPU pinning, threads per rank
    opt = hvd_train.DistributedOptimizer(keras.optimizers.SGD(lr))
    model.compile(optimizer=opt, ...)
    model.fit(..., callbacks=[hvd_train.BroadcastInitialState()])

Names resolve on first use, so `import hvd_train` loads neither TensorFlow nor Horovod (the CLI
checks its arguments before paying for them).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "init": "hvd_train.dist",
    "rank": "hvd_train.dist",
    "size": "hvd_train.dist",
    "local_rank": "hvd_train.dist",
    "local_size": "hvd_train.dist",
    "is_chief": "hvd_train.dist",
    "Average": "hvd_train.dist",
    "Sum": "hvd_train.dist",
    "Compression": "hvd_train.dist",
    "DistributedOptimizer": "hvd_train.dist",
    "broadcast_model_state": "hvd_train.dist",
    "BroadcastInitialState": "hvd_train.callbacks",
    "AverageMetrics": "hvd_train.callbacks",
    "AverageNonTrainable": "hvd_train.callbacks",
    "distributed_callbacks": "hvd_train.callbacks",
    "StopAtAgreedStep": "hvd_train.callbacks",
    "Preempted": "hvd_train.callbacks",
    "CheckWeights": "hvd_train.callbacks",
    "StopRequest": "hvd_train.faults",
    "shard_dataset": "hvd_train.data",
    "scaled_warmup_schedule": "hvd_train.lr_schedule",
    "resolve_batch_sizes": "hvd_train.schedules",
    "scaled_learning_rate": "hvd_train.schedules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hvd_train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
