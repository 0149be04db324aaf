"""The cluster itself, and the default job across its hosts under mpirun and horovodrun (Gloo).

test_teardown_leaves_the_machine_as_it_was runs first, before the session's cluster is up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
import pytest
from hosts import INTERFACES, STATE, Cluster, counters, machine_state, on_host, script

from hvd_train.data.sharding import steps_per_epoch

# cnn on the 8x8 digits (tests/unit/test_models.py pins it): every step allreduces this many
# float32 gradients.
CNN_PARAMETERS = 151306
GRADIENT_BYTES = 4 * CNN_PARAMETERS
# The digits' 1797 samples less the validation fifth (359); per epoch 22 steps on 2 ranks of 32.
DIGITS_TRAIN_SAMPLES = 1797 - 359
TRAIN = [
    "train",
    "--config",
    "configs/digits.yaml",
    "--set",
    "train.epochs=1",
    "--set",
    "optimizer.warmup_epochs=0",
]


def test_teardown_leaves_the_machine_as_it_was(before):
    # The largest cluster, shaped: 4 hosts on the cores in turn, a 1 Gbit/s tbf on every data link.
    script("up", HOSTS="4", RATE="1gbit")
    up = machine_state()
    assert up != before
    assert any(link.startswith("hvdc-h4d@") for link in up["links"]) and "h4" in up["netns"]
    assert script("up", HOSTS="4", RATE="1gbit").stdout.startswith("cluster: up already")
    cores = os.cpu_count()
    for n in range(1, 5):
        host = f"h{n}"
        assert on_host(host, "hostname").strip() == host
        allowed = on_host(host, "sh", "-c", "taskset -pc $$")  # "pid P's current affinity list: 1"
        assert allowed.split(":")[-1].strip() == str((n - 1) % cores)
        qdisc = on_host(host, "tc", "qdisc", "show", "dev", "data0")
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
    script("down")
    assert machine_state() == before
    script("down")  # safe twice
    assert machine_state() == before
    assert not STATE.exists()


def test_each_host_has_its_own_name_tmp_cpu_and_interfaces(cluster: Cluster):
    for n, host in enumerate(cluster.hosts, start=1):
        assert on_host(host, "hostname").strip() == host
        assert on_host(host, "nproc").strip() == "1"  # one CPU per host (wrapping around)
        assert sorted(on_host(host, "ls", "/sys/class/net").split()) == sorted(["lo", *INTERFACES])
        addresses = on_host(host, "ip", "-o", "-4", "addr", "show")
        assert f"198.18.1.{n}/24" in addresses and f"198.18.2.{n}/24" in addresses
        assert "198.19.255.1/24" in addresses  # the decoy: the same on every host
        on_host(host, "sh", "-c", f"echo {host} >/tmp/who; echo {host} >/dev/shm/who")
        on_host(host, "sh", "-c", f"echo {host} >{cluster.state}/scratch/who")
    for host in cluster.hosts:
        for private in ("/tmp/who", "/dev/shm/who", f"{cluster.state}/scratch/who"):
            assert on_host(host, "cat", private).strip() == host
            assert not Path(private).exists()  # nor in the root namespace
    (cluster.state / "shared" / "seen").write_text("root")
    assert on_host("h2", "cat", f"{cluster.state}/shared/seen") == "root"


def test_ssh_checks_host_keys(cluster: Cluster):
    config = str(cluster.state / "ssh_config")
    for host in cluster.hosts:
        done = subprocess.run(
            ["ssh", "-F", config, host, "hostname", "&&", "nproc"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [host, "1"]  # the session inherits the host's CPU set
    # horovodrun's `ssh -o StrictHostKeyChecking=no`, through the cluster's ssh on PATH, with
    # the host's key unknown: refused.
    known = cluster.state / "known_hosts"
    saved = known.read_text()
    known.write_text("\n".join(line for line in saved.splitlines() if not line.startswith("h2,")))
    try:
        done = subprocess.run(
            [str(cluster.state / "bin" / "ssh"), "-o", "StrictHostKeyChecking=no", "h2", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        known.write_text(saved)
    assert done.returncode == 255 and "Host key verification failed" in done.stderr
    # sshd listens on the management address only.
    done = subprocess.run(
        ["ssh", "-F", config, "-o", "HostName=198.18.1.2", "h2", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 255


# (name, launcher argv up to "--", workers, run from h1): horovodrun's driver must run on a host
# that has the interface it picks (it looks the name up in its own namespace; from the root
# namespace: KeyError 'mgmt0'), so it runs on h1, as from a cluster's first node.
LAUNCH = ["bash", "mpi_scripts/cluster/cluster.sh", "exec", "h1"]
HVD_TRAIN = [jobs.PYTHON, "-m", "hvd_train.cli"]
JOBS = [
    ("mpirun-2x1", [*HVD_TRAIN, "launch", "--np", "2", "--hosts", "h1:1,h2:1"], 2),
    ("mpirun-uneven", [*HVD_TRAIN, "launch", "--np", "3", "--hosts", "h1:2,h2:1"], 3),
    (
        "horovodrun-gloo",
        [
            *LAUNCH,
            *HVD_TRAIN,
            "launch",
            "--np",
            "2",
            "--hosts",
            "h1:1,h2:1",
            "--launcher",
            "horovodrun",
        ],
        2,
    ),
    # horovodrun --mpi picks interfaces itself (its -mca btl_tcp_if_include beats the
    # environment's): left to choose, it put half of the gradients on mgmt0, so it is named.
    (
        "horovodrun-mpi",
        [
            *LAUNCH,
            "horovodrun",
            "-np",
            "2",
            "-H",
            "h1:1,h2:1",
            "--mpi",
            "--network-interfaces",
            "data0",
            *HVD_TRAIN,
        ],
        2,
    ),
]


@pytest.mark.parametrize(("name", "launcher", "workers"), JOBS, ids=[j[0] for j in JOBS])
def test_default_job_across_hosts(cluster: Cluster, name: str, launcher: list[str], workers: int):
    """One epoch of the default job across h1 and h2: its gradients cross h2's data interface."""
    start = counters("h2")
    run_dir = f"run_dir={cluster.state}/shared/{name}"
    separator = ["--"] if "launch" in launcher else []
    job = jobs.run([*launcher, *separator, *TRAIN, "--set", run_dir], 600, env=cluster.env())
    end = counters("h2")
    assert job.returncode == 0, job.tail()
    # Rank 0's result line; horovodrun --mpi prefixes it with "[1,0]<stdout>:".
    results = re.findall(r"^(?:\[(?:1,)?0\]<stdout>:)?result (\{.*\})$", job.output, re.M)
    assert len(results) == 1 and json.loads(results[0])["workers"] == workers, job.tail()
    grown = {key: end[key] - start[key] for key in start}
    steps = steps_per_epoch(DIGITS_TRAIN_SAMPLES, size=workers, per_rank_batch_size=32)
    print(f"{name}: {job.seconds:.1f} s, {steps} steps, h2 bytes {grown}")
    # h2's one rank sends and receives at least the whole gradient each step (every element of
    # its own gradient must leave it, every other rank's must reach it), all of it on data0.
    gradients = GRADIENT_BYTES * steps
    assert grown["data0.tx"] >= gradients and grown["data0.rx"] >= gradients, grown
    # Management (ssh, Open MPI's out-of-band channel, Horovod's task services) and the decoy:
    # next to nothing.
    for key in ("mgmt0.tx", "mgmt0.rx", "docker0.tx", "docker0.rx"):
        assert grown[key] < gradients / 100, (key, grown)
    # Nothing of the job left on any host: each runs its sshd alone.
    for host in cluster.hosts:
        sshd = (cluster.state / host / "sshd.pid").read_text().split()
        pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
        assert pids.stdout.split() == sshd, f"{host} still runs {pids.stdout.split()}"
