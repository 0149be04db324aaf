"""One point of fault injection for rank 0's files: `HVD_TRAIN_FAIL_IN=SECTION[:N]` and
`HVD_TRAIN_SLOW_IN=SECTION:SECONDS`.

Each write of rank 0's files calls `fail_point(section, path)` just before it touches the disk;
when `HVD_TRAIN_FAIL_IN` names that section, its N-th call (default: the first) raises
`InjectedWrite`, an OSError (EIO) naming the path, as a full disk or a lost file server would;
when `HVD_TRAIN_SLOW_IN` names it, every call first waits SECONDS, as a slow file server would
(the job must wait for it, not declare a stall). The variables are read once per process. Used
by the tests of `hvd_train.training.chief` and by users checking that a job on their cluster ends
cleanly, on every rank, when rank 0 cannot write, and waits when it writes slowly.

Standard library only: this is the framework-free core.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hvd_train.errors import ConfigError

log = logging.getLogger("hvd_train")

ENV = "HVD_TRAIN_FAIL_IN"
SLOW_ENV = "HVD_TRAIN_SLOW_IN"
# The sections of rank 0's work between collectives, in the order a run meets them.
SECTIONS = (
    "run_record",  # run.json, launches.jsonl, config.yaml at the start of a launch
    "tensorboard",  # logging.tensorboard: the train graph at the first step, each epoch's end
    "step_checkpoint",  # checkpoints/epoch-NNNN-step-SSSSSS (checkpoint.every_steps, a stop)
    "checkpoint",  # checkpoints/epoch-NNNN at an epoch's end
    "best_checkpoint",  # checkpoints/best
    "metrics.json",
    "metrics.csv",  # logging.csv
    "metrics.png",  # at the end of the launch
    "status.json",  # at the end of the launch
)


class InjectedWrite(OSError):
    """The write failure `HVD_TRAIN_FAIL_IN` asked for."""


@dataclass
class Plan:
    """Fail the `nth` write (1-based) of `section`; `seen` counts the writes so far."""

    section: str
    nth: int = 1
    seen: int = 0


def parse(value: str | None) -> Plan | None:
    """`SECTION` or `SECTION:N` as a Plan; None for an unset or empty value.

    Raises:
      ConfigError: an unknown section or an N that is not a positive integer.
    """
    if not value:
        return None
    section, _, nth = value.partition(":")
    if section not in SECTIONS:
        raise ConfigError(f"{ENV}: unknown section {section!r}; one of: {', '.join(SECTIONS)}")
    if not nth:
        return Plan(section)
    if not nth.isdigit() or int(nth) < 1:
        raise ConfigError(f"{ENV}: N in {value!r} must be a positive integer")
    return Plan(section, int(nth))


@functools.cache
def plan() -> Plan | None:
    """This process's plan, from the environment (read once).

    Raises:
      ConfigError: see `parse`.
    """
    return parse(os.environ.get(ENV))


def parse_slow(value: str | None) -> tuple[str, float] | None:
    """`SECTION:SECONDS` as (section, seconds); None for an unset or empty value.

    Raises:
      ConfigError: an unknown section, or SECONDS missing or not a number >= 0.
    """
    if not value:
        return None
    section, _, seconds = value.partition(":")
    if section not in SECTIONS:
        raise ConfigError(f"{SLOW_ENV}: unknown section {section!r}; one of: {', '.join(SECTIONS)}")
    try:
        delay = float(seconds)
    except ValueError:
        delay = -1.0
    if not delay >= 0:  # also NaN
        raise ConfigError(f"{SLOW_ENV}: SECONDS in {value!r} must be a number >= 0")
    return section, delay


@functools.cache
def slow() -> tuple[str, float] | None:
    """This process's delay, from the environment (read once).

    Raises:
      ConfigError: see `parse_slow`.
    """
    return parse_slow(os.environ.get(SLOW_ENV))


def fail_point(section: str, path: Path | str) -> None:
    """Where rank 0 is about to write `path` for `section`: raise the injected failure if this is
    the write `HVD_TRAIN_FAIL_IN` names.

    Raises:
      InjectedWrite: an OSError (EIO) whose filename is `path`.
    """
    delay = slow()
    if delay is not None and delay[0] == section:
        log.warning("%s=%s: delaying the write of %s", SLOW_ENV, os.environ[SLOW_ENV], path)
        time.sleep(delay[1])
    wanted = plan()
    if wanted is None or wanted.section != section:
        return
    wanted.seen += 1
    if wanted.seen != wanted.nth:
        return
    setting = f"{ENV}={os.environ.get(ENV)}"
    # The time lets a test measure how long the job takes to end after the failure.
    log.warning("%s: failing the write of %s (unix time %.3f)", setting, path, time.time())
    raise InjectedWrite(errno.EIO, f"{os.strerror(errno.EIO)} (injected: {setting})", str(path))
