"""Helpers of the cluster tier: `mpi_scripts/cluster/cluster.sh` from Python, and what a cluster
could leave behind on the machine."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))

SCRIPT = REPO / "mpi_scripts" / "cluster" / "cluster.sh"
STATE = Path(os.environ.get("HVD_TRAIN_CLUSTER_STATE", "/run/hvd_train_cluster_test"))
# Three hosts: selftest names the slow link of three (two pairs give no median to fall below).
HOSTS = 3
# Held by whoever has a cluster up on this machine (tests, `flock LOCK cluster.sh ...` by hand).
LOCK = Path("/run/hvd_train_cluster.lock")
INTERFACES = ("data0", "mgmt0", "docker0")


def script(
    *args: str, timeout: float = 120, check: bool = True, **settings: str
) -> subprocess.CompletedProcess:
    """Run cluster.sh with this session's state directory and host count (or `settings`)."""
    env = {**os.environ, "STATE": str(STATE), "HOSTS": str(HOSTS), **settings}
    done = subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"cluster.sh {' '.join(args)}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        )
    return done


def on_host(host: str, *argv: str, timeout: float = 60) -> str:
    """stdout of `argv` run on `host` (its namespaces and CPU)."""
    return script("exec", host, *argv, timeout=timeout).stdout


def counters(host: str) -> dict[str, int]:
    """Byte counters of the host's interfaces, as the host's own sysfs shows them."""
    paths = [f"/sys/class/net/{i}/statistics/{d}_bytes" for i in INTERFACES for d in ("rx", "tx")]
    values = on_host(host, "cat", *paths).split()
    names = [f"{i}.{d}" for i in INTERFACES for d in ("rx", "tx")]
    return dict(zip(names, map(int, values), strict=True))


def machine_state() -> dict[str, object]:
    """What a cluster could leave behind: interfaces, namespaces, mounts, daemons, files."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    sshd = subprocess.run(["pgrep", "-f", f"sshd -f {STATE}"], capture_output=True, text=True)
    # SLURM's daemons (munged, slurmctld, slurmd: mpi_scripts/cluster/slurm.sh) and any job step.
    slurm = subprocess.run(
        ["pgrep", "-f", f"^(munged|slurmctld|slurmd) .*{STATE}/"], capture_output=True, text=True
    )
    steps = subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True, text=True)
    return {
        "links": sorted(line.split(":")[1].strip() for line in links.stdout.splitlines()),
        "netns": netns.stdout,
        "mounts": sorted(
            line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
        ),
        "etc_hosts_sha256": hashlib.sha256(Path("/etc/hosts").read_bytes()).hexdigest(),
        "cluster_sshd": sshd.stdout.split(),
        "cluster_slurm": slurm.stdout.split(),
        "slurmstepd": steps.stdout.split(),
        "state_dir": STATE.exists(),
        "run_sshd": Path("/run/sshd").exists(),
    }


def unusable() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "the cluster tier needs root (and CAP_NET_ADMIN) on Linux"
    for tool in ("ip", "nsenter", "unshare", "taskset", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"the cluster tier needs {tool}"
    if not Path("/usr/sbin/sshd").exists():
        return "the cluster tier needs sshd: run mpi_scripts/cluster/install.sh"
    probe = subprocess.run(
        ["ip", "link", "add", "hvdc-probe", "type", "bridge"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"the cluster tier needs CAP_NET_ADMIN: {probe.stderr.strip()}"
    subprocess.run(["ip", "link", "del", "hvdc-probe"], check=True)
    # The first `ip netns add` since boot mounts /run/netns, and the mount stays: made here,
    # before the machine's state is taken, so that the first cluster on a fresh machine leaves
    # the machine as it found it (its teardown check failed on that mount alone).
    probe = subprocess.run(["ip", "netns", "add", "hvdc-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the cluster tier needs network namespaces: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", "hvdc-probe"], check=True)
    return None


@dataclass
class Cluster:
    state: Path
    hosts: list[str]
    daemons: dict[str, set[str]] = field(default_factory=dict)  # each host's, once it is up

    def pids(self, host: str) -> set[str]:
        """Every process running on `host` (its daemons, and what a job left)."""
        listed = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
        return set(listed.stdout.split())

    def env(self) -> dict[str, str]:
        """What mpirun and horovodrun need on this cluster (`cluster.sh env`), as a dict."""
        env = {"STATE": str(self.state), "HOSTS": str(len(self.hosts))}
        for line in script("env").stdout.splitlines():
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = value.strip('"')
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = f"{self.state}/bin:{venv_bin}:{os.environ['PATH']}"
        return env
