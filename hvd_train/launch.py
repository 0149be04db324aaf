"""Launch commands as data: argv lists for mpirun and horovodrun, built by pure functions.

Nothing here runs a process except `main`; the builders are unit-tested to the exact list and shown
to the user with `shlex.join` before they run (without a shell).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

# Environment a rank needs from the launching shell; mpirun does not forward it by itself.
FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
FORWARD_PREFIXES = ("HOROVOD_", "HVD_TRAIN_", "TF_", "OMP_", "KERAS_", "CUDA_", "NCCL_")


def forwarded_env_names(environ: Mapping[str, str]) -> list[str]:
    """Names of the variables a launcher must forward to every rank, sorted."""
    return sorted(
        name for name in environ if name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)
    )


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
    for name in env_names:
        argv += ["-x", name]
    return argv + list(command)


def horovodrun_argv(
    np: int,
    command: Sequence[str],
    *,
    controller: str = "gloo",
    hosts: Sequence[str] | None = None,
) -> list[str]:
    """horovodrun's command for `np` ranks of `command` over the Gloo or MPI controller.

    horovodrun passes its own environment to the ranks, so no variables are named here.

    Raises:
      ValueError: np < 1, an empty command, or an unknown controller.
    """
    if np < 1 or not command:
        raise ValueError(f"need np >= 1 and a command, got np={np} command={list(command)}")
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be gloo or mpi, got {controller!r}")
    return ["horovodrun", "-np", str(np), "-H", hosts_arg(hosts, np), f"--{controller}", *command]


def ompi_major_version(mpirun: str = "mpirun") -> int:
    """Major version of the installed Open MPI (from `mpirun --version`)."""
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    match = re.search(r"Open MPI\)? (\d+)\.", out.stdout)
    if not match:
        raise RuntimeError(f"cannot tell the Open MPI version from: {out.stdout.strip()[:200]!r}")
    return int(match.group(1))


def build(
    launcher: str, np: int, command: Sequence[str], hosts: Sequence[str] | None = None
) -> list[str]:
    """The argv for `launcher` on this machine (version, user and core count read here)."""
    if launcher == "mpirun":
        return mpirun_argv(
            np,
            command,
            hosts=hosts,
            env_names=forwarded_env_names(os.environ),
            as_root=os.geteuid() == 0,
            oversubscribe=hosts is None and np > (os.cpu_count() or 1),
            ompi_major=ompi_major_version(),
        )
    controller = {"horovodrun": "gloo", "horovodrun-gloo": "gloo", "horovodrun-mpi": "mpi"}
    if launcher not in controller:
        raise ValueError(f"unknown launcher {launcher!r}; known: mpirun, {', '.join(controller)}")
    return horovodrun_argv(np, command, controller=controller[launcher], hosts=hosts)


def main(argv: list[str] | None = None) -> int:
    """`python -m hvd_train.launch --np N [--launcher L] [--hosts h:s,..] [--dry-run] -- cmd`"""
    parser = argparse.ArgumentParser(prog="python -m hvd_train.launch", description=__doc__)
    parser.add_argument("--np", type=int, default=2, help="number of ranks [2]")
    parser.add_argument(
        "--launcher",
        default="mpirun",
        choices=["mpirun", "horovodrun", "horovodrun-gloo", "horovodrun-mpi"],
    )
    parser.add_argument("--hosts", help="comma-separated host:slots; default: localhost")
    parser.add_argument("--dry-run", action="store_true", help="print the command only")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program args ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    if args.np < 1:
        parser.error(f"--np must be >= 1, got {args.np}")
    full = build(args.launcher, args.np, command, args.hosts.split(",") if args.hosts else None)
    print(shlex.join(full), flush=True)
    if args.dry_run:
        return 0
    if shutil.which(full[0]) is None:
        print(f"launch: {full[0]} not found on PATH", file=sys.stderr)
        return 2
    os.execvp(full[0], full)


if __name__ == "__main__":
    sys.exit(main())
