"""hvd_train: distributed training for Keras on Horovod.

The public API for a user's own `model.fit()` code:

    import hvd_train
    hvd_train.init()                                   # Horovod, GPU pinning, threads per rank
    opt = hvd_train.DistributedOptimizer(keras.optimizers.SGD(lr))
    model.compile(optimizer=opt, ...)
    model.fit(..., callbacks=hvd_train.distributed_callbacks())
    hvd_train.evaluate(model, x_test, y_test)          # every rank: one exact result over all

Names resolve on first use, so `import hvd_train` loads neither TensorFlow nor Horovod (the CLI
checks its arguments before paying for them). Submodules: `hvd_train.callbacks` (Keras callbacks),
`hvd_train.comm` (topology, process sets and collectives), `hvd_train.data` (sharded input).

Importing it sets one variable that TensorFlow reads as it loads, `TF_ENABLE_ONEDNN_OPTS=1` on x86
unless already set (docs/knobs.md): import hvd_train before TensorFlow.
"""

from __future__ import annotations

import importlib
import os
import platform
from typing import TYPE_CHECKING, Any

from hvd_train.core import placement
from hvd_train.errors import UserError

# Before TensorFlow loads, which reads it once: its oneDNN CPU kernels also where it would leave
# them off (docs/knobs.md). The launchers forward TF_* to every rank.
placement.prefer_onednn(os.environ, platform.machine())

if TYPE_CHECKING:  # what editors and type checkers see; at run time, resolved on first use
    from hvd_train import callbacks, comm, data
    from hvd_train.callbacks import (
        AverageMetrics,
        AverageNonTrainable,
        BroadcastInitialState,
        CheckWeights,
        Preempted,
        StopAtAgreedStep,
        distributed_callbacks,
    )
    from hvd_train.comm import (
        Average,
        Compression,
        Sum,
        cross_rank,
        cross_size,
        init,
        is_chief,
        local_rank,
        local_size,
        rank,
        shutdown,
        size,
    )
    from hvd_train.core.faults import StopRequest
    from hvd_train.core.scaling import resolve_batch_sizes, scaled_learning_rate
    from hvd_train.data import shard_dataset
    from hvd_train.keras.embedding import ShardedEmbedding
    from hvd_train.keras.layers import SyncBatchNormalization, convert_sync_batchnorm
    from hvd_train.keras.optimizer import DistributedOptimizer
    from hvd_train.keras.randomness import rank_seed
    from hvd_train.keras.schedules import scaled_warmup_schedule
    from hvd_train.keras.state import broadcast_model_state
    from hvd_train.training.evaluation import evaluate

__version__ = "0.1.0"

_EXPORTS = {
    "init": "hvd_train.comm",
    "shutdown": "hvd_train.comm",
    "rank": "hvd_train.comm",
    "size": "hvd_train.comm",
    "local_rank": "hvd_train.comm",
    "local_size": "hvd_train.comm",
    "cross_rank": "hvd_train.comm",
    "cross_size": "hvd_train.comm",
    "is_chief": "hvd_train.comm",
    "Average": "hvd_train.comm",
    "Sum": "hvd_train.comm",
    "Compression": "hvd_train.comm",
    "DistributedOptimizer": "hvd_train.keras.optimizer",
    "broadcast_model_state": "hvd_train.keras.state",
    "rank_seed": "hvd_train.keras.randomness",
    "SyncBatchNormalization": "hvd_train.keras.layers",
    "ShardedEmbedding": "hvd_train.keras.embedding",
    "convert_sync_batchnorm": "hvd_train.keras.layers",
    "scaled_warmup_schedule": "hvd_train.keras.schedules",
    "BroadcastInitialState": "hvd_train.callbacks",
    "AverageMetrics": "hvd_train.callbacks",
    "AverageNonTrainable": "hvd_train.callbacks",
    "distributed_callbacks": "hvd_train.callbacks",
    "StopAtAgreedStep": "hvd_train.callbacks",
    "Preempted": "hvd_train.callbacks",
    "CheckWeights": "hvd_train.callbacks",
    "StopRequest": "hvd_train.core.faults",
    "shard_dataset": "hvd_train.data",
    "resolve_batch_sizes": "hvd_train.core.scaling",
    "scaled_learning_rate": "hvd_train.core.scaling",
    "evaluate": "hvd_train.training.evaluation",
}
_SUBMODULES = ("callbacks", "comm", "data")

__all__ = [
    "Average",
    "AverageMetrics",
    "AverageNonTrainable",
    "BroadcastInitialState",
    "CheckWeights",
    "Compression",
    "DistributedOptimizer",
    "Preempted",
    "ShardedEmbedding",
    "StopAtAgreedStep",
    "StopRequest",
    "Sum",
    "SyncBatchNormalization",
    "UserError",
    "__version__",
    "broadcast_model_state",
    "callbacks",
    "comm",
    "convert_sync_batchnorm",
    "cross_rank",
    "cross_size",
    "data",
    "distributed_callbacks",
    "evaluate",
    "init",
    "is_chief",
    "local_rank",
    "local_size",
    "rank",
    "rank_seed",
    "resolve_batch_sizes",
    "scaled_learning_rate",
    "scaled_warmup_schedule",
    "shard_dataset",
    "shutdown",
    "size",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"hvd_train.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hvd_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
