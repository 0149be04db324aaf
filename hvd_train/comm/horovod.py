"""Process topology and collectives: the toolkit's one door to Horovod (both stacks).

Every collective here must be called by every rank, in the same order, with the same names and
shapes: gate side effects by rank, never collectives, or the job hangs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvd_train.dist import devices, stack

log = logging.getLogger(__name__)

Average = hvd.Average
Sum = hvd.Sum
Compression = hvd.Compression

_compute_threads: int | None = None


def init(threads: int | None = None, pin_gpu: bool = True, step_ms: float | None = None) -> None:
    """Start Horovod and place this rank: one GPU per local rank, a fair share of the CPU threads.

    Must run before TensorFlow executes its first op, since device visibility and thread pools are
    fixed from then on. Calling it again is a no-op. Enables `faulthandler`, so that a rank killed
    by a fatal signal in native code prints its Python stacks.

    Args:
      threads: intra- and inter-op threads for TensorFlow; None derives them from this rank's CPU
        affinity and the ranks on its host (`devices.compute_threads`).
      pin_gpu: make only the local rank's GPU visible, with memory growth.
      step_ms: the expected time of one training step on one rank (e.g. measured by an earlier
        run); None reads HVD_TRAIN_STEP_MS if set. Under Gloo on a CPU-only host whose cores the
        ranks fill, Horovod's cycle time is derived from it (`devices.gloo_cycle_time_ms`).

    Raises:
      RuntimeError: TensorFlow's runtime started before `init` (the placement cannot apply).
    """
    global _compute_threads
    if hvd.is_initialized() and _compute_threads is not None:
        return
    if not faulthandler.is_enabled():
        # A rank killed by a fatal signal inside MPI, Horovod or TensorFlow prints its Python stacks
        # (all threads): in a job of many ranks the log then says which rank died, and where.
        with contextlib.suppress(ValueError, AttributeError, OSError, RuntimeError):
            faulthandler.enable(all_threads=True)  # fails only where stderr is no file (notebooks)
    _tune_mpi(threads)
    _tune_gloo_cycle(threads, step_ms)
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and pin_gpu:
        # One GPU per local rank: otherwise every rank allocates memory on GPU 0.
        gpu = gpus[devices.gpu_for_local_rank(hvd.local_rank(), len(gpus))]
        if hvd.local_size() > len(gpus):
            log.warning("%d local ranks share %d GPU(s)", hvd.local_size(), len(gpus))
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    if threads is None:
        # Ranks on a host share its cores: each takes its share, not one thread per core.
        threads = devices.compute_threads(
            devices.affinity_cpu_count(), devices.host_cpu_count(), hvd.local_size()
        )
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError as err:
        raise RuntimeError(
            "hvd_train.dist.init() must run before TensorFlow executes any op "
            f"(threads could not be set: {err})"
        ) from err
    _compute_threads = threads


# Set before MPI starts, so only from the launcher's environment; a value the user set wins.
MPI_YIELD = "OMPI_MCA_mpi_yield_when_idle"


def _tune_mpi(threads: int | None) -> None:
    local_size = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if local_size is None or MPI_YIELD in os.environ:
        return
    host = devices.host_cpu_count()
    if threads is None:
        threads = devices.compute_threads(devices.affinity_cpu_count(), host, int(local_size))
    gpus = len(tf.config.list_physical_devices("GPU"))
    if devices.mpi_should_yield(threads, int(local_size), host, gpus):
        os.environ[MPI_YIELD] = "1"


# Read by Horovod at hvd.init(); a value the user set (or horovodrun --cycle-time-ms) wins.
CYCLE_TIME = "HOROVOD_CYCLE_TIME"
STEP_MS = "HVD_TRAIN_STEP_MS"


def _tune_gloo_cycle(threads: int | None, step_ms: float | None) -> None:
    if CYCLE_TIME in os.environ or os.environ.get("HOROVOD_CONTROLLER") != "gloo":
        return
    if step_ms is None and os.environ.get(STEP_MS):
        try:
            step_ms = float(os.environ[STEP_MS])
        except ValueError:
            raise ValueError(
                f"{STEP_MS} must be a number of milliseconds, got {os.environ[STEP_MS]!r}"
            ) from None
    local_size = int(os.environ.get("HOROVOD_LOCAL_SIZE", "1"))
    host = devices.host_cpu_count()
    if threads is None:
        threads = devices.compute_threads(devices.affinity_cpu_count(), host, local_size)
    gpus = len(tf.config.list_physical_devices("GPU"))
    cycle = devices.gloo_cycle_time_ms("gloo", gpus, threads, local_size, host, step_ms)
    if cycle is not None:
        os.environ[CYCLE_TIME] = f"{cycle:g}"
        log.info("Horovod cycle time %g ms (Gloo, cores filled, step %g ms)", cycle, step_ms)


def compute_threads() -> int:
    """The intra-op thread count `init` gave this rank."""
    if _compute_threads is None:
        raise RuntimeError("hvd_train.dist.init() has not run")
    return _compute_threads


def rank() -> int:
    """This process's rank among all workers (0 .. size-1)."""
    return hvd.rank()


def size() -> int:
    """Number of workers in the job."""
    return hvd.size()


def local_rank() -> int:
    """This process's rank among the workers on its host."""
    return hvd.local_rank()


def local_size() -> int:
    """Number of workers on this host."""
    return hvd.local_size()


def is_chief() -> bool:
    """True on rank 0, the rank that alone writes files (checkpoints, logs, plots)."""
    return hvd.rank() == 0


def controller() -> str:
    """The Horovod controller of this job: "mpi" or "gloo"."""
    return "mpi" if hvd.mpi_enabled() else "gloo"


def build_info() -> dict[str, bool]:
    """What this Horovod build contains (as `horovodrun --check-build` reports)."""
    return {
        "mpi": hvd.mpi_built(),
        "gloo": hvd.gloo_built(),
        "nccl": hvd.nccl_built() > 0,
        "cuda": hvd.cuda_built(),
    }


def allreduce(tensor: Any, op: Any = Average, name: str | None = None) -> tf.Tensor:
    """Reduce one tensor over all ranks (Average or Sum); every rank gets the result."""
    return hvd.allreduce(tf.convert_to_tensor(tensor), op=op, name=name)


def grouped_allreduce(tensors: list[Any], op: Any = Average, **kwargs: Any) -> list[tf.Tensor]:
    """Reduce several tensors in one fused Horovod operation (`hvd.grouped_allreduce`'s options)."""
    return hvd.grouped_allreduce([tf.convert_to_tensor(t) for t in tensors], op=op, **kwargs)


def allgather(tensor: Any, name: str | None = None) -> tf.Tensor:
    """Concatenate every rank's tensor along the first axis, in rank order."""
    return hvd.allgather(tf.convert_to_tensor(tensor), name=name)


def broadcast(tensor: Any, root_rank: int = 0, name: str | None = None) -> tf.Tensor:
    """Root's value of a tensor, on every rank."""
    return hvd.broadcast(tf.convert_to_tensor(tensor), root_rank, name=name)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Root's Python object (pickled), on every rank."""
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's Python object, as a list in rank order."""
    return hvd.allgather_object(obj, name=name)


def barrier() -> None:
    """Block until every rank has reached this point."""
    hvd.allreduce(tf.constant(0.0), op=Sum, name="hvd_train.barrier").numpy()


def shutdown() -> None:
    """End Horovod on every rank at one point (call it on every rank): a barrier, then the shutdown
    (under mpirun, Horovod's background thread finalizes MPI).

    Without it, the first rank to exit ends Horovod for all (its request travels in the next
    cycle), and the others finalize MPI in the background while their main threads still work.
    Collectives fail afterwards.
    """
    barrier()
    hvd.shutdown()


def allreduce_mean(values: Mapping[str, float]) -> dict[str, float]:
    """Average a dict of scalars over ranks, in one collective. Every rank must pass the same keys.

    Raises:
      ValueError: the ranks passed different keys (checked before any value is used).
    """
    keys = sorted(values)
    if size() > 1 and len(set(map(tuple, allgather_object(keys, name="hvd_train.mean_keys")))) != 1:
        raise ValueError(f"allreduce_mean: ranks passed different keys (rank {rank()}: {keys})")
    vector = np.array([float(values[k]) for k in keys], dtype=np.float64)
    mean = hvd.allreduce(tf.constant(vector), op=Average, name="hvd_train.mean").numpy()
    return dict(zip(keys, mean.tolist(), strict=True))


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0) -> None:
    """Assign root's values to these variables (Keras or tf.Variable) on every rank.

    The broadcasts run inside one tf.function, so Horovod sees them together and fuses them into a
    few messages instead of one round trip per variable.
    """
    variables = list(variables)
    if size() == 1 or not variables:
        return

    # A plain Python loop, unrolled at tracing: no AutoGraph (which warns about the closure each
    # time a new function is made, e.g. at every elastic sync).
    @tf.function(autograph=False)
    def broadcast_all() -> None:
        for i, var in enumerate(variables):
            var.assign(hvd.broadcast(var, root_rank, name=f"hvd_train.bcast.{i}"))

    broadcast_all()


def broadcast_model_state(model: Any, root_rank: int = 0) -> None:
    """Make every rank start from root's weights and optimizer state (collective).

    Builds the optimizer first if needed, so that its slots (momentum, ...) exist and are sent too;
    after a resume, the restored state travels the same way.

    Raises:
      ValueError: the model has no variables yet (build it, e.g. with keras.Input, first).
    """
    if not model.variables:
        raise ValueError(
            f"model {model.name!r} has no variables to broadcast: build it (keras.Input or "
            "model.build) before training"
        )
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables)
    if optimizer is not None:
        if not stack.optimizer_built(optimizer):
            optimizer.build(model.trainable_variables)
        variables += stack.optimizer_variables(optimizer)
    broadcast_variables(variables, root_rank)
