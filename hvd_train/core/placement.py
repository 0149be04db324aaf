"""Per-rank device placement: which GPU a rank uses and how many compute threads it runs.

Pure functions (no TensorFlow, no Horovod), unit-tested anywhere; `hvd_train.comm.init` applies them
before
TensorFlow's runtime starts. Ranks on one host share its cores and GPUs: without a split, N
TensorFlow processes each start one thread per core and contend, and every rank allocates all memory
of GPU 0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
# TensorFlow turns its oneDNN CPU kernels on by itself only on x86 CPUs with AVX-512 VNNI or BF16,
# AVX-VNNI or AMX; elsewhere (AVX2 CPUs: AMD EPYC before Zen 4, Intel before Cascade Lake) it runs
# Eigen's kernels, whose convolution gradients are several times slower on one thread.
ONEDNN_MACHINES = ("x86_64", "amd64")


def prefer_onednn(environ: dict[str, str] | os._Environ, machine: str) -> bool:
    """Turn on TensorFlow's oneDNN CPU kernels (`TF_ENABLE_ONEDNN_OPTS=1`) on an x86 `machine`
    unless the variable is set already (the user's choice wins, `0` keeps Eigen's kernels).
    TensorFlow reads it once, as it loads: this must run before it is imported. Returns whether
    it set the variable."""
    if ONEDNN_ENV in environ or machine.lower() not in ONEDNN_MACHINES:
        return False
    environ[ONEDNN_ENV] = "1"
    return True


def affinity_cpu_count() -> int:
    """CPUs this process may run on: its affinity mask (a launcher's binding, a cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no mask
        return os.cpu_count() or 1


def affinity_cpus() -> list[int]:
    """The CPUs of this process's affinity mask, ascending (all of them where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no mask
        return list(range(os.cpu_count() or 1))


def _host_loads(ranks: Sequence[tuple[str, Sequence[int], int, int]]) -> list[tuple[int, int, int]]:
    """Per host of the job: (its CPUs for the job, its ranks' compute threads, its GPUs), from
    each rank's (host name, affinity CPUs, compute threads, GPUs).

    A host's CPUs for the job are the union of its ranks' affinity masks: all its cores under
    `mpirun --bind-to none`, a scheduler's allocation where it binds, a container's or a test
    cluster's pinned CPUs.
    """
    hosts: dict[str, tuple[set[int], int, int]] = {}
    for host, cpus, threads, gpus in ranks:
        seen, total, gpu = hosts.get(host, (set(), 0, 0))
        hosts[host] = (seen | set(cpus), total + threads, gpu + gpus)
    return [(len(cpus), total, gpu) for cpus, total, gpu in hosts.values()]


def spare_cpu(ranks: Sequence[tuple[str, Sequence[int], int, int]]) -> bool:
    """Whether every host of the job keeps a core free of the ranks' compute (or computes on
    GPUs), from each rank's (host name, affinity CPUs, compute threads, GPUs): a host's compute
    fills its CPUs when its ranks' threads add up to as many (`_host_loads`)."""
    return all(gpu or threads < cpus for cpus, threads, gpu in _host_loads(ranks))


def oversubscribed(ranks: Sequence[tuple[str, Sequence[int], int, int]]) -> bool:
    """Whether some CPU-only host of the job runs more compute threads than it has CPUs for the
    job (its ranks then take turns on the cores), from the same per-rank tuples as `spare_cpu`."""
    return any(not gpu and threads > cpus for cpus, threads, gpu in _host_loads(ranks))


def host_load(cpus: int, slots: int, gpus: int) -> tuple[int, int, int]:
    """One host's (CPUs for the job, compute threads, GPUs), as `_host_loads` finds it once the
    job runs, for `slots` unbound ranks that each take their share of `cpus`
    (`compute_threads`): what a launcher can know of a host before it starts the ranks."""
    return cpus, slots * compute_threads(cpus, cpus, slots), gpus


def fills_cpu_hosts(loads: Sequence[tuple[int, int, int]]) -> bool:
    """Whether a job on hosts of these (CPUs, compute threads, GPUs), `host_load`, runs on two
    hosts or more, each CPU-only, its ranks' threads exactly filling its CPUs (no core spare,
    none shared). There the faster controller depends on the link (docs/network.md, "Which
    controller, by link rate"): Gloo, which overlaps the transfer with a busy core's compute, up
    to 2 Gbit/s; Open MPI from 3 Gbit/s, where Gloo's per-bucket negotiation costs more than it
    hides. Elsewhere Open MPI is level or ahead."""
    return len(loads) > 1 and all(not gpu and threads == cpus for cpus, threads, gpu in loads)


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU while NVIDIA's driver runs


def probe() -> dict[str, int]:
    """The CPUs a job's ranks get on this host (its affinity mask, which processes started here
    inherit, within `host_cpu_count`) and its NVIDIA GPUs, read without TensorFlow: a launcher
    asks every host before the ranks start."""
    gpus = len(list(NVIDIA_GPUS.iterdir())) if NVIDIA_GPUS.is_dir() else 0
    return {"cpus": min(host_cpu_count(), affinity_cpu_count()), "gpus": gpus}


def host_cpu_count(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs the host gives this job: the cgroup's cpuset and CPU quota (containers), else all."""
    cpus = os.cpu_count() or 1
    cpuset = cgroup / "cpuset.cpus.effective"
    if cpuset.is_file() and cpuset.read_text().strip():
        cpus = min(cpus, parse_cpu_list(cpuset.read_text()))
    quota = cgroup / "cpu.max"
    if quota.is_file():
        limit, period = [*quota.read_text().split(), "100000"][:2]
        if limit != "max":
            cpus = min(cpus, max(1, math.ceil(int(limit) / int(period))))
    return cpus


def job_cpus_before_start(mask_cpus: int, host_cpus: int, local_size: int) -> int:
    """The CPUs this host gives the job's ranks, as one rank can tell before Horovod starts (no
    other rank's mask is known yet): its own mask times the ranks on the host, within the host.

    That is the union of the ranks' masks (`_host_loads`, once the job runs) where the ranks are
    bound to disjoint CPUs (`mpirun --bind-to core`, `srun --cpu-bind`, pinned test hosts) or
    unbound, and an upper bound where their masks overlap. So compute threads that reach it fill
    the host's CPUs (or oversubscribe them) whatever the other masks are. `host_cpus` alone
    counts every core of a machine whose ranks a binding, not a cgroup, confines."""
    return min(host_cpus, mask_cpus * local_size)


def parse_cpu_list(text: str) -> int:
    """Number of CPUs in a Linux CPU list such as "0-3,8,10-11" (cpuset format)."""
    count = 0
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def compute_threads(mask_cpus: int, host_cpus: int, local_size: int) -> int:
    """Compute threads for one rank: its share of the host's CPUs, within its own affinity mask.

    Unbound ranks see the whole host in their mask and split it evenly; ranks bound to their own
    cores (`mpirun --bind-to core|socket`, `srun --cpu-bind`) keep at most the cores of their mask,
    and ranks bound to a shared socket still get only their share of the host.

    Args:
      mask_cpus: CPUs in this rank's affinity mask.
      host_cpus: CPUs the host gives the job (see `host_cpu_count`).
      local_size: ranks on this host.

    Returns:
      min(mask_cpus, host_cpus // local_size), at least 1.

    Raises:
      ValueError: a count that is not positive.
    """
    if min(mask_cpus, host_cpus, local_size) < 1:
        raise ValueError(
            f"CPU and rank counts must be positive, got mask_cpus={mask_cpus} "
            f"host_cpus={host_cpus} local_size={local_size}"
        )
    return max(1, min(mask_cpus, host_cpus // local_size))


def gpu_for_local_rank(local_rank: int, num_gpus: int) -> int | None:
    """Index of the GPU a rank uses (Horovod's rule: one GPU per local rank), or None without GPUs.

    More local ranks than GPUs share them round-robin: legal, but each shares memory and compute.

    Raises:
      ValueError: a negative `local_rank` or `num_gpus`.
    """
    if local_rank < 0 or num_gpus < 0:
        raise ValueError(f"local_rank and num_gpus must be >= 0, got {local_rank} and {num_gpus}")
    if num_gpus == 0:
        return None
    return local_rank % num_gpus


def mpi_should_yield(threads: int, local_size: int, host_cpus: int, gpus: int) -> bool:
    """Whether Open MPI should yield the core while it waits (`mpi_yield_when_idle`).

    Open MPI busy-polls inside blocking calls, and Horovod's background thread sits in such calls
    between its negotiation cycles. When the ranks' compute threads already fill every core of the
    host, that polling takes its core from a compute thread (docs/knobs.md has the measurement).
    Open MPI turns yielding on by itself only
    when ranks outnumber slots; this turns it on when the threads leave no core free. With GPUs
    the compute is elsewhere, and Horovod's and Open MPI's defaults stay.
    """
    return gpus == 0 and threads * local_size >= host_cpus


# Horovod's own default cycle (HOROVOD_CYCLE_TIME, ms), kept wherever `cycle_time_ms` does not
# apply.
HOROVOD_DEFAULT_CYCLE_MS = 1.0
# Compute time one Gloo negotiation cycle takes from a rank whose threads fill the cores (ms): a
# constant fitted on one machine (docs/knobs.md says how); HVD_TRAIN_GLOO_CYCLE_COST_MS overrides
# it.
GLOO_CYCLE_COST_MS = 1.5
# The cycle on a Horovod whose background loop wakes when a tensor is enqueued (hvd_train's patch,
# mpi_scripts/patches): a request no longer waits for the next cycle, so the cycle only paces the
# idle wakes, and a long one leaves the cores to the compute.
WAKING_CYCLE_MS = 50.0


def cycle_time_ms(
    controller: str,
    gpus: int,
    threads: int,
    local_size: int,
    host_cpus: int,
    step_ms: float | None,
    cycle_cost_ms: float = GLOO_CYCLE_COST_MS,
    wakes_on_enqueue: bool = False,
) -> float | None:
    """Horovod's cycle time (ms) for a job whose compute threads fill a CPU-only host, or None
    where Horovod's default (1 ms) should stay.

    Horovod's background thread wakes once per cycle, whether or not a collective is pending:
    under Gloo it negotiates with every other rank over TCP each time, under Open MPI it runs a
    collective of its own. When the ranks' threads already fill every core, each wake takes
    compute time from them.

    Where Horovod's loop wakes when a tensor is enqueued (`wakes_on_enqueue`, the installer's
    patched build, whose loop also cycles at 1 ms while an enqueued tensor waits for the other
    ranks'), a request never waits for a cycle: the cycle is `WAKING_CYCLE_MS` under either
    controller, step time or not.

    Without that patch a longer cycle makes a collective wait longer for its negotiation: about
    half a cycle per step on average (the toolkit's optimizer issues one grouped allreduce per
    step), an overhead of `cycle / (2 * step_ms)`, against `cycle_cost_ms / cycle` for the
    wakes. Under Gloo their sum is smallest at

        cycle = sqrt(2 * cycle_cost_ms * step_ms),

    e.g. 27 ms for a 250 ms step; never below Horovod's default, and never above a quarter of
    the step. Under Open MPI, whose wakes cost little (`mpi_should_yield` keeps its polling off
    the cores), and without a step time to weigh the latency against, Horovod's default stays.
    With GPUs the compute is elsewhere, and with free cores the wakes cost no compute: the
    default too.

    Args:
      controller: "gloo" or "mpi".
      gpus: GPUs visible on the host.
      threads, local_size, host_cpus: compute threads per rank, ranks on this host, host CPUs.
      step_ms: the expected time of one training step (one batch) on one rank, or None.
      cycle_cost_ms: compute time one Gloo cycle costs a saturated rank.
      wakes_on_enqueue: Horovod starts a request when it is enqueued, not at the next cycle.

    Raises:
      ValueError: a non-positive step time or cycle cost.
    """
    if (step_ms is not None and step_ms <= 0) or cycle_cost_ms <= 0:
        raise ValueError(
            f"step_ms and cycle_cost_ms must be > 0, got {step_ms} and {cycle_cost_ms}"
        )
    if gpus or threads * local_size < host_cpus:
        return None
    if wakes_on_enqueue:
        return WAKING_CYCLE_MS
    if controller != "gloo" or step_ms is None:
        return None
    cycle = math.sqrt(2.0 * cycle_cost_ms * step_ms)
    return round(max(HOROVOD_DEFAULT_CYCLE_MS, min(cycle, step_ms / 4)), 1)


def main() -> int:
    """`python -m hvd_train.core.placement`: `probe()` as one JSON line."""
    import json

    print(json.dumps(probe()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
