"""Starting and ending Horovod on this rank, and where this rank sits: the topology, the placement
(one GPU per local rank, a fair share of the CPU threads) and the settings Open MPI and Horovod read
when they start.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from hvd_train.comm import collectives, groups, linkprobe, reduction
from hvd_train.comm import horovod as backend
from hvd_train.core import environment, network, placement

log = logging.getLogger("hvd_train")


@dataclass(frozen=True)
class Topology:
    """Where this rank sits (Horovod's words): `rank` of `size` workers; `local_rank` of the
    `local_size` workers on its host; `cross_rank` of the `cross_size` hosts that have a worker of
    its local rank (the host index when every host runs as many workers)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


_compute_threads: int | None = None
_spare_cpu: bool | None = None
_oversubscribed: bool | None = None
_link_gbit: float | None = None
_link_from: str | None = None
GROUP_FUSION_OFF = "HOROVOD_DISABLE_GROUP_FUSION"
CACHE_CAPACITY = "HOROVOD_CACHE_CAPACITY"
# Horovod's response cache, in tensors: 64 times its default of 1024, so that every tensor of a
# step stays cached (docs/knobs.md). An entry is one response; entries in use cost a bit each in
# every cycle's cache sync, unused capacity nothing.
CACHE_ENTRIES = 65536


def init(
    threads: int | None = None,
    pin_gpu: bool = True,
    step_ms: float | None = None,
    process_sets: Sequence[Any] | None = None,
    model_group_size: int | None = None,
) -> None:
    """Start Horovod and place this rank: one GPU per local rank, a fair share of the CPU threads.

    Must run before TensorFlow executes its first op, since device visibility and thread pools are
    fixed from then on. Calling it again is a no-op. Enables `faulthandler`, so that a rank killed
    by a fatal signal in native code prints its Python stacks.

    Args:
      threads: intra- and inter-op threads for TensorFlow; None derives them from this rank's CPU
        affinity and the ranks on its host (`core.placement.compute_threads`).
      pin_gpu: make only the local rank's GPU visible, with memory growth.
      step_ms: the expected time of one training step on one rank (e.g. measured by an earlier
        run); None reads HVD_TRAIN_STEP_MS if set. Under Gloo on a CPU-only host whose cores the
        ranks fill, Horovod's cycle time is derived from it unless Horovod wakes on enqueue
        (`core.placement.cycle_time_ms`).
      process_sets: `comm.ProcessSet`s to register at start (every rank passes the same);
        more can be added later with `comm.add_process_set` under HOROVOD_DYNAMIC_PROCESS_SETS=1,
        which `init` sets itself where the launcher says the job spans hosts (for two-level
        reduction, `comm.reduction`) unless the user set it.

    Raises:
      RuntimeError: TensorFlow's runtime started before `init` (the placement cannot apply).
      LauncherEnvironmentError: a launcher or tuning variable that cannot be used.
      ValueError: `model_group_size` does not divide the launcher's ranks.
    """
    global _compute_threads
    if backend.is_started() and _compute_threads is not None:
        return
    if not faulthandler.is_enabled():
        # A rank killed by a fatal signal inside MPI, Horovod or TensorFlow prints its Python stacks
        # (all threads): in a job of many ranks the log then says which rank died, and where.
        with contextlib.suppress(ValueError, AttributeError, OSError, RuntimeError):
            faulthandler.enable(all_threads=True)  # fails only where stderr is no file (notebooks)
    launcher = environment.read(os.environ)
    gpus = len(tf.config.list_physical_devices("GPU"))
    host = placement.host_cpu_count()
    if threads is None and launcher.local_size is not None:
        # Ranks on a host share its cores: each takes its share, not one thread per core.
        threads = placement.compute_threads(
            placement.affinity_cpu_count(), host, launcher.local_size
        )
    _tune_before_start(launcher, threads, host, gpus, step_ms)
    _use_job_network(launcher)
    # Each grouped allreduce (a gradient bucket) is fused on its own, never with another group
    # that happens to be ready in the same cycle: the fused buffers, hence the order of the sums,
    # stay the same every step (bit-exact resume at any size).
    os.environ.setdefault(GROUP_FUSION_OFF, "1")
    # With group fusion off, Horovod 0.28.1 fails ("unordered_map::at") or hangs once its cache
    # evicts part of a group: a step of more grouped tensors than the cache holds (1024 by
    # default: a deep model's gradients) would never finish. A cache that holds them all.
    os.environ.setdefault(CACHE_CAPACITY, str(CACHE_ENTRIES))
    if reduction.wants_dynamic_process_sets(os.environ, launcher.size, launcher.local_size):
        # Across hosts: two-level reduction adds its process sets after the start, once Horovod
        # knows which ranks share a host.
        os.environ[reduction.DYNAMIC_ENV] = "1"
    process_sets = list(process_sets or [])
    if model_group_size is not None:
        # Model groups' sets are registered with the others: every rank passes the same list.
        ranks = launcher.size or 1
        process_sets += [
            collectives.ProcessSet(s) for s in groups.sets_to_register(ranks, model_group_size)
        ]
    backend.start(process_sets)
    collectives.remember_process_sets(process_sets)
    groups.set_job_group_size(model_group_size)
    local = topology()
    _check_world_size(launcher.size, local.size)
    if model_group_size is not None:
        groups.layout(local.size, model_group_size)  # a launcher that did not say its size
    physical = tf.config.list_physical_devices("GPU")
    if physical and pin_gpu:
        # One GPU per local rank: otherwise every rank allocates memory on GPU 0.
        gpu = physical[placement.gpu_for_local_rank(local.local_rank, len(physical))]
        if local.local_size > len(physical):
            log.warning("%d local ranks share %d GPU(s)", local.local_size, len(physical))
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    if threads is None:
        threads = placement.compute_threads(placement.affinity_cpu_count(), host, local.local_size)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError as err:
        raise RuntimeError(
            "hvd_train.init() must run before TensorFlow executes any op "
            f"(threads could not be set: {err})"
        ) from err
    _compute_threads = threads
    if local.rank == 0 and not onednn_in_effect():
        log.warning(
            "TensorFlow was imported before hvd_train, and its oneDNN CPU kernels are off on "
            "this CPU (its convolutions' gradients then run several times slower): import "
            "hvd_train first, or set %s=1 before Python starts",
            placement.ONEDNN_ENV,
        )
    _agree_on_place_and_link(launcher, threads, len(physical), local)


def _agree_on_place_and_link(
    launcher: environment.Launcher, threads: int, gpus: int, local: Topology
) -> None:
    """One value for the job, on every rank, of whether a core is spare, whether the cores are
    oversubscribed and the link rate: the gradient buckets follow them, and must be alike
    everywhere (collective)."""
    global _spare_cpu, _oversubscribed, _link_gbit, _link_from
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        # A worker joining an elastic job starts alone, with no peer to agree with: the job
        # takes one bucket, whatever its hosts and link (the same on every rank without a
        # collective).
        _spare_cpu, _oversubscribed, _link_gbit, _link_from = False, False, None, None
        return
    mine = (socket.gethostname(), placement.affinity_cpus(), threads, gpus)
    found = [(mine, launcher.link_gbit)]
    if local.size > 1:
        found = collectives.allgather_object(found[0])
    ranks = [place for place, _ in found]
    _spare_cpu, _oversubscribed = placement.spare_cpu(ranks), placement.oversubscribed(ranks)
    rates = [rate for _, rate in found]
    # The slowest link sets the job's pace; a rank that was not told leaves it unknown.
    _link_gbit = None if None in rates else min(rates)
    _link_from = None if _link_gbit is None else environment.LINK_GBIT
    hosts = [place[0] for place in ranks]
    if _link_gbit is None and len(set(hosts)) > 1 and not _spare_cpu and not _oversubscribed:
        # Where the compute fills CPU-only hosts the bucket size follows the link
        # (core.buckets): measure it, as --launcher auto would have (half a second a phase,
        # two or three phases).
        probed = linkprobe.measure(hosts, local.rank)
        _link_gbit = probed.gbit_s
        measured = "not measured" if probed.gbit_s is None else "measured at start"
        _link_from = f"{measured}: {probed.why}"
        if local.rank == 0 and probed.gbit_s is None:
            log.warning(
                "link rate %s: the gradient buckets take the slow link's choice; set %s to the "
                "rate in Gbit/s",
                _link_from,
                environment.LINK_GBIT,
            )


def onednn_enabled() -> bool | None:
    """Whether TensorFlow runs its oneDNN CPU kernels; None where it cannot say."""
    try:
        from tensorflow.python.util import _pywrap_util_port  # no public accessor
    except ImportError:
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def onednn_in_effect() -> bool:
    """False only where the toolkit asked for TensorFlow's oneDNN kernels and TensorFlow, loaded
    before it asked, runs without them."""
    return os.environ.get(placement.ONEDNN_ENV) != "1" or onednn_enabled() is not False


def _tune_before_start(
    launcher: environment.Launcher,
    threads: int | None,
    host: int,
    gpus: int,
    step_ms: float | None,
) -> None:
    """Settings Open MPI and Horovod read at their start, derived where the user set none."""
    if threads is None or launcher.local_size is None:
        return
    # What the rules weigh the compute against: the CPUs the job has here, which a binding
    # narrows as much as a cgroup does.
    host = placement.job_cpus_before_start(
        placement.affinity_cpu_count(), host, launcher.local_size
    )
    if (
        launcher.controller == "mpi"
        and not launcher.user_set_mpi_yield
        and placement.mpi_should_yield(threads, launcher.local_size, host, gpus)
    ):
        os.environ[environment.MPI_YIELD] = "1"
    if launcher.controller is not None and not launcher.user_set_cycle_time:
        step = step_ms if step_ms is not None else launcher.step_ms
        cost = launcher.gloo_cycle_cost_ms or placement.GLOO_CYCLE_COST_MS
        wakes = backend.wakes_on_enqueue()
        cycle = placement.cycle_time_ms(
            launcher.controller, gpus, threads, launcher.local_size, host, step, cost, wakes
        )
        if cycle is not None:
            os.environ[environment.CYCLE_TIME] = f"{cycle:g}"
            why = "Horovod wakes on enqueue" if wakes else f"step {step:g} ms"
            log.info(
                "Horovod cycle time %g ms (%s, cores filled, %s)", cycle, launcher.controller, why
            )


def _use_job_network(launcher: environment.Launcher) -> None:
    """Point Open MPI and NCCL at the job's interface (`core.network`) where the user did not:
    across hosts, Open MPI's TCP transport otherwise tries every interface, and one whose address
    every host has (docker0) hangs the first collective."""
    spans_hosts = None not in (launcher.local_size, launcher.size) and (
        launcher.local_size < launcher.size
    )
    settings = network.rank_settings(os.environ, spans_hosts)
    if settings:
        os.environ.update(settings)
        log.debug("job network: %s", " ".join(f"{k}={v}" for k, v in sorted(settings.items())))


def spare_cpu() -> bool:
    """True where, on every host of the job, the compute leaves a core free or runs on GPUs
    (`core.placement.spare_cpu`, from every rank's host, affinity, threads and GPUs):
    communication then runs beside the compute instead of taking its cores. The same on every
    rank (agreed at `init`; False under Horovod Elastic, whose workers start at different
    times)."""
    if _spare_cpu is None:
        raise RuntimeError("hvd_train.init() has not run")
    return _spare_cpu


def oversubscribed() -> bool:
    """True where some CPU-only host of the job runs more compute threads than it has CPUs
    (`core.placement.oversubscribed`): its ranks take turns on the cores. The same on every rank
    (agreed at `init`; False under Horovod Elastic)."""
    if _oversubscribed is None:
        raise RuntimeError("hvd_train.init() has not run")
    return _oversubscribed


def link_gbit() -> float | None:
    """The TCP rate between the job's hosts in Gbit/s: the lowest that any rank was given
    (HVD_TRAIN_LINK_GBIT: `hvd-train launch --launcher auto` measures and passes it), or, where
    none was given and the compute fills CPU-only hosts, what the ranks measured at `init`
    (`comm.linkprobe`); None otherwise, where that probe failed, and under Horovod Elastic. The
    same on every rank (agreed at `init`)."""
    if _spare_cpu is None:
        raise RuntimeError("hvd_train.init() has not run")
    return _link_gbit


def link_gbit_from() -> str | None:
    """Where `link_gbit` came from: "HVD_TRAIN_LINK_GBIT"; "measured at start: " and the link
    that set it; "not measured: " and why (the rate is then None); None where nothing asked."""
    if _spare_cpu is None:
        raise RuntimeError("hvd_train.init() has not run")
    return _link_from


def compute_threads() -> int:
    """The intra-op thread count `init` gave this rank."""
    if _compute_threads is None:
        raise RuntimeError("hvd_train.init() has not run")
    return _compute_threads


def topology() -> Topology:
    """This rank's place in the job (after `init`)."""
    return Topology(*backend.topology())


def rank() -> int:
    """This process's rank among all workers (0 .. size-1)."""
    return backend.rank()


def size() -> int:
    """Number of workers in the job."""
    return backend.size()


def local_rank() -> int:
    """This process's rank among the workers on its host."""
    return topology().local_rank


def local_size() -> int:
    """Number of workers on this host."""
    return topology().local_size


def cross_rank() -> int:
    """The index of this rank's host among the hosts (homogeneous jobs)."""
    return topology().cross_rank


def cross_size() -> int:
    """Number of hosts with a worker of this rank's local rank."""
    return topology().cross_size


def is_chief() -> bool:
    """True on rank 0, the rank that alone writes files (checkpoints, logs, plots)."""
    return backend.rank() == 0


def controller() -> str:
    """The Horovod controller of this job: "mpi" or "gloo"."""
    return backend.controller()


def build_info() -> dict[str, bool]:
    """What this Horovod build contains (as `horovodrun --check-build` reports)."""
    return backend.build_info()


def reduces_bfloat16() -> bool:
    """Whether this Horovod's collectives take tf.bfloat16 (bf16 compression): the installer's
    build does (mpi_scripts/patches), Horovod 0.28.1 itself does not. Needs no `init`."""
    return backend.reduces_bfloat16()


def pending_cycle_time_ms() -> float | None:
    """How soon Horovod's loop comes back while a tensor enqueued here waits for the other
    ranks' (ms; HOROVOD_PENDING_CYCLE_TIME on the installer's build, docs/performance.md); None
    on a build without hvd_train's patch."""
    return backend.pending_cycle_time_ms()


def mpi_threads_supported() -> bool:
    """Whether this job's MPI runs with multi-threading (so mpi4py may share it); after init.

    Raises:
      ValueError: the controller is not MPI.
    """
    return backend.mpi_threads_supported()


def _check_world_size(launched: int | None, size: int) -> None:
    """A launcher that started N workers which Horovod did not join into one job (srun without
    PMIx starts N one-rank jobs) would train N unrelated models, each on 1/N of its data."""
    if launched is None or launched == size or os.environ.get("HOROVOD_ELASTIC") == "1":
        return  # elastic: the set of workers changes by design
    raise environment.LauncherEnvironmentError(
        f"the launcher started {launched} workers but Horovod joined {size} of them into this "
        "job: start them with a launcher Horovod's build joins (mpirun, horovodrun, or srun "
        "--mpi=pmix for Open MPI; `hvd-train doctor` shows the build)"
    )


def is_initialized() -> bool:
    """True once Horovod runs in this process (after `init`, before `shutdown`)."""
    return backend.is_started()


def shutdown() -> None:
    """End Horovod on every rank at one point (call it on every rank): a barrier, then the shutdown
    (under mpirun, Horovod's background thread finalizes MPI).

    Without it, the first rank to exit ends Horovod for all (its request travels in the next
    cycle), and the others finalize MPI in the background while their main threads still work.
    Collectives fail afterwards.
    """
    collectives.barrier()
    backend.stop()
    reduction.forget()
