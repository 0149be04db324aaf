"""Horovod Elastic's machinery for the toolkit's own elastic training (`training/elastic.py`).

Horovod's `horovod.tensorflow.elastic.run` counts a TensorFlow error as a failed collective only
when it names `HorovodAllreduce`, `HorovodAllgather` or `HorovodBroadcast`, and silently swallows
other errors of that type; the failures met here name `HorovodGroupedAllreduce` and read "Horovod
has been shut down". So the run loop is Horovod's common `run_fn` with the check below.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from hvd_train.comm import horovod as backend
from hvd_train.comm import reduction

log = logging.getLogger("hvd_train")

HorovodInternalError = backend.HorovodInternalError
HostsUpdatedInterrupt = backend.HostsUpdatedInterrupt
# Horovod's elastic state: commit, restore, sync, and the check for added or removed hosts.
State = backend.ElasticState


@contextlib.contextmanager
def collective_failures() -> Iterator[None]:
    """A TensorFlow error of a Horovod op (a peer died, or Horovod shut down under the op; Gloo: a
    closed connection), whatever the op's name, becomes Horovod's HorovodInternalError."""
    try:
        yield
    except tf.errors.OpError as err:
        lines = [line.strip() for line in err.message.splitlines() if line.strip()]
        horovod = [line for line in lines if "Horovod" in line or "gloo" in line.lower()]
        if not horovod:
            raise
        problem = f"{type(err).__name__}: {horovod[0]}"
        log.warning("elastic: a collective failed (%s); back to the last commit", problem)
        raise HorovodInternalError(err) from err


def reset() -> None:
    """Horovod again, with the workers horovodrun assigns now (as horovod.tensorflow.elastic
    does): the elastic hook run after a failure or a change of hosts."""
    backend.stop()
    reduction.forget()  # the hosts and process sets of the Horovod that stopped
    backend.start()


def run(func: Any) -> Any:
    """`horovod.common.elastic.run_fn` for Keras 3: `func(state, ...)` is run again after every
    reset, with the state restored (a failure) or as it is (hosts added or removed), then synced.

    A TensorFlow error of a Horovod op counts as a failed collective (HorovodInternalError); any
    other error ends the worker.
    """

    def call(state: State, *args: Any) -> Any:
        try:
            with collective_failures():
                return func(state, *args)
        except HostsUpdatedInterrupt:
            log.info("elastic: hosts were added or removed; resetting at this commit")
            raise

    return backend.elastic_run(call, reset)
