"""Horovod's `horovod.tensorflow.keras` functions on the toolkit's seams: the basics, the
collectives on Keras/TF values, DistributedOptimizer, PartialDistributedOptimizer and load_model.

Each keeps Horovod's signature and defaults. What differs (docs/horovod.md has the table):
`init` is the toolkit's (one GPU per local rank, threads per rank) and `shutdown` a collective
(a barrier first); the collectives are eager and return tensors, as Horovod's Keras ones do in
TensorFlow 2; Adasum is refused; DistributedOptimizer changes the optimizer it is given in place
(Keras 3) and averages at the top of `apply`, before clipping and the loss-scale check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from hvd_train import comm as seam
from hvd_train.keras import optimizer as optimizer_lib

Average = seam.Average
Sum = seam.Sum
Min = seam.Min
Max = seam.Max
Compression = seam.Compression
ProcessSet = seam.ProcessSet
global_process_set = seam.global_process_set
add_process_set = seam.add_process_set
remove_process_set = seam.remove_process_set
size = seam.size
rank = seam.rank
local_size = seam.local_size
local_rank = seam.local_rank
cross_size = seam.cross_size
cross_rank = seam.cross_rank
is_initialized = seam.is_initialized
shutdown = seam.shutdown


class _ReduceOp:
    """A reduction Horovod names that the toolkit's collectives do not carry as such."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


Product = _ReduceOp("Product")  # an allgather, then the product over ranks
Adasum = _ReduceOp("Adasum")  # refused: see _check_op


def init(comm: Any = None, process_sets: Sequence[Any] | None = None) -> None:
    """Start Horovod, as `hvd.init()`; the toolkit's init, so it also places this rank: one GPU per
    local rank and its share of the CPU threads, with memory growth on every GPU. A script's own
    GPU set-up after it (memory growth, `set_visible_devices(gpus[hvd.local_rank()])`) asks for
    what is set already, so it still works.

    Args:
      comm: Horovod's sub-communicator (an mpi4py communicator or a list of ranks); only None
        (all ranks): use `process_sets` for subsets.
      process_sets: ProcessSets to register at start (every rank passes the same).

    Raises:
      ValueError: a `comm` other than None.
    """
    if comm is not None:
        raise ValueError(
            "init(comm=...): a sub-communicator is not supported; start on all ranks and pass "
            "process_sets=[hvd.ProcessSet(ranks)] instead"
        )
    for gpu in tf.config.list_physical_devices("GPU"):
        # Horovod scripts set memory growth on every GPU after init, when TensorFlow has started
        # (init runs collectives) and a change would raise: set here first, theirs is a no-op.
        tf.config.experimental.set_memory_growth(gpu, True)
    seam.init(process_sets=process_sets)


def mpi_enabled() -> bool:
    """True if this job's controller is MPI (mpirun, or horovodrun --mpi)."""
    return seam.controller() == "mpi"


def gloo_enabled() -> bool:
    """True if this job's controller is Gloo (horovodrun's default)."""
    return seam.controller() == "gloo"


def mpi_built() -> bool:
    """True if Horovod was built with MPI."""
    return seam.build_info()["mpi"]


def gloo_built() -> bool:
    """True if Horovod was built with Gloo."""
    return seam.build_info()["gloo"]


def nccl_built() -> int:
    """1 if Horovod was built with NCCL, else 0 (Horovod returns NCCL's version number)."""
    return int(seam.build_info()["nccl"])


def cuda_built() -> bool:
    """True if Horovod was built with CUDA."""
    return seam.build_info()["cuda"]


def rocm_built() -> bool:
    """False: the toolkit's Horovod build (mpi_scripts/install.sh) is for CPUs and CUDA only."""
    return False


def ddl_built() -> bool:
    """False: the toolkit's Horovod build (mpi_scripts/install.sh) has no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: the toolkit's Horovod build (mpi_scripts/install.sh) has no oneCCL."""
    return False


def mpi_threads_supported() -> bool:
    """Whether MPI runs multi-threaded in this job (mpi4py may then share it), as Horovod's.

    Raises:
      ValueError: the controller is not MPI (Horovod's own raises alike).
    """
    return seam.mpi_threads_supported()


def _check_op(op: Any) -> None:
    if op is Adasum:
        raise ValueError(
            "op=Adasum is not supported by hvd_train.horovod (use Average or Sum; Adasum needs "
            "Horovod's own Keras layer, which Keras 3 breaks)"
        )


def _op(average: bool | None, op: Any) -> Any:
    """Horovod's rule: `average` (deprecated) or `op`, not both; neither means Average."""
    if average is not None and op is not None:
        raise ValueError("allreduce: give op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    _check_op(op)
    return op


def _set(process_set: Any) -> Any:
    return None if process_set is global_process_set else process_set


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = Compression.none,
    process_set: Any = global_process_set,
) -> tf.Tensor:
    """Reduce a tensor-compatible value over the ranks (collective); every rank gets the result.

    Args:
      value: a number, array, tensor or variable, of the same shape on every rank.
      name: the collective's name (the same on every rank), or None.
      average: deprecated (Horovod's): True for Average, False for Sum.
      prescale_factor, postscale_factor: multiply before and after the reduction.
      op: Average (default), Sum, Min, Max or Product.
      compression: Compression.none, Compression.fp16 or Compression.bf16 (hvd_train's).
      process_set: the ranks to reduce over.

    Returns:
      The reduced value, an eager tensor (as Horovod's Keras allreduce in TensorFlow 2).

    Raises:
      ValueError: both `average` and `op`, or op=Adasum.
    """
    op = _op(average, op)
    tensor = tf.convert_to_tensor(value)
    if op is Product:
        gathered = seam.allgather(tensor[tf.newaxis], name=name, process_set=_set(process_set))
        return tf.reduce_prod(gathered * prescale_factor, axis=0) * postscale_factor
    return seam.allreduce(
        tensor,
        op=op,
        name=name,
        process_set=_set(process_set),
        compression=compression,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[tf.Tensor]:
    """Reduce several values in one fused operation (collective); `device_*` are accepted and
    unused (Horovod places its ops by its build). Other arguments as `allreduce` (not Product).

    Returns:
      The reduced tensors, in order.
    """
    op = _op(average, op)
    if op is Product:
        return [allreduce(t, op=Product, process_set=process_set) for t in tensors]
    return seam.grouped_allreduce(
        list(tensors),
        op=op,
        process_set=_set(process_set),
        compression=compression,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


def allgather(value: Any, name: str | None = None, process_set: Any = global_process_set) -> Any:
    """Every rank's value concatenated along the first axis, in rank order (collective; the
    first dimension may differ between ranks)."""
    return seam.allgather(value, name=name, process_set=_set(process_set))


def broadcast(
    value: Any, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> tf.Tensor:
    """Root's value on every rank (collective)."""
    return seam.broadcast(value, root_rank, name=name, process_set=_set(process_set))


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Any:
    """Root's Python object (pickled) on every rank (collective); `session` is TF1's, unused."""
    return seam.broadcast_object(obj, root_rank, name=name, process_set=_set(process_set))


def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: Any = global_process_set
) -> list[Any]:
    """Every rank's Python object, a list in rank order (collective)."""
    return seam.allgather_object(obj, name=name, process_set=_set(process_set))


def reducescatter(
    value: Any,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce over the ranks and keep this rank's slice of the first axis (collective; slices as
    even as the length allows, the first ones one longer). Average or Sum."""
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter: op must be Average or Sum, got {op!r}")
    return seam.grouped_reducescatter(
        [value],
        op=op,
        process_set=_set(process_set),
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )[0]


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Any:
    """Send `splits[r]` rows of the first axis to rank r (collective).

    Returns:
      The rows received, in rank order; with `splits` given (Horovod's rule), a tuple of them and
      how many came from each rank. None: equal parts.
    """
    received, counts = seam.alltoall(tensor, splits, name=name, process_set=_set(process_set))
    return received if splits is None else (received, counts)


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: int | list[list[Any]] | None = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """An optimizer that averages (or sums) its gradients over the ranks before each update.

    `hvd_train.keras.optimizer.DistributedOptimizer` with Horovod's arguments and defaults: the
    allreduce runs at the top of Keras 3's `apply`, before gradient clipping and a
    LossScaleOptimizer's finite check. The optimizer passed in is changed in place and returned
    (pass the result to `compile`); it keeps its class, config and saved form.

    Args:
      optimizer: a Keras 3 optimizer.
      name, device_dense, device_sparse: accepted, unused (Keras 3 optimizers' names are fixed
        at construction; Horovod places its ops by its build).
      compression: Compression.none, Compression.fp16 or Compression.bf16 (hvd_train's).
      sparse_as_dense: accepted; sparse gradients are always densified into their bucket.
      gradient_predivide_factor: with Average, divide by it before the sum, by size/it after.
      op: Average or Sum.
      backward_passes_per_step: gradients of this many batches are summed locally, then
        allreduced once and applied.
      average_aggregated_gradients: divide that sum by `backward_passes_per_step` (Horovod's
        default False: the sum).
      num_groups: deprecated (Horovod's): `groups` as an int.
      groups: n > 0: the gradients in n fused allreduces of near equal count, in variable order;
        or lists of variables, one fused allreduce each (the rest one apiece); None: the
        toolkit's buckets.
      process_set: the ranks to reduce over.
      scale_local_gradients: divide the gradients of `register_local_var` variables by the
        number of ranks.

    Returns:
      The optimizer, distributed.

    Raises:
      ValueError: op other than Average or Sum, bad groups, or what the toolkit's optimizer
        refuses (a built or already distributed optimizer).
    """
    _check_op(op)
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be Average or Sum, got {op!r}")
    if num_groups and groups is None:
        groups = num_groups
    return optimizer_lib.DistributedOptimizer(
        optimizer,
        op=op,
        compression=compression,
        gradient_predivide_factor=gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=_set(process_set),
        scale_local_gradients=scale_local_gradients,
    )


def PartialDistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    local_layers: Sequence[Any] | None = None,
    **kwargs: Any,
) -> keras.optimizers.Optimizer:
    """DistributedOptimizer whose `local_layers` keep their gradients local (never allreduced;
    divided by the number of ranks if `scale_local_gradients`), as Horovod's
    PartialDistributedGradientTape does for a GradientTape.

    Args:
      optimizer: a Keras 3 optimizer.
      local_layers: built layers whose trainable weights stay local.
      **kwargs: DistributedOptimizer's.

    Returns:
      The optimizer, distributed, with the layers' weights registered as local.

    Raises:
      ValueError: a local layer without weights (not built yet), or DistributedOptimizer's.
    """
    distributed = DistributedOptimizer(optimizer, **kwargs)
    for layer in local_layers or ():
        if not layer.trainable_weights:
            raise ValueError(f"local layer {layer.name!r} has no trainable weights: build it first")
        for var in layer.trainable_weights:
            distributed.register_local_var(var)
    return distributed


def load_model(
    filepath: Any,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Any = Compression.none,
    legacy_opts: bool = False,
) -> keras.Model:
    """Load a saved Keras model whose optimizer comes back distributed, its state (slots,
    iterations) restored, ready to train on.

    Args:
      filepath: a `.keras` file (or what `keras.models.load_model` reads).
      custom_optimizers: optimizer classes of the saved model outside `keras.optimizers`.
      custom_objects: further classes or functions the model needs.
      compression: the DistributedOptimizer's compression.
      legacy_opts: Keras 2's legacy optimizers; refused (Keras 3 has none).

    Returns:
      The model, compiled with a DistributedOptimizer (Horovod's defaults otherwise).

    Raises:
      ValueError: legacy_opts, or a saved model without an optimizer.
    """
    if legacy_opts:
        raise ValueError("load_model(legacy_opts=True): Keras 3 has no legacy optimizers")
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    saved = getattr(model, "optimizer", None)
    if saved is None:
        raise ValueError(f"load_model: {filepath} holds no compiled optimizer to distribute")
    # Keras built and restored the saved optimizer; a new one of its class and config is
    # distributed (the toolkit's takes only unbuilt ones), built, and given the saved state.
    fresh = type(saved).from_config(saved.get_config())
    fresh = DistributedOptimizer(fresh, compression=compression)
    fresh.build(model.trainable_variables)
    fresh.load_own_variables({str(i): v.numpy() for i, v in enumerate(saved.variables)})
    model.optimizer = fresh
    model.train_function = None  # traced with the saved optimizer
    return model
