"""The toolkit's optimizers for large global batches, the same on both stacks.

- `Lars` (You et al. 2017, "Large Batch Training of Convolutional Networks"): SGD with momentum
  whose step for each weight tensor is scaled by a layer-wise trust ratio
  eta * ||w|| / (||g|| + weight_decay * ||w||). Neither Keras has it.
- `Lamb` (You et al. 2019, "Large Batch Optimization for Deep Learning"): Adam's direction plus
  decoupled weight decay, scaled per tensor by ||w|| / ||direction||. Keras 3 has `Lamb`, Keras 2
  does not; Keras 3's scales every tensor and decays apart from the trust ratio, so the toolkit's
  own serves both stacks with the paper's update and the exclusions below.
- `AdamW` and `Lion`: Keras's own (both stacks have them) with the exclusions below.

The exclusion rule, as in the MLPerf ResNet reference: tensors of rank <= 1 (biases, and
normalization layers' scales and offsets) get neither weight decay nor a trust ratio; LARS and LAMB
update them as momentum SGD and Adam would. `adapted(variable)` is the rule.

Each is a Keras optimizer registered for serialisation (package "hvd_train"), so Horovod's Keras 2
DistributedOptimizer (which rebuilds the optimizer from its config) and the toolkit's Keras 3 one
both wrap it. Both allreduce the gradients before `update_step` runs, so the norms of the trust
ratio are taken on the averaged gradient, as one process with the global batch would take them
(tests/parallel/test_large_batch_optimizers.py).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvd_train.keras import compat


def adapted(variable: Any) -> bool:
    """True for a weight tensor that gets weight decay and a trust ratio (rank >= 2: kernels and
    embeddings); False for biases and normalization parameters (rank <= 1)."""
    return len(variable.shape) > 1


def _trust_ratio(numerator: tf.Tensor, denominator: tf.Tensor) -> tf.Tensor:
    """numerator / denominator, or 1 where either is 0 (a zero weight or a zero step)."""
    usable = tf.logical_and(numerator > 0, denominator > 0)
    return tf.where(usable, numerator / tf.where(usable, denominator, 1.0), 1.0)


class _SlotOptimizer(keras.optimizers.Optimizer):
    """Slot variables and the per-variable update on either stack.

    Keras 3 calls `update_step(gradient, variable, learning_rate)`, Keras 2
    `update_step(gradient, variable)` with the rate in `self.learning_rate`; both land in the
    subclass's `_update(gradient, variable, learning_rate)`.
    """

    _slot_names: tuple[str, ...] = ()
    # A per-tensor update counter "t": Horovod's Keras 2 gradient accumulation advances
    # `iterations` on every batch, k per update, so `iterations` does not count updates there.
    _counted = False

    def __init__(self, learning_rate: Any, name: str, **kwargs: Any) -> None:
        # Weight decay is each optimizer's own business (inside its update), not the base class's.
        if compat.CLASSIC:
            super().__init__(name=name, weight_decay=None, **kwargs)
            self._learning_rate = self._build_learning_rate(learning_rate)
        else:
            super().__init__(learning_rate=learning_rate, name=name, weight_decay=None, **kwargs)

    def build(self, var_list: list[Any]) -> None:
        if compat.CLASSIC:
            super().build(var_list)
            if getattr(self, "_built", False):
                return
            self._built = True
        else:
            if self.built:
                return
            super().build(var_list)
        self._slots = {
            name: [self.add_variable_from_reference(v, name) for v in var_list]
            for name in self._slot_names
        }
        if self._counted:
            self._slots["t"] = [
                self.add_variable(
                    shape=(),
                    dtype="int64",
                    initializer="zeros",
                    name=compat.variable_name(v).replace("/", "_").replace(":", "_") + "_t",
                )
                for v in var_list
            ]

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if compat.CLASSIC:
            # Keras 2's base config leaves the rate to each optimizer; Horovod's Keras 2
            # DistributedOptimizer rebuilds the optimizer from this config.
            config["learning_rate"] = self._serialize_hyperparameter(self._learning_rate)
        return config

    def _slot(self, name: str, variable: Any) -> Any:
        if compat.CLASSIC:
            index = self._index_dict[self._var_key(variable)]
        else:
            index = self._get_variable_index(variable)
        return self._slots[name][index]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any = None) -> None:
        rate = self.learning_rate if learning_rate is None else learning_rate
        dtype = variable.dtype
        self._update(
            tf.cast(tf.convert_to_tensor(gradient), dtype),
            variable,
            tf.cast(rate, dtype),
        )


@keras.saving.register_keras_serializable(package="hvd_train")
class Lars(_SlotOptimizer):
    """LARS: momentum SGD with a layer-wise trust ratio (You et al. 2017).

    For a tensor w with gradient g, `adapted(w)`:
        ratio = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w||)   (1 if a norm is 0)
        v <- momentum * v + learning_rate * ratio * (g + weight_decay * w)
        w <- w - v
    otherwise (biases, normalization parameters) ratio = 1 and no weight decay.

    Args:
      learning_rate: a float or a schedule (the global rate; the trust ratio scales it per tensor).
      momentum: in [0, 1).
      trust_coefficient: eta, the trust ratio's coefficient (You et al.: 0.001).
      weight_decay: L2 coefficient added to the gradient of adapted tensors.
      name: the optimizer's name.
      **kwargs: the Keras optimizer's own (clipnorm, global_clipnorm, ...).
    """

    _slot_names = ("momentum",)

    def __init__(
        self,
        learning_rate: Any = 0.1,
        momentum: float = 0.9,
        trust_coefficient: float = 0.001,
        weight_decay: float = 0.0,
        name: str = "lars",
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, name, **kwargs)
        self.momentum = float(momentum)
        self.trust_coefficient = float(trust_coefficient)
        self.lars_weight_decay = float(weight_decay)

    def _update(self, gradient: tf.Tensor, variable: Any, learning_rate: tf.Tensor) -> None:
        velocity = self._slot("momentum", variable)
        if adapted(variable):
            weights = tf.convert_to_tensor(variable)
            w_norm, g_norm = tf.norm(weights), tf.norm(gradient)
            decay = self.lars_weight_decay
            ratio = _trust_ratio(self.trust_coefficient * w_norm, g_norm + decay * w_norm)
            step = learning_rate * ratio * (gradient + decay * weights)
        else:
            step = learning_rate * gradient
        new_velocity = self.momentum * tf.convert_to_tensor(velocity) + step
        velocity.assign(new_velocity)
        variable.assign_sub(new_velocity)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            momentum=self.momentum,
            trust_coefficient=self.trust_coefficient,
            weight_decay=self.lars_weight_decay,
        )
        return config


@keras.saving.register_keras_serializable(package="hvd_train")
class Lamb(_SlotOptimizer):
    """LAMB: Adam's direction with decoupled weight decay, scaled per tensor (You et al. 2019).

    At a tensor's update t (counted per tensor), with m and v Adam's moments:
        r = m_hat / (sqrt(v_hat) + epsilon) + weight_decay * w
        w <- w - learning_rate * ratio * r,   ratio = ||w|| / ||r||   (1 if a norm is 0)
    for `adapted(w)`; otherwise (biases, normalization parameters) ratio = 1 and no weight decay.

    Args:
      learning_rate: a float or a schedule.
      beta_1, beta_2: the moments' decay rates.
      epsilon: added to sqrt(v_hat).
      weight_decay: decoupled weight decay of adapted tensors, inside the trust ratio.
      name: the optimizer's name.
      **kwargs: the Keras optimizer's own (clipnorm, global_clipnorm, ...).
    """

    _slot_names = ("m", "v")
    _counted = True

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-6,
        weight_decay: float = 0.0,
        name: str = "lamb",
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, name, **kwargs)
        self.beta_1 = float(beta_1)
        self.beta_2 = float(beta_2)
        self.epsilon = float(epsilon)
        self.lamb_weight_decay = float(weight_decay)

    def _update(self, gradient: tf.Tensor, variable: Any, learning_rate: tf.Tensor) -> None:
        m, v, counter = (self._slot(name, variable) for name in ("m", "v", "t"))
        counter.assign_add(1)
        t = tf.cast(tf.convert_to_tensor(counter), gradient.dtype)
        new_m = self.beta_1 * tf.convert_to_tensor(m) + (1.0 - self.beta_1) * gradient
        new_v = self.beta_2 * tf.convert_to_tensor(v) + (1.0 - self.beta_2) * tf.square(gradient)
        m.assign(new_m)
        v.assign(new_v)
        m_hat = new_m / (1.0 - tf.pow(self.beta_1, t))
        v_hat = new_v / (1.0 - tf.pow(self.beta_2, t))
        direction = m_hat / (tf.sqrt(v_hat) + self.epsilon)
        if adapted(variable):
            weights = tf.convert_to_tensor(variable)
            direction += self.lamb_weight_decay * weights
            direction *= _trust_ratio(tf.norm(weights), tf.norm(direction))
        variable.assign_sub(learning_rate * direction)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            epsilon=self.epsilon,
            weight_decay=self.lamb_weight_decay,
        )
        return config


@keras.saving.register_keras_serializable(package="hvd_train")
class AdamW(keras.optimizers.AdamW):
    """Keras's AdamW, its weight decay on `adapted` tensors only (not biases or normalization)."""

    def _use_weight_decay(self, variable: Any) -> bool:
        return adapted(variable) and super()._use_weight_decay(variable)


@keras.saving.register_keras_serializable(package="hvd_train")
class Lion(keras.optimizers.Lion):
    """Keras's Lion, its weight decay on `adapted` tensors only (not biases or normalization)."""

    def _use_weight_decay(self, variable: Any) -> bool:
        return adapted(variable) and super()._use_weight_decay(variable)
