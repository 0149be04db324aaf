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

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvd_train import comm
from hvd_train.core import config as config_lib
from hvd_train.core import guards, rundir
from hvd_train.core.config import Config
from hvd_train.errors import UserError, everywhere
from hvd_train.training import records


def agree_on_job(config: Config) -> None:
    """Compare the config and the versions over ranks: the job's first collective.

    Raises:
      InconsistentRanks: ranks that differ from rank 0, by name (on every rank).
    """
    fingerprint = guards.job_fingerprint(config_lib.to_dict(config), records.versions())
    guards.compare(comm.allgather_object(fingerprint, name="hvd_train.job_fingerprint"))


def prepare_on_chief(config: Config, run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Rank 0 checks the data and prepares the run directory (collective: all learn the outcome).

    The data are checked first, so that a missing file leaves no run directory behind; rank 0
    checks them because the launch host may not see the compute nodes' paths.

    Raises:
      UserError: rank 0's one line (data or run directory), on every rank.
    """
    from hvd_train.data import sources

    def check() -> None:
        sources.check(config.data)
        rundir.prepare(run_dir, resume, overwrite)

    on_chief(check, "hvd_train.chief_checks")


def check_model(model: Any) -> None:
    """Compare the model's variable shapes over ranks, before any collective that depends on them.

    Raises:
      InconsistentRanks: ranks that built another model, by name (on every rank).
    """
    from hvd_train.keras.state import agreed_variables

    shapes = [list(v.shape) for v in agreed_variables(model)]
    fingerprint = guards.model_fingerprint(shapes)
    guards.compare(comm.allgather_object(fingerprint, name="hvd_train.model_fingerprint"))


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
