"""Memory per rank, predicted: what each worker holds for one model in each parallel mode.

    parameters   P * 4 bytes                   every weight, trainable or not, fp32 (also under
                                               mixed_float16: Keras keeps the variables in fp32)
    gradients    T * 4                         one per trainable weight, reduced in place
    optimizer    s * T * 4                     s slots per weight (`SLOTS`): replicated
                 (s + 1) * sum_v ceil(T_v / N) * 4   with optimizer.shard_state: the fullest
                                               rank's piece of every variable's slots and its
                                               copy of the weight piece the update writes
                                               (keras.sharded cuts each variable's elements)
    accumulator  T * 4                         only with backward_passes_per_step > 1
    activations  b * A * c                     b samples per rank, A = the elements of every
                                               layer's output per sample (what backward keeps),
                                               c = 4 bytes, 2 under mixed_float16

N is the number of workers; only the sharded optimizer state depends on it. The activation term
counts each layer's output once: frameworks keep some intermediates more (a fused BatchNorm's
saved statistics are small) and free some early, so it is an estimate, measured against peak RSS
in docs/larger-models.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Optimizer slots per trainable weight, as Keras's and the toolkit's optimizers create them.
SLOTS = {
    "sgd": 0,  # 1 with momentum > 0
    "adam": 2,
    "adamw": 2,
    "lamb": 2,
    "lion": 1,
    "lars": 1,
}
MODES = ("replicated", "shard_state")
MiB = 1 << 20

# The input each zoo model is built for when no shape is given: (input_shape, classes).
DEFAULT_INPUTS = {
    "cnn": ((8, 8, 1), 10),
    "mlp": ((64,), 10),
    "resnet20": ((32, 32, 3), 10),
    "resnet56": ((32, 32, 3), 10),
    "resnet50": ((224, 224, 3), 1000),
    "mobilenetv2": ((224, 224, 3), 1000),
    "efficientnetb0": ((224, 224, 3), 1000),
    "transformer": ((128,), 2),
}


@dataclass(frozen=True)
class Shape:
    """What the arithmetic needs of a model: the elements of each trainable weight, of the other
    weights, and of its layers' outputs per sample."""

    trainable: tuple[int, ...]  # elements per trainable weight
    non_trainable: int  # elements
    activations_per_sample: int

    @property
    def trainable_elements(self) -> int:
        return sum(self.trainable)


def slots(optimizer: str, momentum: float = 0.9) -> int:
    """Slots per trainable weight of `optimizer` (SGD has one only with momentum).

    Raises:
      ValueError: an optimizer not in SLOTS.
    """
    if optimizer not in SLOTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(SLOTS)}")
    return int(momentum > 0) if optimizer == "sgd" else SLOTS[optimizer]


def per_rank(
    shape: Shape,
    *,
    workers: int,
    batch: int,
    optimizer: str,
    momentum: float = 0.9,
    mode: str = "replicated",
    mixed_precision: bool = False,
    backward_passes_per_step: int = 1,
) -> dict[str, float]:
    """Bytes each rank holds, by term (see the module docstring), and their total.

    Raises:
      ValueError: an unknown mode or optimizer, workers or batch < 1.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if workers < 1 or batch < 1:
        raise ValueError(f"need workers >= 1 and batch >= 1, got {workers} and {batch}")
    s = slots(optimizer, momentum)
    if mode == "shard_state":
        # Each weight's elements are cut into N pieces, the first ones an element longer; a rank
        # holds its piece of each slot and its own copy of the weight's piece.
        held = (s + 1) * sum(math.ceil(n / workers) for n in shape.trainable)
    else:
        held = s * shape.trainable_elements
    terms = {
        "parameters": 4.0 * (shape.trainable_elements + shape.non_trainable),
        "gradients": 4.0 * shape.trainable_elements,
        "optimizer": 4.0 * held,
        "accumulator": 4.0 * shape.trainable_elements * (backward_passes_per_step > 1),
        "activations": float(batch * shape.activations_per_sample * (2 if mixed_precision else 4)),
    }
    return {**terms, "total": sum(terms.values())}


def shape_of(model: Any) -> Shape:
    """The Shape of a built Keras model."""
    trainable = tuple(math.prod(int(d) for d in v.shape) for v in model.trainable_weights)
    non_trainable = sum(math.prod(int(d) for d in v.shape) for v in model.non_trainable_weights)
    activations = 0
    for layer in model.layers:
        if type(layer).__name__ == "InputLayer":
            continue
        outputs = layer.output if isinstance(layer.output, (list, tuple)) else [layer.output]
        activations += sum(math.prod(int(d) for d in t.shape[1:]) for t in outputs)
    return Shape(trainable, int(non_trainable), int(activations))


def table(
    name: str,
    shape: Shape,
    workers: list[int],
    batch: int,
    optimizer: str,
    momentum: float = 0.9,
    mixed_precision: bool = False,
) -> list[dict[str, Any]]:
    """One row per mode and worker count: the bytes per rank by term."""
    return [
        {
            "model": name,
            "mode": mode,
            "workers": n,
            **per_rank(
                shape,
                workers=n,
                batch=batch,
                optimizer=optimizer,
                momentum=momentum,
                mode=mode,
                mixed_precision=mixed_precision,
            ),
        }
        for mode in MODES
        for n in workers
    ]


def render(rows: list[dict[str, Any]]) -> str:
    """The rows as a text table in MiB."""
    terms = ["parameters", "gradients", "optimizer", "activations", "total"]
    head = f"{'mode':<12} {'N':>4} " + " ".join(f"{t:>11}" for t in terms)
    lines = [head, "-" * len(head)]
    for row in rows:
        values = " ".join(f"{row[t] / MiB:>11.1f}" for t in terms)
        lines.append(f"{row['mode']:<12} {row['workers']:>4} {values}")
    return "\n".join(lines)


def zoo_shape(
    name: str, input_shape: tuple[int, ...] | None = None, classes: int | None = None
) -> Shape:
    """The Shape of zoo model `name`, built for `input_shape` and `classes` (default: the input
    it is made for, DEFAULT_INPUTS).

    Raises:
      KeyError: an unknown model (the message lists the known ones).
      ValueError: no input shape given for a model without a default.
    """
    import models

    default = DEFAULT_INPUTS.get(name)
    if default is None and (input_shape is None or classes is None):
        models.summary(name)  # an unknown name raises here, listing the known ones
        raise ValueError(f"model {name!r} has no default input: give --input-shape and --classes")
    shape = input_shape or default[0]
    return shape_of(models.build(name, tuple(shape), classes or default[1]))
