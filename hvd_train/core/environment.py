"""The launcher's environment, read in one place: what mpirun, horovodrun, srun or Hydra told this
process before Horovod starts (its rank, the worker count, the ranks on its host, the controller),
and the toolkit's own tuning variables.

Pure functions of a mapping (pass `os.environ`), so every rule is unit-tested without a launcher.
After `hvd_train.comm.init()` Horovod's own topology is the truth; this module serves what must be
known before: the CLI's checks (worker count, whether this rank writes the run directory) and the
settings Horovod and Open MPI read when they start.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from hvd_train.errors import UserError

# Worker count set by each launcher in every rank's environment, in the order they are trusted.
SIZE_VARIABLES = (
    "HOROVOD_SIZE",  # horovodrun --gloo
    "OMPI_COMM_WORLD_SIZE",  # Open MPI's mpirun (4 and 5), and horovodrun over MPI
    "PMI_SIZE",  # MPICH and Intel MPI (Hydra)
)
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
LOCAL_SIZE_VARIABLES = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")

# The toolkit's own variables (documented in docs/knobs.md).
STEP_MS = "HVD_TRAIN_STEP_MS"
GLOO_CYCLE_COST_MS = "HVD_TRAIN_GLOO_CYCLE_COST_MS"
# The TCP rate between the job's hosts, as `hvd-train launch --launcher auto` measured it
# (`core.linkrate`) or the user gives it: the gradient buckets follow it (`core.buckets`); where
# it is not given, the ranks measure it at start (`comm.linkprobe`).
LINK_GBIT = "HVD_TRAIN_LINK_GBIT"
# Read by Open MPI and Horovod when they start; a value the user set wins over the toolkit's.
MPI_YIELD = "OMPI_MCA_mpi_yield_when_idle"
CYCLE_TIME = "HOROVOD_CYCLE_TIME"


class LauncherEnvironmentError(UserError):
    """A launcher or tuning variable whose value cannot be used (one line, names the variable)."""


@dataclass(frozen=True)
class Launcher:
    """What the launcher told this process.

    Attributes:
      rank: this process's rank (0 outside a launcher).
      size: the worker count, or None when no known launcher started this process.
      local_size: ranks on this host, or None where the launcher does not say before Horovod
        starts (srun).
      controller: "gloo" under horovodrun --gloo, "mpi" where Open MPI started the ranks, None
        where Horovod decides at its start.
      step_ms: the expected step time (HVD_TRAIN_STEP_MS), or None.
      gloo_cycle_cost_ms: HVD_TRAIN_GLOO_CYCLE_COST_MS, or None for the built-in constant.
      link_gbit: the TCP rate between the job's hosts in Gbit/s (HVD_TRAIN_LINK_GBIT), or None.
      user_set_mpi_yield: the user set Open MPI's yield setting (the toolkit keeps it).
      user_set_cycle_time: the user (or horovodrun --cycle-time-ms) set Horovod's cycle time.
    """

    rank: int
    size: int | None
    local_size: int | None
    controller: str | None
    step_ms: float | None
    gloo_cycle_cost_ms: float | None
    link_gbit: float | None
    user_set_mpi_yield: bool
    user_set_cycle_time: bool


def read(environ: Mapping[str, str]) -> Launcher:
    """Everything the launcher told this process (see `Launcher`).

    Raises:
      LauncherEnvironmentError: a variable whose value is not a positive integer (counts), a
        non-negative integer (ranks) or a positive number (milliseconds, Gbit/s).
    """
    if environ.get("HOROVOD_CONTROLLER") == "gloo":
        controller = "gloo"
    elif "OMPI_COMM_WORLD_SIZE" in environ:
        controller = "mpi"
    else:
        controller = None
    local_size = None
    for name in LOCAL_SIZE_VARIABLES:
        if name in environ:
            local_size = _positive_int(name, environ[name], "count")
            break
    else:
        local_size = slurm_local_size(environ)
    return Launcher(
        rank=launcher_rank(environ),
        size=launcher_size(environ),
        local_size=local_size,
        controller=controller,
        step_ms=_positive(environ, STEP_MS, "milliseconds"),
        gloo_cycle_cost_ms=_positive(environ, GLOO_CYCLE_COST_MS, "milliseconds"),
        link_gbit=_positive(environ, LINK_GBIT, "Gbit/s"),
        user_set_mpi_yield=MPI_YIELD in environ,
        user_set_cycle_time=CYCLE_TIME in environ,
    )


def launcher_size(environ: Mapping[str, str]) -> int | None:
    """The worker count a launcher gave this process, read before Horovod is imported.

    Reads `SIZE_VARIABLES` in order, then SLURM_NTASKS inside a job step (SLURM_STEP_ID set:
    srun's tasks; the batch script itself is not a worker).

    Returns:
      The worker count, or None when not started by a known launcher.

    Raises:
      LauncherEnvironmentError: the variable's value is not a positive integer.
    """
    for name in SIZE_VARIABLES:
        if name in environ:
            return _positive_int(name, environ[name], "worker count")
    if "SLURM_STEP_ID" in environ and "SLURM_NTASKS" in environ:
        return _positive_int("SLURM_NTASKS", environ["SLURM_NTASKS"], "worker count")
    return None


def slurm_local_size(environ: Mapping[str, str]) -> int | None:
    """The tasks of this srun step on this node, or None outside a step: SLURM_STEP_TASKS_PER_NODE
    ("2(x3),1": two tasks on each of three nodes, then one) at SLURM_NODEID, this node's index in
    the step. (Open MPI sets its own local size only inside MPI_Init, too late for the settings
    made before it.)

    Raises:
      LauncherEnvironmentError: a value in another format, or a node index outside it.
    """
    tasks, node = environ.get("SLURM_STEP_TASKS_PER_NODE"), environ.get("SLURM_NODEID")
    if "SLURM_STEP_ID" not in environ or tasks is None or node is None:
        return None
    counts = []
    for item in tasks.split(","):
        match = re.fullmatch(r"([1-9][0-9]*)(?:\(x([1-9][0-9]*)\))?", item.strip())
        if match is None:
            raise LauncherEnvironmentError(
                f"SLURM_STEP_TASKS_PER_NODE={tasks!r}: expected counts such as '2(x3),1'"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    try:
        return counts[int(node)]
    except (ValueError, IndexError):
        raise LauncherEnvironmentError(
            f"SLURM_NODEID={node!r} is no node of SLURM_STEP_TASKS_PER_NODE={tasks!r}"
        ) from None


def launcher_rank(environ: Mapping[str, str]) -> int:
    """This process's rank as its launcher set it (0 outside a launcher), before Horovod starts.

    Raises:
      LauncherEnvironmentError: a rank variable that is not an integer.
    """
    names = [*RANK_VARIABLES, *(("SLURM_PROCID",) if "SLURM_STEP_ID" in environ else ())]
    for name in names:
        if name in environ:
            try:
                return int(environ[name])
            except ValueError:
                raise LauncherEnvironmentError(
                    f"{name}={environ[name]!r} is not an integer rank"
                ) from None
    return 0


def _positive_int(name: str, text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise LauncherEnvironmentError(f"{name}: expected a positive {what}, got {text!r}")
    return value


def _positive(environ: Mapping[str, str], name: str, unit: str) -> float | None:
    text = environ.get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise LauncherEnvironmentError(f"{name} must be a positive number of {unit}, got {text!r}")
    return value
