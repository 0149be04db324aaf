"""The start of a job on every rank: what all ranks must agree on, checked in a fixed order.

A collective that only some settings run (the watchdog's address broadcast with `fault.watchdog`,
the data-cache vote with `data.cache`) hangs when ranks were started with different values of
those keys. So the first collective after Horovod starts compares the config and the versions;
then rank 0 checks what only it may touch (the data it will read first, the run directory it
writes) and every rank learns the outcome; the model's shapes are compared once it exists, before
the first collective that depends on it. Each check raises the same one-line error on every rank,
which the CLI shows once (rank 0's).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvd_train import comm
from hvd_train.core import config as config_lib
from hvd_train.core import guards, rundir
from hvd_train.core.config import Config
from hvd_train.errors import UserError, everywhere
from hvd_train.training import records


def agree_on_job(config: Config) -> list[str]:
    """Compare the config and the versions over ranks: the job's first collective.

    Returns:
      Every rank's host name, by rank.

    Raises:
      InconsistentRanks: ranks that differ from rank 0, by name (on every rank).
    """
    fingerprint = guards.job_fingerprint(config_lib.to_dict(config), records.versions())
    return _compare_over_ranks(fingerprint, "hvd_train.job_fingerprint")


def prepare_on_chief(config: Config, run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Every rank checks the data it will read, then rank 0 prepares the run directory
    (collectives: all learn the outcome).

    The data are checked first, so that a missing file leaves no run directory behind; the ranks
    check them because the launch host may not see the compute nodes' paths, and without a
    shared filesystem one host may lack a file the others have.

    Raises:
      UserError: the first failing rank's one line naming its host (data), or rank 0's (run
        directory), on every rank.
    """
    from hvd_train.data import sources

    on_every_rank(lambda: sources.check(config.data), "hvd_train.data_checks")
    on_chief(lambda: rundir.prepare(run_dir, resume, overwrite), "hvd_train.chief_checks")


def on_every_rank(work: Callable[[], object], name: str) -> None:
    """Run `work` on every rank; all learn every rank's UserError (one allgather) and raise the
    first, naming its rank and host, or nothing if every rank passed."""
    error = None
    try:
        work()
    except UserError as err:
        error = str(err)
    gathered = comm.allgather_object((error, socket.gethostname()), name=name)
    failed = [(rank, host, e) for rank, (e, host) in enumerate(gathered) if e is not None]
    if failed:
        rank, host, message = failed[0]
        where = f"rank {rank} on host {host}"
        others = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        local = len({h for _, h in gathered}) == 1
        raise everywhere(UserError(message if local else f"{where}{others}: {message}"))


def check_model(model: Any) -> None:
    """Compare the model's variable shapes over ranks, before any collective that depends on them.

    Raises:
      InconsistentRanks: ranks that built another model, by name (on every rank).
    """
    from hvd_train.keras.state import agreed_variables

    shapes = [list(v.shape) for v in agreed_variables(model)]
    _compare_over_ranks(guards.model_fingerprint(shapes), "hvd_train.model_fingerprint")


def _compare_over_ranks(fingerprint: dict, name: str) -> list[str]:
    """Every rank's fingerprint and host name (one allgather), compared with rank 0's; returns
    the host names by rank."""
    gathered = comm.allgather_object((fingerprint, socket.gethostname()), name=name)
    hosts = [host for _, host in gathered]
    guards.compare([f for f, _ in gathered], hosts=hosts)
    return hosts


def on_chief(work: Callable[[], object], name: str) -> None:
    """Run `work` on rank 0; every rank learns whether it raised a UserError (collective) and
    raises it too, so that no rank waits in the next collective for a rank 0 that has left."""
    error = None
    if comm.is_chief():
        try:
            work()
        except UserError as err:
            error = str(err)
    error = comm.broadcast_object(error, name=name)
    if error is not None:
        raise everywhere(UserError(error))
