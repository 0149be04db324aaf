"""Rank 0's records of a run: `run.json` (once), one `launches.jsonl` line and the `config.yaml` in
force per launch, `status.json` (how the launch ended), and atomic writes for all of them."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from hvd_train import comm
from hvd_train.core import config as config_lib
from hvd_train.core import inject
from hvd_train.core.outcome import Status


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, str | None]:
    """The software every rank must share."""
    import keras
    import tensorflow as tf

    from hvd_train import doctor

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "horovod": doctor.package_version("horovod"),
        "hvd_train": doctor.package_version("hvd_train"),
    }


def placement(hosts: list[str]) -> dict[str, list[int]]:
    """{host name: its ranks}, in the order of each host's first rank, from the host names by
    rank (`start.agree_on_job`)."""
    placed: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        placed.setdefault(host, []).append(rank)
    return placed


def run_record(config: Any, argv: list[str], size: int) -> dict[str, Any]:
    """What is saved with every launch: config, command, placement (Horovod's local and cross
    size on rank 0), the link rate the buckets followed, versions, Horovod's and Open MPI's
    settings, revision."""
    topology = comm.topology()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": argv,
        "size": size,
        "local_size": topology.local_size,
        "cross_size": topology.cross_size,
        "controller": comm.controller(),
        # The link rate the gradient buckets followed, or None, and where it came from.
        "link_gbit": comm.link_gbit(),
        "link_gbit_from": comm.link_gbit_from(),
        "versions": versions(),
        "horovod_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("HOROVOD_")},
        # Open MPI's settings in this rank's environment (the user's, or hvd_train.init()'s).
        "openmpi_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("OMPI_MCA_")},
        "git_revision": _git_revision(),
        "config": config_lib.to_dict(config),
    }


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def record_launch(run_dir: Path, config: Any, argv: list[str], size: int, **fields: Any) -> None:
    """Rank 0, at the start of a launch: run.json if the run is new (with `fields`), one
    launches.jsonl line (argv, size, and `fields`), and the config in force as config.yaml."""
    if not (run_dir / "run.json").exists():
        record = {**run_record(config, argv, size), **fields}
        atomic_write(run_dir / "run.json", json.dumps(record, indent=1))
    inject.fail_point("run_record", run_dir / "launches.jsonl")
    with (run_dir / "launches.jsonl").open("a") as f:
        launch = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": argv}
        f.write(json.dumps({**launch, "size": size, **fields}) + "\n")
    (run_dir / "config.yaml").write_text(config_lib.dump(config))


def write_status(run_dir: Path, status: Status, **fields: Any) -> None:
    """Rank 0's run_dir/status.json: how the last launch ended (`core.outcome.Status`);
    `hvd-train launch` turns it into its exit code."""
    record = {"status": str(status), "time": time.time(), "pid": os.getpid(), **fields}
    inject.fail_point("status.json", run_dir / "status.json")
    atomic_write(run_dir / "status.json", json.dumps(record, indent=1))


def history_records(history: dict[str, list[float]]) -> list[dict[str, float]]:
    """Keras's History (one list per metric) as one record per epoch."""
    return [
        dict(zip(history, values, strict=True)) for values in zip(*history.values(), strict=True)
    ]
