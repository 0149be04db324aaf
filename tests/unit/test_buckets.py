"""Gradient buckets (`hvd_train.core.buckets`): the layout's closed form and the size rule."""

import pytest

from hvd_train.core import buckets
from hvd_train.core.buckets import MIB


@pytest.mark.parametrize(
    "nbytes,size,expected",
    [
        ([4, 4, 4, 4], 8, [[3, 2], [1, 0]]),
        # A bucket closes once it holds `size`: one large tensor ends it early.
        ([1, 100, 1, 1], 10, [[3, 2, 1], [0]]),
        ([5, 5, 5], 100, [[2, 1, 0]]),
        ([5, 5, 5], 0, [[2, 1, 0]]),
        ([5, 5, 5], 1, [[2], [1], [0]]),
        ([], 8, []),
    ],
)
def test_layout_takes_the_last_tensors_first(nbytes, size, expected):
    assert buckets.layout(nbytes, size) == expected


# The wide MLP of benchmarks/network.py: kernels of 24, 16 and 0.08 MiB, and their biases.
MLP = [25_165_824, 8192, 16_777_216, 8192, 81920, 40]


@pytest.mark.parametrize(
    "nbytes,size,alone,expected",
    [
        # A large tensor is a bucket by itself where the walk meets it; the small ones go on.
        ([1, 100, 1, 1], 10, 50, [[1], [3, 2, 0]]),
        ([3, 100, 3, 3, 100, 3], 6, 50, [[4], [5, 3], [1], [2, 0]]),
        # One bucket (size 0): the large ones alone, the small ones together, last.
        (MLP, 0, MIB, [[2], [0], [5, 4, 3, 1]]),
        (MLP, MIB, MIB, [[2], [0], [5, 4, 3, 1]]),
        # None alone: as before, every tensor shares its bucket.
        (MLP, MIB, 0, [[5, 4, 3, 2], [1, 0]]),
        (MLP, 0, 0, [[5, 4, 3, 2, 1, 0]]),
        # A threshold no tensor reaches changes nothing.
        ([1, 100, 1, 1], 10, 101, [[3, 2, 1], [0]]),
        ([], 8, 1, []),
    ],
)
def test_large_tensors_go_alone(nbytes, size, alone, expected):
    layout = buckets.layout(nbytes, size, alone)

    assert layout == expected
    assert sorted(i for b in layout for i in b) == list(range(len(nbytes)))
    assert all(len(b) == 1 for b in layout if any(nbytes[i] >= alone > 0 for i in b))


def test_alone_size_follows_the_controller_and_link_unless_given():
    # Open MPI on one host, or across a fast link: the copies cost more than a collective.
    assert buckets.alone_bytes(None, 1) == MIB
    threshold = buckets.MPI_ALONE_FROM_GBIT
    assert [buckets.alone_bytes(None, 2, link_gbit=g) for g in (threshold, 9.56)] == [MIB] * 2
    # A slow or unknown link: each further collective costs more than the copies.
    slow = [buckets.alone_bytes(None, 2, link_gbit=g) for g in (None, 0.96, threshold * 0.99)]
    assert slow == [0] * 3
    # Gloo: each collective costs more, on one host and across any link.
    assert buckets.alone_bytes(None, 1, gloo=True) == 0
    assert buckets.alone_bytes(None, 2, gloo=True, link_gbit=9.56) == 0
    # The user's choice wins.
    assert buckets.alone_bytes(0, 1) == 0
    assert buckets.alone_bytes(2.5, 2, gloo=True, link_gbit=0.96) == round(2.5 * MIB)


@pytest.mark.parametrize("count,each,size", [(50, 3, 10), (7, 4, 4), (12, 1, 5)])
def test_equal_tensors_fill_buckets_of_ceil_size_over_each(count, each, size):
    per_bucket = -(-size // each)
    layout = buckets.layout([each] * count, size)

    assert [len(b) for b in layout[:-1]] == [per_bucket] * (len(layout) - 1)
    assert len(layout) == -(-count // per_bucket)
    assert [i for b in layout for i in b] == list(range(count))[::-1]


@pytest.mark.parametrize(
    "total,cross_size,bucket_mb,expected",
    [
        (100 * MIB, 1, None, 0),  # one host: one bucket
        (100 * MIB, 2, None, 25 * MIB),  # the cap
        (8 * MIB, 2, None, 2 * MIB),  # a quarter of the gradients
        (1000, 4, None, MIB),  # the floor
        (100 * MIB, 1, 4.5, round(4.5 * MIB)),  # the user's choice wins, on one host too
        (100 * MIB, 2, 0, 0),
    ],
)
def test_bucket_bytes_follows_the_topology(total, cross_size, bucket_mb, expected):
    assert buckets.bucket_bytes(total, cross_size, bucket_mb) == expected


def test_no_buckets_where_the_compute_fills_the_cores_unless_asked():
    assert buckets.bucket_bytes(100 * MIB, 2, None, spare_cpu=False) == 0
    assert buckets.bucket_bytes(100 * MIB, 2, 4.0, spare_cpu=False) == 4 * MIB


def test_smallest_buckets_where_ranks_share_the_cores():
    assert buckets.bucket_bytes(100 * MIB, 2, None, False, oversubscribed=True) == MIB
    # One host stays one bucket, and the user's choice still wins.
    assert buckets.bucket_bytes(100 * MIB, 1, None, False, oversubscribed=True) == 0
    assert buckets.bucket_bytes(100 * MIB, 2, 0, False, oversubscribed=True) == 0


def test_smallest_buckets_under_gloo_where_the_compute_fills_the_cores():
    assert buckets.bucket_bytes(100 * MIB, 2, None, False, gloo=True) == MIB
    assert buckets.bucket_bytes(100 * MIB, 2, None, False, gloo=False) == 0  # Open MPI
    # A spare core keeps the larger buckets; one host stays one bucket.
    assert buckets.bucket_bytes(100 * MIB, 2, None, True, gloo=True) == 25 * MIB
    assert buckets.bucket_bytes(100 * MIB, 1, None, False, gloo=True) == 0


@pytest.mark.parametrize("gloo", [True, False])
def test_on_filled_cores_the_bucket_size_follows_the_link_rate(gloo):
    # Gloo: small buckets on a slow link, one from the threshold up; Open MPI the other way
    # round; an unknown rate keeps the slow link's choice.
    threshold = buckets.GLOO_ONE_BUCKET_FROM_GBIT if gloo else buckets.MPI_SMALL_BUCKETS_FROM_GBIT
    slow, fast = (MIB, 0) if gloo else (0, MIB)

    def size(link):
        return buckets.bucket_bytes(100 * MIB, 2, None, False, gloo=gloo, link_gbit=link)

    assert [size(None), size(0.96), size(threshold * 0.99)] == [slow] * 3
    assert [size(threshold), size(9.56)] == [fast] * 2
    # Where the rate does not enter: the user's size, one host, a spare core, shared cores.
    assert buckets.bucket_bytes(100 * MIB, 2, 4.0, False, gloo=gloo, link_gbit=9.56) == 4 * MIB
    assert buckets.bucket_bytes(100 * MIB, 1, None, False, gloo=gloo, link_gbit=9.56) == 0
    assert buckets.bucket_bytes(100 * MIB, 2, None, True, gloo=gloo, link_gbit=0.96) == 25 * MIB
    shared = buckets.bucket_bytes(100 * MIB, 2, None, False, True, gloo, link_gbit=9.56)
    assert shared == MIB


GIVEN = "HVD_TRAIN_LINK_GBIT"
PROBED = "measured at start: the slowest of 2 link(s): h1 -> h2"


@pytest.mark.parametrize(
    ("controller", "elastic", "link", "source", "buckets_expected", "said"),
    [
        ("gloo", False, None, None, 3, "unknown"),
        ("mpi", False, None, None, 1, "unknown"),
        ("gloo", True, None, None, 1, "unknown"),
        ("gloo", False, 9.56, GIVEN, 1, f"9.56 Gbit/s, from {GIVEN}"),
        ("mpi", False, 9.56, GIVEN, 3, f"9.56 Gbit/s, from {GIVEN}"),
        ("mpi", False, 0.96, GIVEN, 1, f"0.96 Gbit/s, from {GIVEN}"),
        ("mpi", False, 9.52, PROBED, 3, f"9.52 Gbit/s, {PROBED}"),
        (
            "mpi",
            False,
            None,
            "not measured: h2: no listener",
            1,
            "unknown, not measured: h2: no listener",
        ),
    ],
)
def test_the_optimizer_takes_the_buckets_of_its_controller_and_link_but_one_when_elastic(
    monkeypatch, caplog, controller, elastic, link, source, buckets_expected, said
):
    import tensorflow as tf

    from hvd_train import comm
    from hvd_train.keras import optimizer

    # Two hosts whose compute fills their one core each, as the cluster of tests/cluster.
    found = [("cross_size", 2), ("spare_cpu", False), ("oversubscribed", False), ("rank", 0)]
    for name, value in [*found, ("link_gbit", link), ("link_gbit_from", source)]:
        monkeypatch.setattr(comm, name, lambda value=value: value)
    monkeypatch.setattr(comm, "controller", lambda: controller)
    if elastic:
        monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    else:
        monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    values = [tf.zeros([MIB // 4]) for _ in range(3)]  # 1 MiB of float32 each

    with caplog.at_level("INFO", logger="hvd_train"):
        # None alone: the bucket size alone decides.
        assert len(optimizer.bucket_layout(values, None, 0)) == buckets_expected
    assert f"gradient buckets: {buckets_expected}, " in caplog.text
    assert ", none alone (3.0 MiB of gradients; " in caplog.text
    assert f"(3.0 MiB of gradients; {controller}, link {said})" in caplog.text


@pytest.mark.parametrize(
    ("controller", "hosts", "link", "expected"),
    [("mpi", 1, None, 3), ("gloo", 1, None, 1), ("mpi", 2, 9.56, 3), ("mpi", 2, 0.96, 1)],
)
def test_the_optimizer_sends_large_gradients_alone_under_open_mpi(
    monkeypatch, caplog, controller, hosts, link, expected
):
    import tensorflow as tf

    from hvd_train import comm
    from hvd_train.keras import optimizer

    # One bucket asked for; under Open MPI the 1 MiB tensors go alone all the same, on one host
    # and across a fast link.
    found = [("cross_size", hosts), ("spare_cpu", True), ("oversubscribed", False), ("rank", 0)]
    for name, value in [*found, ("link_gbit", link), ("link_gbit_from", None)]:
        monkeypatch.setattr(comm, name, lambda value=value: value)
    monkeypatch.setattr(comm, "controller", lambda: controller)
    values = [tf.zeros([MIB // 4]) for _ in range(3)]

    with caplog.at_level("INFO", logger="hvd_train"):
        assert len(optimizer.bucket_layout(values, 0)) == expected
        assert len(optimizer.bucket_layout(values, 0, 2)) == 1  # the user's threshold
    said = "alone from 1 MiB" if expected > 1 else "none alone"
    assert f"gradient buckets: {expected}, one group, {said} (" in caplog.text
