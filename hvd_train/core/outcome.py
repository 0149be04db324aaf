"""How a job ended: one vocabulary for `status.json`, the result line and the exit codes.

Rank 0 writes the status of each launch to `run_dir/status.json`; `hvd-train launch` turns it into
its exit code where the launcher hides the job's own (horovodrun exits 1 whatever its ranks
returned). docs/failure-modes.md documents each code.
"""

from __future__ import annotations

import enum


class Status(str, enum.Enum):
    """How a launch ended (the strings are what `status.json` and the result line hold)."""

    FINISHED = "finished"  # every epoch trained
    PREEMPTED = "preempted"  # stopped on a signal at an agreed step, checkpoint written
    STALLED = "stalled"  # the watchdog saw no step finish within the bound
    LOST = "lost"  # a collective failed because ranks died
    DIVERGED = "diverged"  # the ranks' weights differ (fault.check_weights_every)
    WRITE_FAILED = "write_failed"  # rank 0 could not write one of the run's files

    def __str__(self) -> str:
        return self.value


EXIT_OK = 0
EXIT_USAGE = 2  # bad input, or ranks started inconsistently (hvd_train.errors.UserError)
EXIT_RANK_FAILED = 3  # a rank died or froze (stalled or lost): the job was ended; resume
EXIT_DIVERGED = 4  # ranks' weights differ
EXIT_WRITE_FAILED = 74  # rank 0 could not write a file of the run (EX_IOERR): fix, resume
EXIT_PREEMPTED = 75  # stopped at an agreed step with a checkpoint (EX_TEMPFAIL): resume

EXIT_CODES = {
    Status.FINISHED: EXIT_OK,
    Status.PREEMPTED: EXIT_PREEMPTED,
    Status.STALLED: EXIT_RANK_FAILED,
    Status.LOST: EXIT_RANK_FAILED,
    Status.DIVERGED: EXIT_DIVERGED,
    Status.WRITE_FAILED: EXIT_WRITE_FAILED,
}


def exit_code(status: str) -> int | None:
    """The exit code of a status string (as read from status.json), or None for an unknown one."""
    try:
        return EXIT_CODES[Status(status)]
    except ValueError:
        return None
