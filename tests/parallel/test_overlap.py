"""Gradient buckets overlap the backward pass: shown on the traced step's graph, not by timing.

The train step is traced on both stacks and its graph read: each gradient collective (Horovod's
grouped allreduce, or on Keras 2 the condition or call around it) is matched to its bucket by the
shapes it reduces (every variable of the model has its own shape), and its ancestors are walked.
The first bucket (the last layers) must not depend on the gradient of the first layer, which the
backward pass makes last: the executor can start its allreduce while backpropagation still runs.
With one bucket the same check fails (the negative control).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from util import LOSS, spread_over_ranks, weights

import hvd_train
from hvd_train import comm
from hvd_train.keras import stop

WIDTHS = (16, 24, 32, 40, 10)
FEATURES = 8
# Bytes per variable, last first: b5 40, k5 1600, b4 160, k4 5120, b3 128, k3 3072, b2 96,
# k2 1536, b1 64, k1 512. Buckets close at >= 4096 bytes: 6920, 4832, then the rest.
BUCKET_MB = 4096 / 2**20
EXPECTED_BUCKETS = [
    {(10,), (40, 10), (40,), (32, 40)},
    {(32,), (24, 32), (24,), (16, 24)},
    {(16,), (8, 16)},
]
# From 3000 bytes a gradient is a bucket of its own (Horovod reduces it in place): k4 and k3 go
# where the walk meets them; the small rest fills one bucket of 4136 bytes, closing at k1.
ALONE_MB = 3000 / 2**20
EXPECTED_ALONE = [
    {(32, 40)},
    {(24, 32)},
    {(10,), (40, 10), (40,), (32,), (24,), (16, 24), (16,), (8, 16)},
]
FIRST_KERNEL = (FEATURES, WIDTHS[0])
COLLECTIVE_OPS = {"HorovodGroupedAllreduce", "HorovodAllreduce"}
FUNCTION_OPS = {"If", "StatelessIf", "PartitionedCall", "StatefulPartitionedCall"}

pytestmark = pytest.mark.skipif(
    comm.size() == 1, reason="one rank: the optimizer sends no gradient allreduce"
)


def model_with_distinct_shapes(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    x = inputs
    for i, width in enumerate(WIDTHS):
        x = keras.layers.Dense(width, activation="tanh" if i < 4 else None, name=f"d{i}")(x)
    return keras.Model(inputs, x)


def traced_step(bucket_mb, alone_mb=None):
    model = model_with_distinct_shapes()
    optimizer = hvd_train.DistributedOptimizer(
        keras.optimizers.SGD(0.1), bucket_mb=bucket_mb, alone_mb=alone_mb
    )
    model.compile(optimizer=optimizer, loss=LOSS)
    optimizer.build(model.trainable_variables)
    spec = (tf.TensorSpec([None, FEATURES], tf.float32), tf.TensorSpec([None], tf.int32))
    return tf.function(model.train_step).get_concrete_function(spec)


def _function_has_collective(name, library, seen):
    if name in seen:
        return False
    seen.add(name)
    for node in library[name].node_def:
        if node.op in COLLECTIVE_OPS:
            return True
        if any(_function_has_collective(f, library, seen) for f in _called(node.attr)):
            return True
    return False


def _called(attrs):
    return [value.func.name for value in attrs.values() if value.HasField("func")]


def collectives(graph):
    """The graph's gradient collectives: Horovod's ops, or ops calling a function that has one,
    reducing tensors (Keras 2's stop flag, a scalar allreduce of its own, is left out)."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    found = [
        op
        for op in graph.get_operations()
        if op.type in COLLECTIVE_OPS
        or (
            op.type in FUNCTION_OPS
            and any(_function_has_collective(f, library, set()) for f in _called(op.node_def.attr))
        )
    ]
    return [op for op in found if reduced_shapes(op)]


def reduced_shapes(op):
    return {tuple(t.shape.as_list()) for t in op.inputs if t.shape.rank and t.shape.rank > 0}


def ancestors(op):
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def first_layer_gradient_ops(graph):
    """Ops computing the first kernel's gradient: its shape, and fed by the data."""
    data = graph.inputs[0].op
    return [
        op
        for op in graph.get_operations()
        if any(tuple(t.shape.as_list()) == FIRST_KERNEL for t in op.outputs if t.shape.rank)
        and data in ancestors(op)
    ]


def bucket_collectives(graph, expected=EXPECTED_BUCKETS):
    """Collective per expected bucket (None where no collective reduces exactly those shapes)."""
    by_shapes = {frozenset(reduced_shapes(op)): op for op in collectives(graph)}
    return [by_shapes.get(frozenset(bucket)) for bucket in expected]


def test_bucket_layout_in_the_traced_step_equals_its_closed_form():
    graph = traced_step(BUCKET_MB).graph
    found = bucket_collectives(graph)
    assert None not in found, (
        f"expected {EXPECTED_BUCKETS}, traced {[reduced_shapes(op) for op in collectives(graph)]}"
    )
    assert len(collectives(graph)) == len(EXPECTED_BUCKETS)


def test_the_first_bucket_does_not_wait_for_the_backward_pass():
    graph = traced_step(BUCKET_MB).graph
    first, *_, last = bucket_collectives(graph)
    backward_end = first_layer_gradient_ops(graph)

    assert backward_end, "no op computes the first kernel's gradient: the probe is broken"
    # The last bucket waits for the first layer's gradient (the probe finds the dependency)...
    assert set(backward_end) & ancestors(last)
    # ...the first does not: its allreduce can run while backpropagation continues.
    assert not set(backward_end) & ancestors(first)


def test_large_gradients_go_alone_in_the_traced_step():
    graph = traced_step(BUCKET_MB, ALONE_MB).graph
    found = bucket_collectives(graph, EXPECTED_ALONE)

    assert None not in found, (
        f"expected {EXPECTED_ALONE}, traced {[reduced_shapes(op) for op in collectives(graph)]}"
    )
    assert len(collectives(graph)) == len(EXPECTED_ALONE)
    # The first, alone, is sent while backpropagation continues; the small rest waits for it.
    backward_end = first_layer_gradient_ops(graph)
    assert not set(backward_end) & ancestors(found[0])
    assert set(backward_end) & ancestors(found[-1])


def test_one_bucket_waits_for_the_whole_backward_pass():
    """The negative control: with one bucket the check above fails."""
    graph = traced_step(0).graph
    (only,) = collectives(graph)
    assert set(first_layer_gradient_ops(graph)) & ancestors(only)


def test_buckets_carry_the_stop_flag():
    rng = np.random.default_rng(comm.rank())
    x = rng.standard_normal((24, FEATURES)).astype("float32")
    y = rng.integers(0, 10, 24).astype("int32")
    model = model_with_distinct_shapes(seed=comm.rank())
    optimizer = hvd_train.DistributedOptimizer(keras.optimizers.SGD(0.1), bucket_mb=BUCKET_MB)
    model.compile(optimizer=optimizer, loss=LOSS)
    if comm.rank() == comm.size() - 1:
        stop.request_stop(optimizer)  # one rank asks: every rank must learn it in the step
    callbacks = [hvd_train.BroadcastInitialState()]
    model.fit(x, y, batch_size=8, epochs=1, callbacks=callbacks, verbose=0)
    spread = spread_over_ranks(weights(model))
    agreed = comm.allgather_object(stop.stop_agreed(optimizer))

    assert spread == 0.0
    assert all(agreed), agreed
