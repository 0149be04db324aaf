"""The seam between hvd_train and Horovod: the only package that imports horovod.

Everything distributed that the rest of the toolkit needs (topology, collectives, the distributed
optimizer, the start-of-training broadcast) is asked of this package.
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
    size,
)
from hvd_train.dist.layers import SyncBatchNormalization, convert_sync_batchnorm
from hvd_train.dist.optimizer import DistributedOptimizer, is_distributed
from hvd_train.dist.state import average_non_trainable, reduce_metrics_over_ranks

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_mean",
    "average_non_trainable",
    "barrier",
    "broadcast",
    "broadcast_model_state",
    "broadcast_object",
    "broadcast_variables",
    "build_info",
    "compute_threads",
    "controller",
    "convert_sync_batchnorm",
    "grouped_allreduce",
    "init",
    "is_chief",
    "is_distributed",
    "local_rank",
    "local_size",
    "rank",
    "reduce_metrics_over_ranks",
    "size",
]
