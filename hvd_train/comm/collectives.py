"""The collectives: every rank of the process set calls each one, in the same order, with the same
names and shapes, or the job hangs. Gate side effects by rank, never collectives.

Each takes an optional `process_set` (None: all ranks). Names (`name=`) identify a collective
across ranks; the toolkit's own start with "hvd_train.".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import tensorflow as tf

from hvd_train.comm import horovod as backend

Average = backend.Average
Sum = backend.Sum
Min = backend.Min
Max = backend.Max
Compression = backend.Compression
ProcessSet = backend.ProcessSet
global_process_set = backend.global_process_set
# Horovod reads it at start: process sets may be added after it (`add_process_set`).
DYNAMIC_ENV = "HOROVOD_DYNAMIC_PROCESS_SETS"


def add_process_set(ranks: Sequence[int]) -> Any:
    """Register a process set of these ranks after `init` (collective over all ranks; needs
    HOROVOD_DYNAMIC_PROCESS_SETS=1 in the launcher's environment) and return it."""
    return backend.add_process_set(ranks)


def remove_process_set(process_set: Any) -> bool:
    """Unregister a process set made by `add_process_set` (collective over all ranks)."""
    return backend.remove_process_set(process_set)


class ProcessSetUnavailable(RuntimeError):
    """A process set that was not registered at start and cannot be added after it."""


# The process sets known by their ranks: registered at start (`remember_process_sets`) or added
# later; each rank list has one, which two-level reduction and model groups share.
_known_sets: dict[tuple[int, ...], Any] = {}


def remember_process_sets(process_sets: Iterable[Any]) -> None:
    """Note the process sets registered at Horovod's start, by their ranks."""
    for process_set in process_sets:
        _known_sets[tuple(process_set_ranks(process_set))] = process_set


def forget_process_sets() -> None:
    """Drop the known process sets (Horovod stopped)."""
    _known_sets.clear()


def process_set_of(ranks: Sequence[int]) -> Any:
    """The process set of exactly these ranks (None: all ranks): the one registered at start or
    added before, else one added now (a collective over all ranks: every rank asks for the same
    sets in the same order).

    Raises:
      ProcessSetUnavailable: a new set, and Horovod started without dynamic process sets.
    """
    key = tuple(sorted(int(r) for r in ranks))
    if len(key) == backend.size():
        return None
    if key not in _known_sets:
        if os.environ.get(DYNAMIC_ENV) != "1":
            raise ProcessSetUnavailable(
                f"no process set of ranks {list(key)} was registered at start, and Horovod "
                f"started without {DYNAMIC_ENV}=1"
            )
        _known_sets[key] = backend.add_process_set(list(key))
    return _known_sets[key]


def process_set_ranks(process_set: Any = None) -> list[int]:
    """The ranks of a process set (None: all ranks), ascending."""
    return backend.process_set_ranks(process_set)


def allreduce(
    tensor: Any,
    op: Any = Average,
    name: str | None = None,
    process_set: Any = None,
    **kwargs: Any,
) -> tf.Tensor:
    """Reduce one tensor over the ranks (Average, Sum, Min, Max); every rank gets the result.
    `kwargs`: Horovod's (compression, prescale_factor, postscale_factor)."""
    return backend.allreduce(tf.convert_to_tensor(tensor), op, name, process_set, **kwargs)


def grouped_allreduce(
    tensors: Sequence[Any], op: Any = Average, process_set: Any = None, **kwargs: Any
) -> list[tf.Tensor]:
    """Reduce several tensors in one fused Horovod operation. `kwargs`: Horovod's (name,
    compression, prescale_factor, postscale_factor)."""
    converted = [tf.convert_to_tensor(t) for t in tensors]
    return backend.grouped_allreduce(converted, op, process_set, **kwargs)


# Plain Python over the groups' structure: AutoGraph (inside a tf.function) has nothing to
# convert, and converting this module and the two-level one costs seconds at every trace.
@tf.autograph.experimental.do_not_convert
def allreduce_groups(
    groups: Sequence[Sequence[Any]],
    op: Any = Average,
    process_set: Any = None,
    reduction: str = "flat",
    local_groups: Sequence[Sequence[int]] | None = None,
    **kwargs: Any,
) -> list[list[tf.Tensor]]:
    """One grouped allreduce per group, issued in the order given (e.g. buckets of gradients in
    the order the backward pass makes them); the results in the same structure. Empty groups are
    skipped (on every rank alike: the group structure must be the same everywhere).

    Args:
      groups: the groups of tensors.
      op: the reduction (two-level: Average or Sum).
      process_set: the ranks to reduce over (None: all; two-level: all only).
      reduction: "flat" (one grouped allreduce per group) or "two_level" (per group: within each
        host a reduce-scatter, across hosts an allreduce among the ranks of equal local rank,
        within each host an allgather; `comm.reduction`). `comm.resolve_reduction` picks it.
      local_groups: two-level only: the ranks of each host, for tests that emulate hosts on one
        machine; None: the job's hosts.
      **kwargs: Horovod's (compression, prescale_factor, postscale_factor; flat also name).

    Returns:
      Per group, the reduced tensors (same shapes and dtypes).

    Raises:
      ValueError: an unknown reduction; two-level with a process set, another op, or unusable
        local groups.
    """
    if reduction == "flat":
        return [
            grouped_allreduce(group, op, process_set, **kwargs) if group else [] for group in groups
        ]
    if reduction != "two_level":
        raise ValueError(f"reduction {reduction!r}: expected 'flat' or 'two_level'")
    if process_set is not None and process_set_ranks(process_set) != list(range(backend.size())):
        raise ValueError("two-level reduction runs over all ranks only (process_set=None)")
    from hvd_train.comm import reduction as two_level  # imports this module

    return [
        two_level.two_level_allreduce(group, op, local_groups, **kwargs) if group else []
        for group in groups
    ]


def allgather(tensor: Any, name: str | None = None, process_set: Any = None) -> tf.Tensor:
    """Concatenate every rank's tensor along the first axis, in rank order."""
    return backend.allgather(tf.convert_to_tensor(tensor), name, process_set)


def grouped_allgather(tensors: Sequence[Any], process_set: Any = None) -> list[tf.Tensor]:
    """`allgather` of each tensor, in one fused operation."""
    converted = [tf.convert_to_tensor(t) for t in tensors]
    return backend.grouped_allgather(converted, process_set)


def broadcast(
    tensor: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None
) -> tf.Tensor:
    """Root's value of a tensor, on every rank."""
    return backend.broadcast(tf.convert_to_tensor(tensor), root_rank, name, process_set)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None
) -> Any:
    """Root's Python object (pickled), on every rank."""
    return backend.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's Python object, as a list in rank order."""
    return backend.allgather_object(obj, name, process_set)


def grouped_reducescatter(
    tensors: Sequence[Any], op: Any = Average, process_set: Any = None, **kwargs: Any
) -> list[tf.Tensor]:
    """Reduce each tensor over the ranks and leave rank r its r-th slice of the first axis
    (slices as even as the length allows, the first ones one longer), in one fused operation."""
    converted = [tf.convert_to_tensor(t) for t in tensors]
    return backend.grouped_reducescatter(converted, op, process_set, **kwargs)


def alltoall(
    tensor: Any, splits: Any = None, name: str | None = None, process_set: Any = None
) -> tuple[tf.Tensor, tf.Tensor]:
    """Send `splits[r]` rows (first axis; None: equal parts) of the tensor to rank r; returns the
    rows received, concatenated in rank order, and how many came from each rank."""
    tensor = tf.convert_to_tensor(tensor)
    if splits is None:
        # Horovod returns the received splits only when given splits: equal parts, explicitly.
        ranks = len(process_set_ranks(process_set))
        splits = tf.fill([ranks], tf.shape(tensor, out_type=tf.int32)[0] // ranks)
    return backend.alltoall(tensor, splits, name, process_set)


def barrier(process_set: Any = None) -> None:
    """Block until every rank (of the process set) has reached this point."""
    zero = tf.constant(0.0)
    allreduce(zero, op=Sum, name="hvd_train.barrier", process_set=process_set).numpy()


def join() -> int:
    """This rank has no more batches: take part in the others' allreduces with zeros until every
    rank has joined (uneven inputs). Returns the last rank to join."""
    return backend.join()


def broadcast_variables(
    variables: Iterable[Any], root_rank: int = 0, process_set: Any = None
) -> None:
    """Assign root's values to these variables (Keras or tf.Variable) on every rank.

    The broadcasts run inside one tf.function, so Horovod sees them together and fuses them into a
    few messages instead of one round trip per variable.
    """
    variables = list(variables)
    if len(process_set_ranks(process_set)) == 1 or not variables:
        return

    # A plain Python loop, unrolled at tracing: no AutoGraph (which warns about the closure each
    # time a new function is made, e.g. at every elastic sync).
    @tf.function(autograph=False)
    def broadcast_all() -> None:
        for i, var in enumerate(variables):
            value = backend.broadcast(var, root_rank, f"hvd_train.bcast.{i}", process_set)
            var.assign(value)

    broadcast_all()
