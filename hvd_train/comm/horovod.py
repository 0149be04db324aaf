"""The Horovod backend: the only module of hvd_train that imports horovod (import-linter checks).

Thin: each function is one Horovod call with the toolkit's defaults, so that `hvd_train.comm` (the
interface the rest of the tree asks) can document the contract once. Horovod 0.28.1, built by
`mpi_scripts/install.sh` against the installed TensorFlow (both stacks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import horovod.tensorflow as hvd
from horovod.common import elastic as hvd_elastic
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

Average = hvd.Average
Sum = hvd.Sum
Min = hvd.Min
Max = hvd.Max
ProcessSet = hvd.ProcessSet
global_process_set = hvd.global_process_set
ElasticState = hvd_elastic.State

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]


class BF16Compressor(hvd.Compression.fp16):
    """Floating tensors sent as bfloat16: half the bytes, as fp16, but with float32's exponent
    range (8 bits of mantissa against fp16's 11): gradients fp16 would overflow to inf or flush to
    0 keep their magnitude. Needs a Horovod that reduces tf.bfloat16: the installer's, built with
    mpi_scripts/patches/horovod-0.28.1-bfloat16.patch (`reduces_bfloat16`)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        import tensorflow as tf

        if tensor.dtype.is_floating and tensor.dtype != tf.bfloat16:
            return tf.cast(tensor, tf.bfloat16), tensor.dtype
        return tensor, tensor.dtype


class Compression(hvd.Compression):
    """Horovod's compressors (none, fp16) and hvd_train's bf16."""

    bf16 = BF16Compressor


def _set(process_set: Any) -> Any:
    return global_process_set if process_set is None else process_set


def start(process_sets: Sequence[Any] | None = None) -> None:
    """Horovod's init; `process_sets`: ProcessSets registered at start (None: dynamic only)."""
    if process_sets:
        hvd.init(process_sets=list(process_sets))
    else:
        hvd.init()


def stop() -> None:
    hvd.shutdown()


def is_started() -> bool:
    return bool(hvd.is_initialized())


def topology() -> tuple[int, int, int, int, int, int]:
    """(rank, size, local_rank, local_size, cross_rank, cross_size)."""
    return (
        hvd.rank(),
        hvd.size(),
        hvd.local_rank(),
        hvd.local_size(),
        hvd.cross_rank(),
        hvd.cross_size(),
    )


def rank() -> int:
    return hvd.rank()


def size() -> int:
    return hvd.size()


def wakes_on_enqueue() -> bool:
    """True where Horovod was built with hvd_train's wake-on-enqueue patch (mpi_scripts/patches):
    its background loop starts a request when it is enqueued, not at the next cycle."""
    from horovod.tensorflow import mpi_ops

    return hasattr(mpi_ops._basics.MPI_LIB_CTYPES, "horovod_wakes_on_enqueue")


def pending_cycle_time_ms() -> float | None:
    """The patched loop's cycle while a tensor enqueued here waits for the other ranks' (ms;
    HOROVOD_PENDING_CYCLE_TIME, read once by the library), or None on a build without it."""
    import ctypes

    from horovod.tensorflow import mpi_ops

    lib = mpi_ops._basics.MPI_LIB_CTYPES
    if not hasattr(lib, "horovod_pending_cycle_time_ms"):
        return None
    lib.horovod_pending_cycle_time_ms.restype = ctypes.c_double
    return float(lib.horovod_pending_cycle_time_ms())


def keeps_gloo_send_buffer() -> bool:
    """True where Horovod was built with hvd_train's gloo-send-buffer patch (mpi_scripts/patches):
    Gloo's TCP pairs never shrink the kernel's send buffer, so a ReduceScatter does not slow every
    later collective of its pair."""
    from horovod.tensorflow import mpi_ops

    return hasattr(mpi_ops._basics.MPI_LIB_CTYPES, "horovod_gloo_keeps_send_buffer")


def reduces_bfloat16() -> bool:
    """True where this Horovod's allreduce takes tf.bfloat16 (hvd_train's bfloat16 patch,
    mpi_scripts/patches): Horovod 0.28.1 itself has no bfloat16 type on any controller."""
    import tensorflow as tf
    from tensorflow.python.framework import op_def_registry

    op = op_def_registry.get("HorovodGroupedAllreduce")  # registered by importing horovod
    types = next(a.allowed_values.list.type for a in op.attr if a.name == "T")
    return tf.bfloat16.as_datatype_enum in types


def controller() -> str:
    return "mpi" if hvd.mpi_enabled() else "gloo"


def mpi_threads_supported() -> bool:
    return bool(hvd.mpi_threads_supported())


def build_info() -> dict[str, bool]:
    return {
        "mpi": hvd.mpi_built(),
        "gloo": hvd.gloo_built(),
        "nccl": hvd.nccl_built() > 0,
        "cuda": hvd.cuda_built(),
        "wakes_on_enqueue": wakes_on_enqueue(),
        "gloo_keeps_send_buffer": keeps_gloo_send_buffer(),
        "bfloat16": reduces_bfloat16(),
    }


def add_process_set(ranks: Sequence[int]) -> Any:
    return hvd.add_process_set(list(ranks))


def remove_process_set(process_set: Any) -> bool:
    return hvd.remove_process_set(process_set)


def process_set_ranks(process_set: Any) -> list[int]:
    if process_set is None or process_set.process_set_id == 0:
        return list(range(hvd.size()))
    return list(process_set.ranks)


def allreduce(tensor: Any, op: Any, name: str | None, process_set: Any, **kwargs: Any) -> Any:
    return hvd.allreduce(tensor, op=op, name=name, process_set=_set(process_set), **kwargs)


def grouped_allreduce(tensors: list[Any], op: Any, process_set: Any, **kwargs: Any) -> list[Any]:
    return hvd.grouped_allreduce(tensors, op=op, process_set=_set(process_set), **kwargs)


def allgather(tensor: Any, name: str | None, process_set: Any) -> Any:
    return hvd.allgather(tensor, name=name, process_set=_set(process_set))


def grouped_allgather(tensors: list[Any], process_set: Any) -> list[Any]:
    return hvd.grouped_allgather(tensors, process_set=_set(process_set))


def broadcast(tensor: Any, root_rank: int, name: str | None, process_set: Any) -> Any:
    return hvd.broadcast(tensor, root_rank, name=name, process_set=_set(process_set))


def broadcast_object(obj: Any, root_rank: int, name: str | None, process_set: Any) -> Any:
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name, process_set=_set(process_set))


def allgather_object(obj: Any, name: str | None, process_set: Any) -> list[Any]:
    return hvd.allgather_object(obj, name=name, process_set=_set(process_set))


def grouped_reducescatter(
    tensors: list[Any], op: Any, process_set: Any, **kwargs: Any
) -> list[Any]:
    return hvd.grouped_reducescatter(tensors, op=op, process_set=_set(process_set), **kwargs)


def alltoall(tensor: Any, splits: Any, name: str | None, process_set: Any) -> tuple[Any, Any]:
    return hvd.alltoall(tensor, splits=splits, name=name, process_set=_set(process_set))


def join() -> int:
    return int(hvd.join())


def start_timeline(path: str) -> None:
    hvd.start_timeline(path)


def stop_timeline() -> None:
    hvd.stop_timeline()


def elastic_run(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Horovod's common elastic run loop around `func(state, ...)`."""
    return hvd_elastic.run_fn(func, reset)


def keras2_distributed_optimizer(optimizer: Any, **kwargs: Any) -> Any:
    """Horovod's own `horovod.tensorflow.keras.DistributedOptimizer` (the classic stack only:
    importing Horovod's Keras layer fails on Keras 3)."""
    import horovod.tensorflow.keras as hvd_keras

    return hvd_keras.DistributedOptimizer(optimizer, **kwargs)


def keras2_allreduce_grads_fn(name: str, groups: list[list[Any]], **options: Any) -> Any:
    """The gradient allreduce Horovod's Keras 2 optimizer makes in its constructor, for explicit
    `groups` (lists of variables, known only once the step is traced); `options` as Horovod's
    (compression, sparse_as_dense, op, gradient_predivide_factor). Horovod caches it per groups."""
    return hvd._make_allreduce_grads_fn(
        name,
        "",
        "",
        options["compression"],
        options["sparse_as_dense"],
        options["op"],
        options["gradient_predivide_factor"],
        groups,
        process_set=global_process_set,
    )
