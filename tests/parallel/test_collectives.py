"""Horovod's collectives through hvd_train.dist, checked against closed forms of rank-built data."""

import numpy as np
import pytest
import tensorflow as tf

from hvd_train import dist


def test_topology_is_consistent():
    ranks = dist.allgather_object((dist.rank(), dist.size(), dist.local_size(), dist.is_chief()))
    size = dist.size()
    assert [r[0] for r in ranks] == list(range(size))
    assert all(r[1] == size for r in ranks)
    assert [r[3] for r in ranks] == [True] + [False] * (size - 1)
    assert dist.compute_threads() >= 1


def test_allreduce_sum_and_average_of_rank_built_tensors():
    r, n = dist.rank(), dist.size()
    x = tf.fill([5, 3], float(r + 1))
    summed = dist.allreduce(x, op=dist.Sum, name="t.sum").numpy()
    mean = dist.allreduce(x, op=dist.Average, name="t.avg").numpy()
    assert np.all(summed == n * (n + 1) / 2)
    assert np.allclose(mean, (n + 1) / 2)


def test_grouped_allreduce_with_scale_factors_and_fp16():
    r, n = dist.rank(), dist.size()
    a = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
    b = tf.fill([4, 4], 10.0 * r)
    out = dist.grouped_allreduce([a, b], op=dist.Sum, prescale_factor=0.5, postscale_factor=3.0)
    tri = n * (n + 1) / 2
    assert np.allclose(out[0].numpy(), 1.5 * tri * np.array([1.0, 2.0, 3.0]))
    assert np.allclose(out[1].numpy(), 1.5 * 10.0 * n * (n - 1) / 2)
    half = dist.grouped_allreduce([a], op=dist.Average, compression=dist.Compression.fp16)[0]
    assert half.dtype == tf.float32
    assert np.allclose(half.numpy(), (n + 1) / 2 * np.array([1.0, 2.0, 3.0]), rtol=1e-3)


@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast_from_root(root):
    n = dist.size()
    root_rank = 0 if root == "first" else n - 1
    x = tf.fill([3], float(dist.rank() * 7 + 1))
    got = dist.broadcast(x, root_rank, name=f"t.bcast.{root}").numpy()
    assert np.all(got == root_rank * 7 + 1)


def test_allgather_uneven_first_dimension():
    r, n = dist.rank(), dist.size()
    x = tf.fill([r + 1, 2], float(r))  # rank r contributes r + 1 rows of value r
    got = dist.allgather(x, name="t.gather").numpy()
    expected = np.concatenate([np.full((k + 1, 2), float(k)) for k in range(n)])
    assert np.array_equal(got, expected)


def test_python_objects():
    r, n = dist.rank(), dist.size()
    got = dist.broadcast_object({"from": r, "items": list(range(r + 2))}, root_rank=0)
    assert got == {"from": 0, "items": [0, 1]}
    assert dist.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]


def test_allreduce_mean_of_logs():
    r, n = dist.rank(), dist.size()
    got = dist.allreduce_mean({"loss": float(r), "accuracy": 1.0 / (r + 1)})
    assert got["loss"] == pytest.approx((n - 1) / 2)
    assert got["accuracy"] == pytest.approx(sum(1.0 / (k + 1) for k in range(n)) / n)


def test_broadcast_variables_makes_them_equal():
    v = tf.Variable(tf.fill([2, 2], float(dist.rank())))
    w = tf.Variable(dist.rank() + 5, dtype=tf.int64)
    dist.broadcast_variables([v, w], root_rank=0)
    gathered = dist.allgather_object((v.numpy().tolist(), int(w.numpy())))
    assert all(g == ([[0.0, 0.0], [0.0, 0.0]], 5) for g in gathered)
