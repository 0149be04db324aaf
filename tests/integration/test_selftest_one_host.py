"""`hvd-train selftest` on two ranks of this host, under mpirun and horovodrun (Gloo): a healthy
job exits 0 with the table and the JSON; a rank made slow for real (a busy process on its core)
exits non-zero naming it. Across hosts: tests/cluster/test_selftest.py."""

import json
import os
import re
import subprocess

import pytest
from jobs import FULL_ONLY, PYTHON, run

from hvd_train.core import launch

SELFTEST = [PYTHON, "-m", "hvd_train.cli", "selftest"]


# horovodrun (Gloo) in `make test-full`: CI's 90 minutes.
@pytest.mark.parametrize("launcher", ["mpirun", pytest.param("horovodrun", marks=FULL_ONLY)])
def test_a_healthy_job_on_one_host(tmp_path, launcher):
    report = tmp_path / "selftest.json"
    argv = [PYTHON, "-m", "hvd_train.cli", "launch", "--np", "2", "--launcher", launcher]
    job = run([*argv, "--", "selftest", "--json", str(report)], timeout=120)
    assert job.returncode == 0, job.tail()
    # horovodrun prefixes each line of rank 0 with "[0]<stdout>:".
    lines = [re.sub(r"^\[0\]<stdout>:", "", line) for line in job.output.splitlines()]
    assert any(
        re.fullmatch(r"selftest: 2 rank\(s\) on 1 host\(s\), controller \w+; .*", x) for x in lines
    )
    assert "pairs: none (one host)" in lines and "selftest: ok" in lines, job.tail()
    assert any(x.startswith("host ") and x.split()[-1] == "nccl" for x in lines), job.tail()
    data = json.loads(report.read_text())
    assert data["ok"] and data["problems"] == [] and data["links"] == []
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert len(data["hosts"]) == 1
    for r in data["ranks"]:
        assert r["collective_errors"] == [] and r["step_ms"] > 0
    assert {r["controller"] for r in data["ranks"]} == {"mpi" if launcher == "mpirun" else "gloo"}
    # One host: the allreduce is timed, and crosses no link.
    allreduce = data["allreduce"]
    assert allreduce["nbytes"] == 32 << 20 and allreduce["ranks"] == 2 and allreduce["hosts"] == 1
    assert allreduce["seconds"] > 0 and allreduce["mb_per_s"] is None
    assert any(x.startswith("allreduce of 33.6 MB on 2 rank(s): ") for x in lines), job.tail()


@FULL_ONLY  # about 85 s: CI's 90 minutes
def test_a_rank_slowed_by_a_busy_core_is_named(tmp_path):
    """Each rank bound to its own core, and rank 1's core kept busy by other processes: rank 1 is
    named, past the default --max-skew of 25%."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores: one per rank")
    report = tmp_path / "selftest.json"
    argv = launch.mpirun_argv(
        2,
        [*SELFTEST, "--json", str(report)],
        env_names=launch.forwarded_env_names(launch.launch_env(os.environ)),
        as_root=os.geteuid() == 0,
        ompi_major=launch.ompi_major_version(),
        bind_to="core",  # rank r on core r
    )
    # Three busy processes, each in a session of its own (the scheduler shares a core between
    # sessions): rank 1 keeps a quarter of its core, so its step is about 4 times rank 0's, 60%
    # over their median (the median of two is their mean), with room for other load on core 0.
    busy = [
        subprocess.Popen(
            ["taskset", "-c", "1", PYTHON, "-c", "while True: pass"], start_new_session=True
        )
        for _ in range(3)
    ]
    try:
        job = run(argv, timeout=120)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert job.returncode != 0, job.tail()
    skewed = re.findall(
        r"^PROBLEM: rank (\d) on host \S+: compute step .* slower than the median", job.output, re.M
    )
    assert skewed == ["1"], job.tail()
    data = json.loads(report.read_text())
    assert not data["ok"]
    step = {r["rank"]: r["step_ms"] for r in data["ranks"]}
    print(f"compute step per rank, ms: {step}")
    assert step[1] > 1.25 * step[0], step


def test_an_unwritable_json_path_fails_every_rank(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    argv = [PYTHON, "-m", "hvd_train.cli", "launch", "--np", "2", "--"]
    job = run([*argv, "selftest", "--json", str(blocked / "x.json")], timeout=120)
    assert job.returncode == 74, job.tail()
    assert "hvd-train: error: selftest: cannot write --json" in job.output
