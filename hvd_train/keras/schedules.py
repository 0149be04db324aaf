"""The learning-rate rule of `hvd_train.core.scaling` as a Keras schedule the optimizer evaluates.

Written in TensorFlow ops, which Keras 3 (TensorFlow backend) and Keras 2 both evaluate, so one
schedule serves both stacks; it does the warmup on both (Horovod's LearningRateWarmupCallback is not
used: with momentum correction, its default, it crashes on TensorFlow 2.15's current optimizers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from hvd_train.core import scaling


@keras.saving.register_keras_serializable(package="hvd_train")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from base_lr to peak_lr over warmup_steps updates, then none, step, cosine or
    polynomial decay.

    Evaluated on the optimizer's update counter inside the compiled step, so it costs no Python call
    per batch, and it resumes exactly from a restored counter. See `hvd_train.core.scaling`.

    Raises:
      ValueError: inconsistent arguments (names the argument).
    """

    def __init__(
        self,
        base_lr: float,
        peak_lr: float,
        warmup_steps: int,
        total_steps: int | None = None,
        decay: str = "none",
        decay_rate: float = 0.1,
        decay_boundaries: Sequence[int] = (),
        decay_power: float = 2.0,
    ) -> None:
        scaling.validate_schedule(
            base_lr, peak_lr, warmup_steps, total_steps, decay, decay_rate, decay_boundaries
        )
        self.base_lr = float(base_lr)
        self.peak_lr = float(peak_lr)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.decay = decay
        self.decay_rate = float(decay_rate)
        self.decay_boundaries = [int(b) for b in decay_boundaries]
        self.decay_power = float(decay_power)

    def __call__(self, step: Any) -> Any:
        step = tf.cast(step, tf.float32)
        if self.decay == "step":
            passed = sum(tf.cast(step >= b, tf.float32) for b in self.decay_boundaries)
            after = self.peak_lr * tf.pow(self.decay_rate, passed)
        elif self.decay == "cosine":
            span = float(self.total_steps - self.warmup_steps)
            progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
            after = self.peak_lr * 0.5 * (1.0 + tf.cos(math.pi * progress))
        elif self.decay == "polynomial":
            span = float(self.total_steps - self.warmup_steps)
            progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
            after = self.peak_lr * tf.pow(1.0 - progress, self.decay_power)
        else:
            after = tf.constant(self.peak_lr, tf.float32)
        if self.warmup_steps == 0:
            return after
        warm = self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
        return tf.where(step < self.warmup_steps, warm, after)

    def get_config(self) -> dict[str, Any]:
        return {
            "base_lr": self.base_lr,
            "peak_lr": self.peak_lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "decay": self.decay,
            "decay_rate": self.decay_rate,
            "decay_boundaries": list(self.decay_boundaries),
            "decay_power": self.decay_power,
        }


def scaled_warmup_schedule(
    base_lr: float,
    base_batch_size: int,
    global_batch_size: int,
    updates_per_epoch: int,
    warmup_epochs: float = 5.0,
    epochs: int | None = None,
    rule: str = "linear",
    decay: str = "none",
    decay_rate: float = 0.1,
    decay_epochs: Sequence[float] = (),
    decay_power: float = 2.0,
) -> WarmupSchedule:
    """The toolkit's rule in epochs: scale base_lr to the global batch, warm up, then decay.

    Args:
      base_lr: rate tuned for `base_batch_size` (one worker, no warmup).
      base_batch_size: the batch `base_lr` was tuned for.
      global_batch_size: per-rank batch x size (x backward passes per update).
      updates_per_epoch: optimizer updates in one epoch.
      warmup_epochs: epochs of linear warmup (Goyal et al.: 5); 0 for none.
      epochs: epochs of the whole run; needed by "cosine".
      rule: "linear" or "sqrt" scaling.
      decay: "none", "step", "cosine" or "polynomial".
      decay_rate: factor at each of `decay_epochs` ("step").
      decay_epochs: epochs at which "step" decays.
      decay_power: the exponent of "polynomial" decay.

    Returns:
      The schedule to pass as an optimizer's learning_rate.
    """
    peak_lr = scaling.scaled_learning_rate(base_lr, global_batch_size, base_batch_size, rule)
    return WarmupSchedule(
        base_lr=base_lr,
        peak_lr=peak_lr,
        warmup_steps=round(warmup_epochs * updates_per_epoch),
        total_steps=None if epochs is None else epochs * updates_per_epoch,
        decay=decay,
        decay_rate=decay_rate,
        decay_boundaries=[round(e * updates_per_epoch) for e in decay_epochs],
        decay_power=decay_power,
    )
