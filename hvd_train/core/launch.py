"""Launch commands as data, and the supervision of the launcher that runs them.

The argv builders for mpirun, horovodrun and srun, and `launch_env` (the environment the launcher
runs in), are pure functions, unit-tested to the exact list. `execute` shows the command
(`shlex.join`) and replaces this process with it; `supervise` runs it as a child (no shell),
passes stop signals on, shows its output through `LaunchOutput` (TensorFlow's start-up noise
dropped, the launcher's failure report dropped after a rank's error line) and returns its exit
code; `main` is `python -m hvd_train.core.launch`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from hvd_train.core import environment, linkrate, network, placement, processes
from hvd_train.core.environment import LauncherEnvironmentError

# Environment a rank needs from the launching shell; mpirun does not forward it by itself.
FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
FORWARD_PREFIXES = ("HOROVOD_", "HVD_TRAIN_", "TF_", "OMP_", "KERAS_", "CUDA_", "NCCL_")


# Set for every rank unless the user set it: TensorFlow's C++ INFO and WARNING lines at start-up
# (cpu_feature_guard and the like) drown the first line that matters; its errors still show.
RANK_ENV_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def launch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to run a launcher in: `environ`, plus `RANK_ENV_DEFAULTS` where unset.

    Every launcher passes it on to the ranks (mpirun with -x: `forwarded_env_names` names it).
    """
    return {**RANK_ENV_DEFAULTS, **environ}


def forwarded_env_names(environ: Mapping[str, str]) -> list[str]:
    """Names of the variables a launcher must forward to every rank, sorted."""
    return sorted(
        name for name in environ if name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)
    )


def read_hostfile(path: str | None) -> list[str] | None:
    """The "host:slots" entries of an Open MPI hostfile ("host slots=N" lines, "# comments";
    slots default to 1), for every launcher alike; None without a path.

    Raises:
      ValueError: an unreadable file, a line that is not "host [slots=N]", or no host.
    """
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"--hostfile {path}: {err.strerror}") from None
    hosts = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        slots = re.fullmatch(r"slots=([1-9][0-9]*)", fields[1]) if len(fields) == 2 else None
        if len(fields) > 2 or (len(fields) == 2 and slots is None):
            raise ValueError(f"--hostfile {path}:{number}: expected 'host slots=N', got {line!r}")
        hosts.append(f"{fields[0]}:{slots.group(1) if slots else 1}")
    if not hosts:
        raise ValueError(f"--hostfile {path}: names no host")
    return hosts


def hosts_arg(hosts: Sequence[str] | None, np: int) -> str:
    """Horovod/Open MPI host list "a:2,b:2"; None means all `np` slots on localhost."""
    return ",".join(hosts) if hosts else f"localhost:{np}"


def mpirun_argv(
    np: int,
    command: Sequence[str],
    *,
    hosts: Sequence[str] | None = None,
    env_names: Sequence[str] = (),
    as_root: bool = False,
    oversubscribe: bool = False,
    ompi_major: int = 4,
    bind_to: str = "none",
    job_network: str | None = None,
) -> list[str]:
    """Open MPI's mpirun command for `np` ranks of `command`.

    Args:
      np: number of ranks.
      command: the program and its arguments, run by every rank.
      hosts: "host:slots" entries; None runs all ranks on this machine.
      env_names: variables forwarded with -x.
      as_root: add --allow-run-as-root (Open MPI refuses root otherwise; containers run as root).
      oversubscribe: allow more ranks than cores (for tests on small machines).
      ompi_major: 4 or 5; the oversubscribe flag is spelled differently.
      bind_to: "none" lets each rank's TensorFlow threads use its share of the cores
        (Open MPI's default binds one core per rank, which starves multi-threaded ranks).
      job_network: the job's network a.b.c.d/n (`core.network.for_hosts`): Open MPI's TCP
        transport is restricted to it, and the ranks are told (HVD_TRAIN_IFACE).

    Raises:
      ValueError: np < 1, an empty command, or an unknown Open MPI version.
    """
    if np < 1 or not command:
        raise ValueError(f"need np >= 1 and a command, got np={np} command={list(command)}")
    if ompi_major not in (4, 5):
        raise ValueError(f"Open MPI major version must be 4 or 5, got {ompi_major}")
    argv = ["mpirun", "-np", str(np), "-H", hosts_arg(hosts, np), "--bind-to", bind_to]
    if as_root:
        argv.append("--allow-run-as-root")
    if oversubscribe:
        argv += ["--oversubscribe"] if ompi_major == 4 else ["--map-by", ":OVERSUBSCRIBE"]
    if job_network:
        # A network, not a name: the interface's name may differ from host to host (and mpirun's
        # own host may have none in it). Open MPI's control channel stays Open MPI's choice, as
        # under horovodrun: a data link that fails then leaves mpirun the way to end the job.
        argv += ["--mca", "btl_tcp_if_include", job_network]
        argv += ["-x", f"{network.JOB_IFACE}={job_network}"]
    for name in env_names:
        argv += ["-x", name]
    return argv + list(command)


def horovodrun_argv(
    np: int,
    command: Sequence[str],
    *,
    controller: str = "gloo",
    hosts: Sequence[str] | None = None,
    interface: str | None = None,
) -> list[str]:
    """horovodrun's command for `np` ranks of `command` over the Gloo or MPI controller.

    horovodrun passes its own environment to the ranks, so no variables are named here.
    `interface` (the job's, `core.network.for_hosts`) goes to --network-interfaces: horovodrun
    hands it to Gloo, Open MPI and NCCL; left to choose, it may pick another for each.

    Raises:
      ValueError: np < 1, an empty command, or an unknown controller.
    """
    if np < 1 or not command:
        raise ValueError(f"need np >= 1 and a command, got np={np} command={list(command)}")
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be gloo or mpi, got {controller!r}")
    argv = ["horovodrun", "-np", str(np), "-H", hosts_arg(hosts, np), f"--{controller}"]
    if interface:
        argv += ["--network-interfaces", interface]
    return [*argv, *command]


def horovodrun_elastic_argv(
    np: int,
    command: Sequence[str],
    *,
    min_np: int,
    max_np: int,
    discovery: Sequence[str],
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
) -> list[str]:
    """horovodrun's elastic command: start `np` workers of `command`, keep min_np..max_np.

    Elastic mode always runs Horovod's Gloo controller. Every second horovodrun runs the discovery
    command (through a shell, hence the quoting here), which prints one "host:slots" line per
    available host (`mpi_scripts/discover_hosts.sh`); workers are started on hosts that appear
    and dropped with hosts that go, and a host whose worker failed is blacklisted (for the rest of
    the job, or for a time within `cooldown_range` seconds).

    Args:
      np: workers to start with.
      command: the program and its arguments (`hvd-train train --elastic ...`).
      min_np, max_np: the fewest workers the job continues with, and the most it grows to.
      discovery: the host discovery program and its arguments.
      reset_limit: end the job after this many resets (None: no limit).
      cooldown_range: (low, high) seconds a failed host stays blacklisted (None: for good).

    Raises:
      ValueError: not 1 <= min_np <= np <= max_np, an empty command or discovery, a reset limit
        < 0, or a cooldown range that is not 1 <= low <= high.
    """
    if not 1 <= min_np <= np <= max_np or not command or not discovery:
        raise ValueError(
            f"need 1 <= min_np <= np <= max_np, a command and a discovery command, got "
            f"min_np={min_np} np={np} max_np={max_np} command={list(command)} "
            f"discovery={list(discovery)}"
        )
    argv = ["horovodrun", "-np", str(np), "--min-np", str(min_np), "--max-np", str(max_np)]
    argv += ["--host-discovery-script", shlex.join(discovery)]
    if reset_limit is not None:
        if reset_limit < 0:
            raise ValueError(f"reset_limit must be >= 0 or None, got {reset_limit}")
        argv += ["--reset-limit", str(reset_limit)]
    if cooldown_range is not None:
        low, high = cooldown_range
        if not 1 <= low <= high:
            raise ValueError(
                f"cooldown_range must be (low, high) with 1 <= low <= high, got {cooldown_range}"
            )
        argv += ["--blacklist-cooldown-range", str(low), str(high)]
    return [*argv, *command]


SRUN_MPI_TYPES = ("pmix", "pmi2")


def srun_argv(
    np: int,
    command: Sequence[str],
    *,
    nodes: int | None = None,
    cpus_per_task: int | None = None,
    gpus_per_task: int | None = None,
    mpi: str = "pmix",
    job_network: str | None = None,
) -> list[str]:
    """SLURM's srun command for `np` ranks of `command`, inside an allocation (sbatch or salloc).

    srun starts every rank itself and Open MPI initialises through SLURM's PMI server, so Horovod
    runs with its MPI controller and no mpirun (Open MPI and SLURM must share a PMIx, or use PMI-2).

    Args:
      np: number of ranks (srun --ntasks).
      command: the program and its arguments, run by every rank.
      nodes: spread the ranks over this many nodes; None lets srun use the allocation's.
      cpus_per_task: CPUs per rank. Since SLURM 22.05 srun no longer inherits sbatch's value,
        so a job script passes it again.
      gpus_per_task: GPUs per rank (one per rank is Horovod's layout); None asks for none.
      mpi: SLURM's MPI plugin, "pmix" or "pmi2".
      job_network: an interface name or network for every rank (HVD_TRAIN_IFACE, `core.network`).

    Raises:
      ValueError: np < 1, an empty command, nodes outside 1..np, a count < 1, an unknown plugin.
    """
    if np < 1 or not command:
        raise ValueError(f"need np >= 1 and a command, got np={np} command={list(command)}")
    if nodes is not None and not 1 <= nodes <= np:
        raise ValueError(f"nodes must be between 1 and np={np}, got {nodes}")
    for name, count in (("cpus_per_task", cpus_per_task), ("gpus_per_task", gpus_per_task)):
        if count is not None and count < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {count}")
    if mpi not in SRUN_MPI_TYPES:
        raise ValueError(f"mpi must be one of {', '.join(SRUN_MPI_TYPES)}, got {mpi!r}")
    argv = ["srun", f"--ntasks={np}"]
    if nodes is not None:
        argv.append(f"--nodes={nodes}")
    if cpus_per_task is not None:
        argv.append(f"--cpus-per-task={cpus_per_task}")
    if gpus_per_task is not None:
        argv.append(f"--gpus-per-task={gpus_per_task}")
    return [
        *argv,
        f"--mpi={mpi}",
        # One dead rank would leave the others blocked in their next allreduce until the time
        # limit; this ends the whole step instead.
        "--kill-on-bad-exit=1",
        # As mpirun's --bind-to none: hvd_train.init() gives each rank its share of the CPUs the
        # job may use; a site's default binding (one core per task without --cpus-per-task)
        # would starve multi-threaded TensorFlow ranks.
        "--cpu-bind=none",
        # srun's default, made explicit: ranks get the batch script's whole environment (venv
        # PATH, HOROVOD_*, TF_*), so, unlike mpirun, no variable is named.
        "--export=ALL" + (f",{network.JOB_IFACE}={job_network}" if job_network else ""),
        *command,
    ]


def ompi_major_version(mpirun: str = "mpirun") -> int:
    """Major version of the installed Open MPI (from `mpirun --version`)."""
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    match = re.search(r"Open MPI\)? (\d+)\.", out.stdout)
    if not match:
        raise RuntimeError(f"cannot tell the Open MPI version from: {out.stdout.strip()[:200]!r}")
    return int(match.group(1))


def build(
    launcher: str,
    np: int,
    command: Sequence[str],
    hosts: Sequence[str] | None = None,
    *,
    nodes: int | None = None,
    cpus_per_task: int | None = None,
    gpus_per_task: int | None = None,
    mpi: str | None = None,
    network_interface: str | None = None,
) -> list[str]:
    """The argv for `launcher` on this machine (version, user, core count and routes read here),
    to run in `launch_env(os.environ)`.

    `nodes`, `cpus_per_task`, `gpus_per_task` and `mpi` are srun's (see `srun_argv`); srun reads
    nothing from this machine, so its command can be printed where SLURM is not installed.
    On `hosts` other than this one the job's network is chosen here (`core.network.for_hosts`:
    `network_interface`, else the route to the hosts) and handed to the launcher; under mpirun a
    user's own OMPI_MCA_btl_tcp_if_include stands unless `network_interface` is given.

    Raises:
      ValueError: an unknown launcher, hosts given to srun, srun's options given to another
        launcher, or a bad argument of the launcher's builder.
      LauncherEnvironmentError: the job's network cannot be chosen (`core.network.for_hosts`),
        or horovodrun would need an interface name this host lacks.
    """
    srun_options = {"nodes": nodes, "cpus_per_task": cpus_per_task, "gpus_per_task": gpus_per_task}
    if launcher == "auto":
        launcher = choose_launcher(hosts, np).launcher
    if launcher == "srun":
        if hosts:
            raise ValueError("srun places ranks on the SLURM allocation; hosts are not used")
        return srun_argv(
            np, command, **srun_options, mpi=mpi or "pmix", job_network=network_interface
        )
    given = [name for name, value in srun_options.items() if value is not None]
    if mpi is not None:
        given.append("mpi")
    if given:
        raise ValueError(f"srun's options ({', '.join(given)}) do not apply to {launcher}")
    controller = {"horovodrun": "gloo", "horovodrun-gloo": "gloo", "horovodrun-mpi": "mpi"}
    if launcher not in ("mpirun", *controller):
        known = ", ".join(["mpirun", *controller, "srun"])
        raise ValueError(f"unknown launcher {launcher!r}; known: {known}")
    user_chose = launcher == "mpirun" and bool(os.environ.get(network.MPI_TRANSPORT))
    chosen = None
    if network_interface or (hosts and not user_chose):
        chosen = network.for_hosts(hosts or [], network_interface, network.remote_shell(launcher))
    if launcher == "mpirun":
        return mpirun_argv(
            np,
            command,
            hosts=hosts,
            env_names=forwarded_env_names(launch_env(os.environ)),
            as_root=os.geteuid() == 0,
            oversubscribe=hosts is None and np > (os.cpu_count() or 1),
            ompi_major=ompi_major_version(),
            job_network=str(chosen.network) if chosen else None,
        )
    if chosen:
        _check_one_name(chosen, hosts or [], network.remote_shell(launcher))
    return horovodrun_argv(
        np,
        command,
        controller=controller[launcher],
        hosts=hosts,
        interface=chosen.name if chosen else None,
    )


def _check_one_name(chosen: network.Interface, hosts: Sequence[str], shell: list[str]) -> None:
    """horovodrun hands one interface name to its driver here and to every host: the job's
    network must have that name everywhere."""
    others = network.other_hosts(hosts)
    names = {
        h: i.name for h, i in network.probe_hosts(others, str(chosen.network), shell).items() if i
    }
    if not chosen.name or any(name != chosen.name for name in names.values()):
        listed = ", ".join(f"{name} on {host}" for host, name in names.items())
        here = chosen.name or "none"
        raise LauncherEnvironmentError(
            f"horovodrun looks the job's interface up by one name on this host and on every "
            f"host, but {chosen.network} is {here} here, {listed}: run the launch on a host of "
            "the job"
        )


# Gbit/s of TCP between CPU-only hosts filled by the ranks under which horovodrun's Gloo steps
# faster than Open MPI (docs/network.md, "Which controller, by link rate").
GLOO_BELOW_GBIT = 2.5


class LauncherChoice(NamedTuple):
    """What `--launcher auto` chose: the launcher, why, and the TCP rate it measured between the
    hosts in Gbit/s (None where it measured none), which the ranks' gradient buckets follow."""

    launcher: str
    why: str
    link_gbit: float | None = None


def choose_launcher(hosts: Sequence[str] | None, np: int) -> LauncherChoice:
    """The launcher `auto` runs `np` ranks with on `hosts` ("name:slots" entries, filled in
    order as both launchers fill them; None: this host), why, and the link rate it measured.

    mpirun, unless each host that gets ranks, asked for its CPUs and GPUs
    (`core.placement.probe`, over Open MPI's agent or ssh as mpirun reaches them), is CPU-only
    with its cores exactly filled by the ranks (`core.placement.fills_cpu_hosts`), this host is
    one of them, and the TCP rate from here to the next (`core.linkrate.measure`) is under
    GLOO_BELOW_GBIT: there horovodrun's Gloo, which hides part of the transfer behind a busy
    core's compute. A link-rate probe that fails leaves mpirun, and says why.

    Raises:
      ValueError: a host entry whose slots are no positive number.
      LauncherEnvironmentError: a host that does not answer the probe.
    """
    slots: dict[str, int] = {}
    left = np
    for entry in hosts or []:
        name, colon, count = entry.rpartition(":")
        if not colon:
            name, count = entry, "1"
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"host {entry!r}: slots must be a positive number")
        taken = min(int(count), left)
        if taken:
            slots[name] = slots.get(name, 0) + taken
        left -= taken
    others = network.other_hosts(list(slots))
    if not others:
        return LauncherChoice("mpirun", "every rank on this host")
    answers = network.ask_hosts(
        others, ["hvd_train.core.placement"], network.remote_shell("mpirun"), "CPU and GPU probe"
    )
    here = placement.probe()
    loads = []
    for name, count in slots.items():
        found = answers.get(name, here)
        loads.append(placement.host_load(found["cpus"], count, found["gpus"]))
    shown = ", ".join(
        f"{name}: {count} rank(s), {cpus} CPU(s), {gpus} GPU(s)"
        for (name, count), (cpus, _, gpus) in zip(slots.items(), loads, strict=True)
    )
    if not placement.fills_cpu_hosts(loads):
        return LauncherChoice(
            "mpirun", f"not every host is CPU-only with its cores filled by the ranks ({shown})"
        )
    filled = f"CPU-only hosts whose ranks' compute fills every core ({shown})"
    if len(others) == len(slots):
        # horovodrun's driver finds the job's interface by name here: from outside the job's
        # hosts it may find none (`_check_one_name`), and the link measured from here would not
        # be the job's.
        return LauncherChoice(
            "mpirun", f"{filled}; on a slow link Gloo steps faster, run from one of the hosts"
        )
    try:
        rate = linkrate.measure(others[0], network.remote_shell("mpirun"))
    except LauncherEnvironmentError as err:
        return LauncherChoice("mpirun", f"{filled}; the link rate is unknown ({err})")
    measured = f"{filled}; TCP to {rate.host}: {rate.gbit_s:.2f} Gbit/s"
    if rate.gbit_s < GLOO_BELOW_GBIT:
        why = f"{measured}, under {GLOO_BELOW_GBIT:g}: Gloo steps faster"
        return LauncherChoice("horovodrun-gloo", why, rate.gbit_s)
    why = f"{measured}, not under {GLOO_BELOW_GBIT:g}: Open MPI steps faster"
    return LauncherChoice("mpirun", why, rate.gbit_s)


LAUNCHERS = ("mpirun", "auto", "horovodrun", "horovodrun-gloo", "horovodrun-mpi", "srun")


LAUNCH_HELP = """Start N workers of a command under mpirun (default), horovodrun (Gloo or MPI) or
srun; auto asks the hosts for their CPUs and GPUs and the link for its rate, and runs horovodrun's
Gloo where it steps faster (CPU-only hosts filled by the ranks, a slow link), mpirun elsewhere.
The launcher's command is printed, then run; stop signals (TERM, INT, USR1, HUP) are passed on to
the workers, who stop at an agreed step and checkpoint; the exit code is the job's."""


def make_parser(prog: str) -> argparse.ArgumentParser:
    """The launch options shared by `python -m hvd_train.core.launch` and `hvd-train launch`."""
    parser = argparse.ArgumentParser(prog=prog, description=LAUNCH_HELP)
    parser.add_argument("--np", type=int, default=2, help="number of ranks [2]")
    parser.add_argument("--launcher", default="mpirun", choices=LAUNCHERS)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", help="comma-separated host:slots; default: localhost")
    where.add_argument(
        "--hostfile", help="an Open MPI hostfile: one 'host slots=N' line per host (as --hosts)"
    )
    parser.add_argument(
        "--network-interface",
        metavar="IFACE",
        help="the job's interface (a name, or a network a.b.c.d/n) for MPI, Gloo, NCCL and the "
        "watchdog [the interface of the route to the other hosts]",
    )
    srun = parser.add_argument_group("srun only (inside a SLURM allocation)")
    srun.add_argument("--nodes", type=int, help="nodes to spread the ranks over [allocation's]")
    srun.add_argument("--cpus-per-task", type=int, help="CPUs per rank [none asked]")
    srun.add_argument("--gpus-per-task", type=int, help="GPUs per rank [none asked]")
    srun.add_argument("--mpi", choices=SRUN_MPI_TYPES, help="SLURM's MPI plugin [pmix]")
    parser.add_argument("--dry-run", action="store_true", help="print the command only")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program args ...")
    return parser


def parse(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    """Parse launch options; returns them and the command after `--` (errors via parser.error)."""
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    if args.np < 1:
        parser.error(f"--np must be >= 1, got {args.np}")
    if args.launcher == "auto":
        # The launcher is chosen once, here: the rest of the launch (its signals, its output
        # filters) follows the chosen one.
        try:
            hosts = args.hosts.split(",") if args.hosts else read_hostfile(args.hostfile)
            args.launcher, why, gbit = choose_launcher(hosts, args.np)
        except (ValueError, LauncherEnvironmentError) as err:
            parser.error(str(err))
        print(f"launch: --launcher auto: {args.launcher} ({why})", file=sys.stderr, flush=True)
        if gbit is not None and environment.LINK_GBIT not in os.environ:
            # The ranks size their gradient buckets by the link (`core.buckets`): every launcher
            # forwards the HVD_TRAIN_ variables to them. A rate the user set stands.
            os.environ[environment.LINK_GBIT] = f"{gbit:.2f}"
    return args, command


def execute(parser: argparse.ArgumentParser, args: argparse.Namespace, command: list[str]) -> int:
    """Build the launch command, print it, and (unless --dry-run) replace this process with it."""
    full = _built(parser, args, command)
    print(shlex.join(full), flush=True)
    if args.dry_run:
        return 0
    if shutil.which(full[0]) is None:
        print(f"launch: {full[0]} not found on PATH", file=sys.stderr)
        return 2
    os.execvpe(full[0], full, launch_env(os.environ))


def _built(parser: argparse.ArgumentParser, args: argparse.Namespace, command: list[str]) -> list:
    try:
        return build(
            args.launcher,
            args.np,
            command,
            args.hosts.split(",") if args.hosts else read_hostfile(args.hostfile),
            nodes=args.nodes,
            cpus_per_task=args.cpus_per_task,
            gpus_per_task=args.gpus_per_task,
            mpi=args.mpi,
            network_interface=args.network_interface,
        )
    except (ValueError, LauncherEnvironmentError) as err:
        parser.error(str(err))


# Signals a supervising launch passes on to the launcher: a scheduler's stop (TERM), SLURM's early
# warning (USR1/USR2 with --signal), a hang-up. INT comes from the terminal to the whole process
# group, the launcher included, and is not sent twice.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def forwarded_signal(launcher: str, signum: int) -> int:
    """The signal to send `launcher` when the supervising launch gets `signum`.

    Open MPI's mpirun passes USR1 and USR2 on to every rank at once, but answers TERM or HUP by
    killing the job: SIGCONT, then TERM only after `odls_base_sigkill_timeout` seconds, then KILL
    as long again (Open MPI 4.1). So mpirun gets USR1 instead, which the ranks take as a stop
    request (fault.stop_signals must hold USR1, as by default). horovodrun and srun pass TERM on
    to their ranks themselves.
    """
    if launcher == "mpirun" and signum in (signal.SIGTERM, signal.SIGHUP):
        return signal.SIGUSR1
    return signum


# --- what a supervised launch shows ---------------------------------------------------------------
# The tables are whole lines (Python regular expressions, fullmatch), as the launchers print them;
# a rank's line may carry horovodrun's "[0]<stderr>:" or mpirun --tag-output's "[1,0]<stderr>:".

RAW_ENV = "HVD_TRAIN_LAUNCH_RAW"  # "1": show the launcher's output unfiltered

RANK_PREFIX = r"\[\d+(?:,\d+)?\]<(?:stdout|stderr)>:"
ERROR_LINE = r"hvd-train: error: .*"  # a rank's one-line error (cli._show)
# A rank's watchdog ending its process: the job is over (faults.Watchdog).
WATCHDOG_ABORT_LINE = r"hvd-train: watchdog on rank \d+: .*; aborting the job \(exit \d+\)"

_GLOG_INFO = r"I\d{4} \d\d:\d\d:[\d.]+ +\d+ (?:[\w./-]+/)?"

# TensorFlow's start-up lines, printed by every rank (and horovodrun itself) as TensorFlow loads:
# absl's note and oneDNN's at any TF_CPP_MIN_LOG_LEVEL (TensorFlow 2.21), cpu_feature_guard's
# two lines at level 0. Always dropped.
TF_START_UP_NOISE = (
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    _GLOG_INFO + r"port\.cc:\d+\] oneDNN custom operations are on\. You may see slightly "
    r"different numerical results due to floating-point round-off errors from different "
    r"computation orders\. To turn them off, set the environment variable "
    r"`TF_ENABLE_ONEDNN_OPTS=0`\.",
    _GLOG_INFO + r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use "
    r"available CPU instructions in performance-critical operations\.",
    r"To enable the following instructions: [\w ]+, in other operations, rebuild TensorFlow "
    r"with the appropriate compiler flags\.",
)

# The launchers' report of a job whose rank exited non-zero. It repeats what a rank's error line
# already said, so it is dropped once a rank printed one in this launch; without one, it is the
# only account of the failure and is shown. Open MPI's mpirun (and horovodrun's MPI controller,
# which runs it): two boxes on stderr, each between lines of dashes, known by their first line.
MPIRUN_BOX_RULE = r"-{20,}"
MPIRUN_FAILURE_BOXES = (
    r"Primary job  terminated normally, but \d+ process(?:es)? returned",
    r"mpirun detected that one or more processes exited with non-zero status, thus causing",
)
# horovodrun's Gloo controller: one line per failed process and one as it ends the others (on
# stdout), the shell it runs a worker in saying "Terminated" as that worker is ended (on stderr),
# then its RuntimeError's traceback and the message's lines that follow (on stderr).
HOROVODRUN_FAILURE_LINES = (
    r"Process \d+ exit with status code -?\d+\.",
    r"Terminating remaining workers after failure of Process \d+\.",
    r"\[\d+\]<stderr>:Terminated",
)
TRACEBACK_HEAD = r"Traceback \(most recent call last\):"
HOROVODRUN_FAILURE_ERROR = (
    r"RuntimeError: Horovod detected that one or more processes exited with non-zero status, "
    r"thus causing the job to be terminated\. The first process to do so was:",
    r"Process name: \S+",
    r"Exit code: -?\d+",
    r"",
)


def _any(patterns: Sequence[str]) -> re.Pattern:
    return re.compile("|".join(f"(?:{pattern})" for pattern in patterns))


_PREFIX = re.compile(RANK_PREFIX)
_NOISE = _any(TF_START_UP_NOISE)
_ERROR = re.compile(ERROR_LINE)
_WATCHDOG_ABORT = re.compile(WATCHDOG_ABORT_LINE)
_RULE = re.compile(MPIRUN_BOX_RULE)
_BOX_HEAD = _any(MPIRUN_FAILURE_BOXES)
_FAILURE_LINE = _any(HOROVODRUN_FAILURE_LINES)
_TRACEBACK_HEAD = re.compile(TRACEBACK_HEAD)
_FAILURE_ERROR = [re.compile(pattern) for pattern in HOROVODRUN_FAILURE_ERROR]


class LaunchOutput:
    """What `hvd-train launch` shows of its launcher's output: one `stream()` filter per stream.

    TensorFlow's start-up noise (`TF_START_UP_NOISE`) is dropped. The launcher's failure report
    (mpirun's boxes, horovodrun's lines and traceback) is held back as it comes, and dropped if a
    rank printed an `hvd-train: error:` line in this launch (on any stream, before or after it);
    else it is shown once the launcher's output has ended. Every other line is shown as it comes,
    in order: a line that may open a report (a rule of dashes, an unprefixed "Traceback") waits
    until a later line tells (the next one; the exception's, for a traceback), or for the end.

    `job_ending` is set at a rank's first line saying that it ends (its error line, or its
    watchdog's abort line): from then on, the launcher has only the others to end.
    """

    def __init__(self) -> None:
        self.error_shown = False  # a rank printed an `hvd-train: error:` line
        self.job_ending = threading.Event()
        self._lock = threading.Lock()
        self._streams: list[_LaunchStream] = []

    def stream(self) -> processes.LineFilter:
        """A filter for one of the launcher's streams."""
        stream = _LaunchStream(self)
        self._streams.append(stream)
        return stream


class _LaunchStream(processes.LineFilter):
    def __init__(self, output: LaunchOutput) -> None:
        self.output = output
        self.waiting: list[str] = []  # lines whose kind the next line tells
        self.state = "line"  # or "rule", "traceback" (waiting), "box", "error" (in a report)
        self.error_line = 0  # the next line of HOROVODRUN_FAILURE_ERROR
        self.held: list[str] = []  # the launcher's report, until a rank's error line or the end

    def line(self, text: str) -> str:
        with self.output._lock:
            return self._next(text, text.rstrip("\r\n"))

    def end(self) -> str:
        with self.output._lock:
            shown = "".join(self.held + self.waiting)
            self.held, self.waiting = [], []
            return shown

    def _next(self, text: str, body: str) -> str:
        if self.state == "box":
            self._report(text)
            if _RULE.fullmatch(body):
                self.state = "line"
            return ""
        if self.state == "error":
            if _FAILURE_ERROR[self.error_line].fullmatch(body):
                self._report(text)
                self.error_line += 1
                if self.error_line == len(_FAILURE_ERROR):
                    self.state = "line"
                return ""
            self.state = "line"
        elif self.state == "rule":
            if _BOX_HEAD.fullmatch(body):
                self.state = "box"
                self._report(self.waiting.pop(), text)
                return ""
            return self._release() + self._next(text, body)
        elif self.state == "traceback":
            if body.startswith(" "):
                self.waiting.append(text)
                return ""
            if _FAILURE_ERROR[0].fullmatch(body):
                self.state, self.error_line = "error", 1
                self._report(*self.waiting, text)
                self.waiting = []
                return ""
            return self._release() + self._next(text, body)
        return self._line(text, body)

    def _line(self, text: str, body: str) -> str:
        prefix = _PREFIX.match(body)
        content = body[prefix.end() :] if prefix else body
        if _NOISE.fullmatch(content):
            return ""
        if _ERROR.fullmatch(content):
            self.output.error_shown = True
            self.output.job_ending.set()
            for stream in self.output._streams:
                stream.held = []
            return text
        if _WATCHDOG_ABORT.fullmatch(content):
            self.output.job_ending.set()
            return text
        if _RULE.fullmatch(body):
            self.state, self.waiting = "rule", [text]
            return ""
        if _TRACEBACK_HEAD.fullmatch(body):
            self.state, self.waiting = "traceback", [text]
            return ""
        if _FAILURE_LINE.fullmatch(body):
            self._report(text)
            return ""
        return text

    def _release(self) -> str:
        """The waiting lines were not a report: shown."""
        shown = "".join(self.waiting)
        self.state, self.waiting = "line", []
        return shown

    def _report(self, *lines: str) -> None:
        if not self.output.error_shown:
            self.held.extend(lines)


@dataclass(frozen=True)
class Launched:
    """How a supervised launch ended.

    Attributes:
      exit_code: the launcher's (128 + N if signal N ended it).
      error_shown: a rank printed an `hvd-train: error:` line (always False unfiltered).
    """

    exit_code: int
    error_shown: bool


# Once a rank has said that it ends the job, the launcher has this long to end the others and exit
# (measured across hosts: 2 s for mpirun, 10 s for horovodrun's TERM-then-KILL); then it is
# killed, with every process it started. mpirun otherwise waits for ever on the daemon of a host
# it can no longer reach, long after every rank has exited (and told TERM then, it crashes).
LAUNCHER_TEARDOWN_S = 20.0


def _end_if_late(shown: LaunchOutput, name: str) -> Callable[[subprocess.Popen], bool]:
    """A `processes.run` watcher: kills the launcher and what it started `LAUNCHER_TEARDOWN_S`
    after the job began to end (`LaunchOutput.job_ending`), if it still runs; True if it had to."""

    def watch(proc: subprocess.Popen) -> bool:
        while not shown.job_ending.wait(0.5):
            if proc.poll() is not None:
                return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(LAUNCHER_TEARDOWN_S)
            return False
        sys.stderr.write(
            f"hvd-train launch: {name} still runs {LAUNCHER_TEARDOWN_S:g} s after a rank ended "
            "the job (waiting on a host it cannot reach?): killing it and what it started\n"
        )
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return True

    return watch


def _descendants(pid: int) -> list[int]:
    """The live processes below `pid` (its ssh clients, local daemons and ranks), from /proc;
    none where there is no /proc."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                    children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def supervise(
    parser: argparse.ArgumentParser, args: argparse.Namespace, command: list[str]
) -> Launched:
    """Like `execute`, but run the launcher as a child, pass stop signals on to it, show its
    output through `LaunchOutput` (unless HVD_TRAIN_LAUNCH_RAW=1) and say how it ended.

    A launcher still running `LAUNCHER_TEARDOWN_S` after a rank's line said that the job ends
    (mpirun waiting on a host cut off from it) is ended, with what it started."""
    full = _built(parser, args, command)
    print(shlex.join(full), flush=True)
    if shutil.which(full[0]) is None:
        print(f"launch: {full[0]} not found on PATH", file=sys.stderr)
        return Launched(2, False)
    shown = LaunchOutput()
    filters = {}
    if os.environ.get(RAW_ENV) != "1":
        filters["stderr_filter"] = shown.stream()
        if args.launcher in ("horovodrun", "horovodrun-gloo"):
            # horovodrun's Gloo controller prints its failure lines on stdout. It relays its
            # ranks' stdout itself, cut at each "\n" and "\r" (a progress bar's rewrite), so
            # filtering it line by line shows a progress bar as live as before. Under the other
            # launchers stdout is the ranks' own and is left alone.
            filters["stdout_filter"] = shown.stream()
    # The launcher stays in this process group: a terminal's INT reaches it (and its ranks)
    # directly, so INT is not forwarded a second time.
    finished = processes.run(
        full,
        launch_env(os.environ),
        capture=None,
        new_session=False,
        forward_signals={s: forwarded_signal(args.launcher, s) for s in FORWARDED_SIGNALS},
        during=_end_if_late(shown, full[0]),
        **filters,
    )
    return Launched(finished.exit_code, shown.error_shown)


def main(argv: list[str] | None = None) -> int:
    """`python -m hvd_train.core.launch --np N [--launcher L] [--hosts h:s,..] -- cmd`."""
    parser = make_parser("python -m hvd_train.core.launch")
    args, command = parse(parser, sys.argv[1:] if argv is None else argv)
    return execute(parser, args, command)


if __name__ == "__main__":
    sys.exit(main())
