"""The seam between hvd_train and Horovod: the topology of this job and its collectives.

Everything distributed that the rest of the toolkit needs is asked of this package:

- topology: `init`, `topology()` (rank, size, local and cross rank and size), `rank`, `size`,
  `is_chief`, `controller`, `build_info`, `shutdown`;
- process sets: `ProcessSet`, `add_process_set`, `remove_process_set`, `process_set_ranks`,
  `process_set_of` (the job's one set of given ranks, shared by its users); every collective takes
  `process_set=` (None: all ranks);
- model groups (`comm.groups`): `model_groups()`, this rank's group of G consecutive ranks for model
  parallelism inside it and its replicas in the other groups (`init(model_group_size=G)`);
- collectives: `allreduce`, `grouped_allreduce`, `allreduce_groups` (an ordered list of groups,
  for buckets; `reduction="two_level"` reduces within each host, then across hosts, then
  within each host again, and `resolve_reduction` picks flat or two-level for the job:
  `comm.reduction`), `broadcast`, `broadcast_variables`, `broadcast_object`, `allgather`,
  `allgather_object`, `grouped_allgather`, `grouped_reducescatter`, `alltoall`, `barrier`, `join`;
- elastic hooks (`comm.elastic`: reset, hosts changed, the run loop) and Horovod's timeline
  (`comm.timeline`).

Only `hvd_train.comm.horovod` (the backend) imports horovod; import-linter enforces it in
`make lint`. Keras-version differences live in `hvd_train.keras`, not here.
"""

from hvd_train.comm.collectives import (
    Average,
    Compression,
    Max,
    Min,
    ProcessSet,
    ProcessSetUnavailable,
    Sum,
    add_process_set,
    allgather,
    allgather_object,
    allreduce,
    allreduce_groups,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    global_process_set,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    process_set_of,
    process_set_ranks,
    remove_process_set,
)
from hvd_train.comm.groups import ModelGroups, model_groups
from hvd_train.comm.reduction import REDUCTIONS, resolve_reduction
from hvd_train.comm.runtime import (
    Topology,
    build_info,
    compute_threads,
    controller,
    cross_rank,
    cross_size,
    init,
    is_chief,
    is_initialized,
    link_gbit,
    link_gbit_from,
    local_rank,
    local_size,
    mpi_threads_supported,
    oversubscribed,
    pending_cycle_time_ms,
    rank,
    reduces_bfloat16,
    shutdown,
    size,
    spare_cpu,
    topology,
)

__all__ = [
    "REDUCTIONS",
    "Average",
    "Compression",
    "Max",
    "Min",
    "ModelGroups",
    "ProcessSet",
    "ProcessSetUnavailable",
    "Sum",
    "Topology",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_groups",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "build_info",
    "compute_threads",
    "controller",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_chief",
    "is_initialized",
    "join",
    "link_gbit",
    "link_gbit_from",
    "local_rank",
    "local_size",
    "model_groups",
    "mpi_threads_supported",
    "oversubscribed",
    "pending_cycle_time_ms",
    "process_set_of",
    "process_set_ranks",
    "rank",
    "reduces_bfloat16",
    "remove_process_set",
    "resolve_reduction",
    "shutdown",
    "size",
    "spare_cpu",
    "topology",
]
