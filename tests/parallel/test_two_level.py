"""Two-level reduction (`comm.allreduce_groups(..., reduction="two_level")`) against the flat
grouped allreduce and the closed form, on one machine: hosts are emulated with `local_groups`
(one host of all ranks, one rank per host, and at even sizes of 4 and more hosts of 2 ranks, in
rank order and interleaved), so that every stage runs whatever the launch.

Rank r contributes (r + 1) x base, base of small integers: every partial sum is exact, so the
two-level result must equal the flat one bit for bit, and Sum must equal n (n + 1) / 2 x base.
"""

import numpy as np
import pytest
import tensorflow as tf

from hvd_train import comm


def layouts(n: int) -> dict[str, list[list[int]]]:
    found = {"one_host": [list(range(n))], "one_rank_per_host": [[r] for r in range(n)]}
    if n >= 4 and n % 2 == 0:
        found["pairs"] = [[r, r + 1] for r in range(0, n, 2)]
        found["interleaved_pairs"] = [list(range(h, n, n // 2)) for h in range(n // 2)]
    return found


def groups(dtypes=(tf.float32, tf.float64)) -> list[list[tf.Tensor]]:
    """Three groups of odd lengths (padding at every host size), of two dtypes (one per group, as
    Horovod's grouped allreduce takes), one group empty, one tensor a scalar."""
    s0, s1 = (tf.cast(comm.rank() + 1, d) for d in dtypes)
    first = [tf.reshape(tf.range(15, dtype=dtypes[0]), [5, 3]) * s0, s0]  # s0: a stop-flag scalar
    second = [(tf.range(7, dtype=dtypes[1]) - 3) * s1]
    third = [tf.fill([2, 2, 3], s0), tf.range(1, 4, dtype=dtypes[0]) * s0]
    return [first, [], second, third]


def base() -> list[list[np.ndarray]]:
    """`groups` of rank 0 divided by its scale 1: each rank's tensors are (r + 1) x these."""
    return [[np.arange(15.0).reshape(5, 3), np.array(1.0)], [], [np.arange(7.0) - 3.0],
            [np.ones([2, 2, 3]), np.arange(1.0, 4.0)]]  # fmt: skip


def numpy(result) -> list[list[np.ndarray]]:
    return [[t.numpy() for t in group] for group in result]


def same(a, b) -> bool:
    """Identical structure, shapes, dtypes and values (bit for bit)."""
    return len(a) == len(b) and all(
        len(x) == len(y)
        and all(
            u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v)
            for u, v in zip(x, y, strict=True)
        )
        for x, y in zip(a, b, strict=True)
    )


def two_level_by_layout(tensors, **kwargs) -> dict[str, list[list[np.ndarray]]]:
    """The two-level result of every layout of this size (every rank runs them all, in order)."""
    return {
        name: numpy(
            comm.allreduce_groups(tensors, reduction="two_level", local_groups=hosts, **kwargs)
        )
        for name, hosts in layouts(comm.size()).items()
    }


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_two_level_equals_flat_and_the_closed_form(op):
    n, reduce_op = comm.size(), getattr(comm, op)
    flat = numpy(comm.allreduce_groups(groups(), op=reduce_op))
    by_layout = two_level_by_layout(groups(), op=reduce_op)
    factor = n * (n + 1) / 2 if op == "Sum" else (n + 1) / 2
    assert {name: same(two, flat) for name, two in by_layout.items()} == dict.fromkeys(
        by_layout, True
    )
    for got, want in zip(flat, base(), strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, factor * w, rtol=1e-6)


def test_average_with_prescale_and_postscale():
    n = comm.size()
    scales = {"prescale_factor": 0.5, "postscale_factor": 3.0}
    flat = numpy(comm.allreduce_groups(groups(), op=comm.Average, **scales))
    by_layout = two_level_by_layout(groups(), op=comm.Average, **scales)
    assert all(same(two, flat) for two in by_layout.values()), list(by_layout)
    for got, want in zip(flat, base(), strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, 1.5 * (n + 1) / 2 * w, rtol=1e-6)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_compression_and_integers(kind):
    n = comm.size()
    compressed = {"compression": getattr(comm.Compression, kind)}
    flat = numpy(comm.allreduce_groups(groups(), op=comm.Average, **compressed))
    by_layout = two_level_by_layout(groups(), op=comm.Average, **compressed)
    ints = groups(dtypes=(tf.int32, tf.int64))
    flat_ints = numpy(comm.allreduce_groups(ints, op=comm.Sum))
    ints_by_layout = two_level_by_layout(ints, op=comm.Sum)
    assert all(same(two, flat) for two in by_layout.values()), list(by_layout)
    assert all(same(two, flat_ints) for two in ints_by_layout.values()), list(ints_by_layout)
    assert flat[0][0].dtype == np.float32 and flat[2][0].dtype == np.float64  # decompressed
    for got, want in zip(flat, base(), strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, (n + 1) / 2 * w, rtol=1e-3)
    assert flat_ints[0][0].dtype == np.int32
    np.testing.assert_array_equal(flat_ints[0][0], n * (n + 1) // 2 * base()[0][0].astype(int))


def test_two_level_inside_a_traced_function_equals_eager():
    local_groups = max(layouts(comm.size()).values(), key=len)  # the most hosts

    @tf.function
    def reduce(tensors):
        return comm.allreduce_groups(
            tensors, op=comm.Average, reduction="two_level", local_groups=local_groups
        )

    traced = numpy(reduce(groups()))
    eager = numpy(
        comm.allreduce_groups(
            groups(), op=comm.Average, reduction="two_level", local_groups=local_groups
        )
    )
    assert same(traced, eager)


def test_negative_control_one_element_of_one_rank_is_caught():
    # The checks above fail when one element of one rank's input differs (by 1 in a sum of 0s).
    n, r = comm.size(), comm.rank()
    local_groups = max(layouts(n).values(), key=len)
    tensors = groups()
    if r == n - 1:
        tensors[0][0] = tf.tensor_scatter_nd_add(tensors[0][0], [[0, 0]], [1.0])
    two = numpy(
        comm.allreduce_groups(
            tensors, op=comm.Sum, reduction="two_level", local_groups=local_groups
        )
    )
    closed = [[n * (n + 1) / 2 * w for w in want] for want in base()]
    closed = [
        [c.astype(t.dtype) for c, t in zip(cs, ts, strict=True)]
        for cs, ts in zip(closed, two, strict=True)
    ]
    assert not same(two, closed)
    assert same(two[1:], closed[1:])
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(two[0][0], closed[0][0], rtol=1e-6)


def test_the_rule_on_this_job_and_refusals():
    # auto is flat everywhere; two-level runs where asked on one host and across even hosts,
    # and is refused on uneven ones (h1:2,h2:1). Horovod's topology says which this launch is.
    places = comm.allgather_object((comm.local_rank(), comm.local_size()))
    per_host = [size for local_rank, size in places if local_rank == 0]
    even = len(set(per_host)) == 1
    auto = comm.resolve_reduction("auto")
    try:
        forced = comm.resolve_reduction("two_level")  # on one host too: correct, no gain
    except ValueError as err:
        forced = str(err)
    n, problems = comm.size(), []
    for bad in (
        {"op": comm.Max, "local_groups": [list(range(n))]},
        {"op": comm.Sum, "local_groups": [list(range(n - 1))] if n > 1 else [[0, 1]]},
    ):
        try:
            comm.allreduce_groups([[tf.ones([2])]], reduction="two_level", **bad)
        except ValueError as err:
            problems.append(str(err))
    assert auto == "flat"
    assert (forced == "two_level") if even else ("unequal numbers of ranks" in forced)
    assert len(problems) == 2 and all("\n" not in p for p in problems), problems
