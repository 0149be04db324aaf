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

from hvd_train.core import buckets, launch
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


# (name, launcher argv, workers, the interface the gradients take). No launch names Open MPI's
# interfaces in the environment: the job's network is the rule's (hvd_train.core.network).
# horovodrun's driver looks the job's interface up by name in its own namespace, so it runs on h1,
# as from a cluster's first node (from the root namespace the launch is refused with one line).
LAUNCH = ["bash", "mpi_scripts/cluster/cluster.sh", "exec", "h1"]
HVD_TRAIN = [jobs.PYTHON, "-m", "hvd_train.cli"]
TWO = ["launch", "--np", "2", "--hosts", "h1:1,h2:1"]
MPIRUN = ["mpirun", "--allow-run-as-root", "-x", "PATH", "-x", "TF_CPP_MIN_LOG_LEVEL=2"]
JOBS = [
    ("mpirun-2x1", [*HVD_TRAIN, "launch", "--np", "2", "--hosts", "h1:1,h2:1", "--"], 2, "data0"),
    (
        "mpirun-uneven",
        [*HVD_TRAIN, "launch", "--np", "3", "--hosts", "h1:2,h2:1", "--"],
        3,
        "data0",
    ),
    # Plain mpirun, no flag, no variable: each rank follows the route to mpirun's host.
    ("plain-mpirun", [*MPIRUN, "-np", "2", "-H", "h1:1,h2:1", *HVD_TRAIN], 2, "data0"),
    (
        "horovodrun-gloo",
        [*LAUNCH, *HVD_TRAIN, *TWO, "--launcher", "horovodrun", "--"],
        2,
        "data0",
    ),
    (
        "horovodrun-mpi",
        [*LAUNCH, *HVD_TRAIN, *TWO, "--launcher", "horovodrun-mpi", "--"],
        2,
        "data0",
    ),
    # The override moves everything to the management network.
    (
        "mpirun-on-mgmt",
        [*HVD_TRAIN, *TWO, "--network-interface", "198.18.2.0/24", "--"],
        2,
        "mgmt0",
    ),
]


@pytest.mark.parametrize(("name", "launcher", "workers", "carrier"), JOBS, ids=[j[0] for j in JOBS])
def test_default_job_across_hosts(
    cluster: Cluster, name: str, launcher: list[str], workers: int, carrier: str
):
    """One epoch of the default job across h1 and h2: its gradients cross h2's `carrier`."""
    daemons = {host: cluster.pids(host) for host in cluster.hosts}
    start = counters("h2")
    run_dir = cluster.state / "shared" / name
    job = jobs.run([*launcher, *TRAIN, "--set", f"run_dir={run_dir}"], 600, env=cluster.env())
    end = counters("h2")
    assert job.returncode == 0, job.tail()
    # Rank 0's result line; horovodrun --mpi prefixes it with "[1,0]<stdout>:".
    # horovodrun --mpi may append an empty chunk's prefix ("[1,0]<stdout>:") to the line.
    results = re.findall(
        r"^(?:\[(?:1,)?0\]<stdout>:)?result (\{.*\})(?:\[(?:1,)?\d+\]<std(?:out|err)>:)?$",
        job.output,
        re.M,
    )
    assert len(results) == 1 and json.loads(results[0])["workers"] == workers, job.tail()
    run = json.loads((run_dir / "run.json").read_text())
    placed = {"h1": list(range(workers - 1)), "h2": [workers - 1]}
    assert (run["size"], run["local_size"], run["cross_size"]) == (workers, workers - 1, 2)
    assert run["hosts"] == placed
    # Each rank is pinned to its host's one CPU (of the machine's two), which rank 0's compute
    # fills: the start rules count the pinned CPU (the long cycle; Open MPI also yields).
    assert run["horovod_env"].get("HOROVOD_CYCLE_TIME") == "50", run["horovod_env"]
    if run["controller"] == "mpi":
        assert run["openmpi_env"].get("OMPI_MCA_mpi_yield_when_idle") == "1", run["openmpi_env"]
    if workers == 2:
        # No launcher gave the ranks the link's rate, and the buckets follow it on these filled
        # hosts: they measured it at start. The unshaped veth reads above the rule's thresholds
        # (9-30 Gbit/s: the probe's sender shares the host's one core with the job's threads).
        assert run["link_gbit_from"].startswith("measured at start: "), run["link_gbit_from"]
        assert run["link_gbit"] > buckets.MPI_SMALL_BUCKETS_FROM_GBIT, run["link_gbit"]
    else:
        # Two ranks take turns on h1's core: the rule keeps small buckets whatever the link.
        assert run["link_gbit"] is None and run["link_gbit_from"] is None, run
    grown = {key: end[key] - start[key] for key in start}
    steps = steps_per_epoch(DIGITS_TRAIN_SAMPLES, size=workers, per_rank_batch_size=32)
    print(f"{name}: {job.seconds:.1f} s, {steps} steps, link {run['link_gbit']}, h2 bytes {grown}")
    # h2's one rank sends and receives at least the whole gradient each step (every element of
    # its own gradient must leave it, every other rank's must reach it), all of it on `carrier`.
    gradients = GRADIENT_BYTES * steps
    assert grown[f"{carrier}.tx"] >= gradients and grown[f"{carrier}.rx"] >= gradients, grown
    # The other interfaces (ssh, Open MPI's out-of-band channel, Horovod's task services on
    # mgmt0; the decoy): next to nothing.
    for key in (k for k in grown if not k.startswith(carrier)):
        assert grown[key] < gradients / 100, (key, grown)
    # The watchdog listened on the same interface.
    assert re.search(
        rf"watchdog: rank 0 listens on 198\.18\.{'2' if carrier == 'mgmt0' else '1'}\.1:",
        job.output,
    ), job.tail()
    # Nothing of the job left on any host: each runs its daemons alone.
    for host in cluster.hosts:
        assert cluster.pids(host) == daemons[host], f"{host}: {cluster.pids(host)}"


# (where the launch runs, the override, the refusal): the decoy has the same address on every
# host; a network one host lacks. Each host is asked (over the launcher's ssh) before any worker
# starts.
REFUSED = [
    ([], "198.19.255.0/24", "hosts h1 and h2 both have 198.19.255.1 on it, a host-local"),
    (LAUNCH, "docker0", "hosts h1 and h2 both have 198.19.255.1 on it, a host-local"),
    ([], "198.18.3.0/24", "host h1 has no interface in 198.18.3.0/24"),
]


@pytest.mark.parametrize(
    ("where", "override", "refusal"), REFUSED, ids=["decoy-from-root", "decoy-from-h1", "none"]
)
def test_a_job_on_the_decoy_is_refused(cluster: Cluster, where, override: str, refusal: str):
    argv = [*where, *HVD_TRAIN, "launch", "--np", "2", "--hosts", "h1:1,h2:1"]
    argv += ["--network-interface", override, "--", *TRAIN]
    job = jobs.run([*argv, "--set", f"run_dir={cluster.state}/shared/decoy"], 60, env=cluster.env())
    assert job.returncode == 2, job.tail()
    errors = [line for line in job.output.splitlines() if "error" in line]
    assert len(errors) == 1 and refusal in errors[0], job.output
    assert not (cluster.state / "shared" / "decoy").exists()


def test_auto_launcher_measures_the_link_where_the_ranks_fill_the_hosts(cluster: Cluster):
    """`--launcher auto` asks h1 and h2 for their CPUs and GPUs over ssh before any worker
    starts. Where one rank fills each one-CPU host it measures TCP from h1 to h2: at the
    unshaped link's rate it runs mpirun, with h1's side shaped to 1 Gbit/s horovodrun's Gloo.
    Where two ranks per host take turns on its core it measures nothing and runs mpirun."""
    if "tbf" in on_host("h1", "tc", "qdisc", "show", "dev", "data0"):
        pytest.skip("the cluster's links are shaped already (RATE)")
    auto = ["--launcher", "auto", "--"]
    filled = "h1: 1 rank(s), 1 CPU(s), 0 GPU(s), h2: 1 rank(s), 1 CPU(s), 0 GPU(s)"
    said = f"CPU-only hosts whose ranks' compute fills every core ({filled}); TCP to h2: "
    measured = re.compile(r"TCP to h2: ([0-9.]+) Gbit/s")
    dry = [*LAUNCH, *HVD_TRAIN, *TWO, "--dry-run", *auto, *TRAIN]
    fast = jobs.run(dry, 120, env=cluster.env())
    assert fast.returncode == 0, fast.tail()
    assert f"launch: --launcher auto: mpirun ({said}" in fast.output, fast.tail()
    assert re.search(r"^mpirun -np 2 ", fast.output, re.M), fast.tail()
    # The unshaped veth carries more than the rate under which Gloo is chosen: the negative
    # control of the shaped band below.
    unshaped = float(measured.search(fast.output)[1])
    assert unshaped >= launch.GLOO_BELOW_GBIT, fast.tail()
    run_dir = cluster.state / "shared" / "auto"
    # h1's side of the data link shaped as `RATE=1gbit cluster.sh up` shapes it.
    shaping = ["dev", "data0", "root", "tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"]
    on_host("h1", "tc", "qdisc", "replace", *shaping)
    try:
        argv = [*LAUNCH, *HVD_TRAIN, *TWO, *auto, *TRAIN, "--set", f"run_dir={run_dir}"]
        job = jobs.run(argv, 600, env=cluster.env())
    finally:
        on_host("h1", "tc", "qdisc", "del", "dev", "data0", "root")
    assert job.returncode == 0, job.tail()
    assert f"launch: --launcher auto: horovodrun-gloo ({said}" in job.output, job.tail()
    # TCP's goodput through a 1 Gbit/s token bucket.
    shaped = float(measured.search(job.output)[1])
    print(f"auto: TCP h1 -> h2 {unshaped} Gbit/s unshaped, {shaped} at 1 Gbit/s")
    assert 0.8 < shaped <= 1.0, job.tail()
    run = json.loads((run_dir / "run.json").read_text())
    assert run["controller"] == "gloo" and run["hosts"] == {"h1": [0], "h2": [1]}
    assert run["horovod_env"].get("HOROVOD_CYCLE_TIME") == "50", run["horovod_env"]
    # The ranks were given the rate auto measured, and sized their gradient buckets by it.
    assert run["link_gbit"] == shaped, run["link_gbit"]
    given = f"link {shaped:g} Gbit/s, from HVD_TRAIN_LINK_GBIT"
    assert re.search(rf"gradient buckets: \d+, .*; gloo, {given}\)", job.output), job.tail()
    four = ["launch", "--np", "4", "--hosts", "h1:2,h2:2", "--dry-run", *auto, *TRAIN]
    shared = jobs.run([*LAUNCH, *HVD_TRAIN, *four], 120, env=cluster.env())
    assert shared.returncode == 0, shared.tail()
    assert "launch: --launcher auto: mpirun (not every host" in shared.output
    assert "h2: 2 rank(s), 1 CPU(s), 0 GPU(s)" in shared.output and "TCP to" not in shared.output
    assert re.search(r"^mpirun -np 4 ", shared.output, re.M), shared.tail()


def test_a_plain_mpirun_job_measures_the_link_at_start(cluster: Cluster):
    """mpirun alone gives the ranks no link rate: where one rank fills each one-CPU host they
    measure it at start (hvd_train.comm.linkprobe), and size the gradient buckets by it. With
    h1's side of the link shaped to 1 Gbit/s, they read it (h1 -> h2); unshaped, the default
    job above reads several times more (the negative control)."""
    if "tbf" in on_host("h1", "tc", "qdisc", "show", "dev", "data0"):
        pytest.skip("the cluster's links are shaped already (RATE)")
    run_dir = cluster.state / "shared" / "probed"
    shaping = ["dev", "data0", "root", "tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"]
    on_host("h1", "tc", "qdisc", "replace", *shaping)
    try:
        argv = [*MPIRUN, "-np", "2", "-H", "h1:1,h2:1", *HVD_TRAIN, *TRAIN]
        job = jobs.run([*argv, "--set", f"run_dir={run_dir}"], 600, env=cluster.env())
    finally:
        on_host("h1", "tc", "qdisc", "del", "dev", "data0", "root")
    assert job.returncode == 0, job.tail()
    run = json.loads((run_dir / "run.json").read_text())
    probed = "measured at start: the slowest of 2 link(s): h1 -> h2"
    assert run["link_gbit_from"] == probed, run
    # TCP's goodput through a 1 Gbit/s token bucket, as --launcher auto reads it (0.96).
    rate = run["link_gbit"]
    assert 0.8 < rate <= 1.0, rate
    # Under Open MPI below MPI_SMALL_BUCKETS_FROM_GBIT: one group; below MPI_ALONE_FROM_GBIT no
    # gradient goes alone.
    found = r"gradient buckets: 1, one group, none alone \(.*; mpi, link (.*)\)$"
    line = re.search(found, job.output, re.M)
    assert line and line[1] == f"{rate:g} Gbit/s, {probed}", job.tail()


def test_horovodrun_from_outside_the_hosts_is_refused(cluster: Cluster):
    argv = [*HVD_TRAIN, "launch", "--np", "2", "--hosts", "h1:1,h2:1", "--launcher", "horovodrun"]
    job = jobs.run([*argv, "--", *TRAIN], 60, env=cluster.env())
    assert job.returncode == 2, job.tail()
    errors = [line for line in job.output.splitlines() if "error" in line]
    assert (
        len(errors) == 1
        and "198.18.1.0/24 is hvdc-data here, data0 on h1, data0 on h2" in errors[0]
    ), errors
