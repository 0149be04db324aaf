"""Which software stack this process runs, decided once, here; and the few facts that differ.

- modern: Keras 3 (TensorFlow >= 2.16). Horovod's own Keras integration does not work there, so the
  toolkit's optimizer (`keras/optimizer.py`) and callbacks sit on Horovod's collectives.
- classic: Keras 2 (tf.keras, TensorFlow <= 2.15), where Horovod's own
  `horovod.tensorflow.keras.DistributedOptimizer` works and is used (`keras/classic.py`).

Keras-version compatibility, not distribution: everything outside this module asks the helpers
below instead of testing the Keras version.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

KERAS_MAJOR = int(keras.__version__.split(".")[0])
CLASSIC = KERAS_MAJOR == 2
NAME = "classic" if CLASSIC else "modern"

# The trainer's internal report of the metrics (a method of Model, given the last step's logs):
# what fit calls at each epoch's end and evaluate at its end, also for fit's validation.
METRICS_REPORT = "_validate_and_get_metrics_result" if CLASSIC else "_get_metrics_result_or_logs"


def value(variable: Any) -> tf.Tensor:
    """A variable's current value as a tensor (a snapshot: later assignments do not change it)."""
    # Keras 3 variables hold theirs in `.value` (a property); Keras 2 uses tf.Variable itself.
    return tf.identity(variable if CLASSIC else variable.value)


def variable_name(variable: Any) -> str:
    """A variable's unique name in its model: Keras 3's `path`, Keras 2's `name`."""
    return variable.name if CLASSIC else variable.path


def optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables (iterations, slots, loss scale), in their fixed order.

    `variables` is a property in Keras 3 and in Keras 2's current optimizers, a method in Keras 2's
    legacy ones (and a list that is also callable in Horovod's wrapper).
    """
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def optimizer_built(optimizer: Any) -> bool:
    """True once the optimizer has created its slot variables."""
    if CLASSIC:
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        return bool(getattr(inner, "_built", False))
    return bool(optimizer.built)


def learning_rate(optimizer: Any) -> float:
    """The rate the optimizer's next update will use.

    Keras 2 reports the rate of the update it last made when the rate is a schedule, so the schedule
    is evaluated here at the update counter, as Keras 3 does.
    """
    rate = optimizer.learning_rate
    if CLASSIC:
        inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
        schedule = getattr(inner, "_learning_rate", None)
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            rate = schedule(inner.iterations)
    return float(rate)


def restore_jit_compile(model: Any, fit_running: bool) -> bool:
    """Turn the model's jit_compile (XLA) back on for evaluation and prediction, after fit() has
    made its train function without it. Returns False, doing nothing, where that must wait for the
    end of fit(): Keras 2 traces the train function at the first batch (and again for a new batch
    shape), reading jit_compile each time, and its setter drops the functions made so far."""
    if CLASSIC and fit_running:
        return False
    model.jit_compile = True
    return True


def loss_scale(optimizer: Any) -> float:
    """The current dynamic loss scale of a LossScaleOptimizer."""
    return float(optimizer.loss_scale if CLASSIC else optimizer.dynamic_scale)


def is_loss_scale_optimizer(optimizer: Any) -> bool:
    """True for Keras's LossScaleOptimizer (what the mixed_float16 policy compiles in)."""
    return isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)


def tf_global_seed() -> int | None:
    """TensorFlow's global seed (`tf.random.set_seed`), or None when none was set."""
    # tf.random has no public getter; random_seed.get_seed would also draw an op seed.
    from tensorflow.python.eager import context

    return context.global_seed()
