"""Deprecated alias of `hvd_train.comm` and `hvd_train.keras` (the package `hvd_train.dist` until
0.1), kept for one release: removed in 0.3. Import the public names from `hvd_train` (e.g.
`hvd_train.SyncBatchNormalization`), collectives from `hvd_train.comm`; docs/changelog.md maps
every old name to its new place.
"""

import warnings

from hvd_train.comm import (
    Average,
    Compression,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    build_info,
    compute_threads,
    controller,
    grouped_allreduce,
    init,
    is_chief,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from hvd_train.keras.compat import (
    learning_rate,
    loss_scale,
    optimizer_built,
    optimizer_variables,
    restore_jit_compile,
    variable_name,
)
from hvd_train.keras.layers import SyncBatchNormalization, convert_sync_batchnorm
from hvd_train.keras.metrics import reduce_metrics_over_ranks
from hvd_train.keras.optimizer import (
    DistributedOptimizer,
    allreduce_count,
    check_optimizer,
    is_distributed,
    traces_collectives,
)
from hvd_train.keras.state import average_non_trainable, broadcast_model_state
from hvd_train.keras.stop import request_stop, stop_agreed

warnings.warn(
    "hvd_train.dist is deprecated and will be removed in hvd_train 0.3: use hvd_train (public "
    "names), hvd_train.comm (collectives) and hvd_train.keras (Keras layer)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_count",
    "average_non_trainable",
    "barrier",
    "broadcast",
    "broadcast_model_state",
    "broadcast_object",
    "broadcast_variables",
    "build_info",
    "check_optimizer",
    "compute_threads",
    "controller",
    "convert_sync_batchnorm",
    "grouped_allreduce",
    "init",
    "is_chief",
    "is_distributed",
    "learning_rate",
    "local_rank",
    "local_size",
    "loss_scale",
    "optimizer_built",
    "optimizer_variables",
    "rank",
    "reduce_metrics_over_ranks",
    "request_stop",
    "restore_jit_compile",
    "shutdown",
    "size",
    "stop_agreed",
    "traces_collectives",
    "variable_name",
]
