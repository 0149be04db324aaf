"""The seam between hvd_train and Horovod: the only package that imports horovod.

Everything distributed that the rest of the toolkit needs (topology, collectives, the distributed
optimizer, the start-of-training broadcast) is asked of this package. It is also the one place that
knows the software stack (`stack.NAME`: modern = Keras 3, classic = Keras 2 with Horovod's own
Keras optimizer) and the few Keras facts that differ between them (variable names and values,
optimizer variables, the current learning rate): the rest of the tree asks, and never branches.
"""

from hvd_train.dist.core import (
    Average,
    Compression,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    allreduce_mean,
    barrier,
    broadcast,
    broadcast_model_state,
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
from hvd_train.dist.layers import SyncBatchNormalization, convert_sync_batchnorm
from hvd_train.dist.optimizer import (
    DistributedOptimizer,
    allreduce_count,
    check_optimizer,
    is_distributed,
    traces_collectives,
)
from hvd_train.dist.stack import (
    learning_rate,
    loss_scale,
    optimizer_built,
    optimizer_variables,
    restore_jit_compile,
    variable_name,
)
from hvd_train.dist.state import average_non_trainable, reduce_metrics_over_ranks
from hvd_train.dist.stop import request_stop, stop_agreed

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
    "allreduce_mean",
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
