"""`benchmarks/run.sh network` in its QUICK mode: the cluster (2 hosts, one CPU each) at 1 Gbit/s,
ResNet-20, the toolkit and a bare Keras 3 per-tensor wrapper on 2 hosts x 1 slot; the JSON's
structure, its numbers positive and consistent with each other and with the link's rate.

It brings its own cluster up and down (cluster.sh, root and CAP_NET_ADMIN) holding the machine's
cluster lock, so it waits for any other cluster, e.g. the cluster tier's. Elsewhere it skips (with
CI=true, fails) with one line saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from jobs import REPO

from hvd_train.core import buckets

STATE = Path("/run/hvd_train_cluster_bench")
TC_RATE_MB_PER_S = 125.0  # 1gbit, each way


def unusable() -> str | None:
    if os.geteuid() != 0:
        return "the network benchmark brings a cluster up: it needs root (and CAP_NET_ADMIN)"
    for tool in ("ip", "nsenter", "unshare", "taskset", "ssh-keygen", "flock", "tc"):
        if shutil.which(tool) is None:
            return f"the network benchmark needs {tool}"
    if not Path("/usr/sbin/sshd").exists():
        return "the network benchmark needs sshd: run mpi_scripts/cluster/install.sh"
    return None


def test_quick_network_benchmark_writes_consistent_results(tmp_path: Path):
    reason = unusable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    env = {**os.environ, "QUICK": "1", "RATES": "1gbit", "OUT": str(tmp_path), "STATE": str(STATE)}
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "run.sh"), "network"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not STATE.exists() and not Path("/run/netns/h1").exists()  # the cluster is down
    result = json.loads((tmp_path / "network-quick.json").read_text())
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "network-quick-hidden.png",
        "network-quick-predicted.png",
        "network-quick.png",
    ]
    assert result["rates"] == ["1gbit"] and result["layouts"] == ["2x1"]
    [row] = result["rows"]
    assert (row["model"], row["stack"], row["size"]) == ("resnet20", "modern", 2)
    assert list(row["variants"]) == ["toolkit", "keras3-per-tensor"]
    # The delivered rate is below what tc lets through, and not far below it.
    assert 0.8 * TC_RATE_MB_PER_S < row["link"]["mb_per_s"] <= 1.02 * TC_RATE_MB_PER_S, row["link"]
    assert row["link"]["latency_us"] > 0
    # The selftest's allreduce crosses the same shaped link: it cannot move faster.
    assert 0 < row["link"]["allreduce_mb_per_s"] <= 1.02 * TC_RATE_MB_PER_S, row["link"]
    # So does --launcher auto's TCP probe (hvd_train.core.linkrate), in Gbit/s.
    assert 0.8 < row["link"]["tcp_probe_gbit_s"] * 125 / TC_RATE_MB_PER_S <= 1.0, row["link"]
    assert row["gradient_MB"] == pytest.approx(sum(row["gradient_bytes_per_tensor"]) / 1e6)
    for key in ("forward_ms", "backward_ms", "ceiling_ms", "allreduce_ms"):
        assert row[key] > 0, key
    assert row["ceiling_ms"] > row["forward_ms"]
    for name, v in row["variants"].items():
        assert len(v["times_ms"]) == result["steps"] and len(v["step_ms_per_rank"]) == 2, name
        assert v["step_ms"] > 0 and v["predicted_step_ms"] > row["ceiling_ms"], name
        assert v["residual"] == pytest.approx(v["step_ms"] / v["predicted_step_ms"] - 1)
        assert v["hidden"] == pytest.approx(
            (row["ceiling_ms"] + row["allreduce_ms"] - v["step_ms"]) / row["allreduce_ms"]
        )
    assert result["residuals"]["points"] == 2
    # The ranks were given the probe's reading, and the toolkit sent the buckets its rule gives
    # for it (2 one-CPU hosts that one rank each fills, Open MPI).
    assert row["ranks_link_gbit"] == round(row["link"]["tcp_probe_gbit_s"], 2)
    toolkit = row["variants"]["toolkit"]
    assert toolkit["link_gbit"] == row["ranks_link_gbit"]
    sizes = row["gradient_bytes_per_tensor"]
    size = buckets.bucket_bytes(sum(sizes), 2, None, False, link_gbit=row["ranks_link_gbit"])
    assert toolkit["buckets"] == len(buckets.layout(sizes, size)) == 1
