"""Stopping at a step every rank agrees on, through the step's own gradient allreduce.

A stop signal reaches ranks at different moments, or one rank only; a rank that stopped where it
got the signal would leave the others waiting in a collective it never joins. Instead each rank
adds a scalar flag, 1 once it has been asked to stop, to the one grouped allreduce of the
gradients: the reduced flag is non-zero on every rank after the same step, and all stop there. No
extra collective runs, and reading the result after a step costs one scalar copy. (Keras 2, with
Horovod's own optimizer: a scalar allreduce beside the gradients', in the same step; see
`keras/classic.py`.)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvd_train import comm

_ATTRIBUTE = "_hvd_train_stop"


class StopFlags:
    """This rank's request (`local`) and the reduced flag of the last allreduce (`agreed`).

    Plain tf.Variables held outside the optimizer's variables: never checkpointed or broadcast, so
    a resumed run does not start out stopping.
    """

    def __init__(self) -> None:
        with tf.init_scope():
            self.local = tf.Variable(0.0, trainable=False, name="hvd_train_stop_local")
            self.agreed = tf.Variable(0.0, trainable=False, name="hvd_train_stop_agreed")


def attach(optimizer: Any) -> StopFlags:
    """Give a distributed optimizer its flags (made eagerly, before any step is traced)."""
    flags = StopFlags()
    object.__setattr__(optimizer, _ATTRIBUTE, flags)
    return flags


def flags_of(optimizer: Any) -> StopFlags | None:
    while optimizer is not None:
        flags = getattr(optimizer, _ATTRIBUTE, None)
        if flags is not None:
            return flags
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def with_flag(tensors: list[Any], flags: StopFlags | None) -> list[Any]:
    """The gradients to allreduce, plus the flag (in their dtype: one fused buffer)."""
    if flags is None or not tensors:
        return tensors
    return [*tensors, tf.cast(flags.local, tensors[0].dtype)]


def without_flag(reduced: list[Any], flags: StopFlags | None, sent: int) -> list[Any]:
    """Store the reduced flag (any rank asked: > 0 everywhere) and return the gradients."""
    if flags is None or len(reduced) == sent:
        return list(reduced)
    flags.agreed.assign(tf.cast(reduced[-1], tf.float32))
    return list(reduced[:-1])


def request_stop(optimizer: Any) -> None:
    """Ask to stop: sent with this rank's next gradient allreduce."""
    _flags(optimizer).local.assign(1.0)


def stop_agreed(optimizer: Any) -> bool:
    """True once any rank's request has gone through an allreduce (the same step on all ranks).

    With one worker no allreduce runs: the request itself is the agreement.
    """
    flags = _flags(optimizer)
    flag = flags.agreed if comm.size() > 1 else flags.local
    return bool(flag.numpy() > 0)


def _flags(optimizer: Any) -> StopFlags:
    flags = flags_of(optimizer)
    if flags is None:
        raise ValueError(
            f"optimizer {getattr(optimizer, 'name', optimizer)!r} is not a hvd_train "
            "DistributedOptimizer: it carries no stop flag"
        )
    return flags
