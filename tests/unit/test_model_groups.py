"""Model groups' layout (`hvd_train.comm.groups`) in closed form: consecutive ranks per group, the
ranks at one place of every group as its replicas, and the process sets registered for them."""

import pytest

from hvd_train.comm import groups


@pytest.mark.parametrize(
    ("size", "group_size", "members", "replicas"),
    [
        (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
        (6, 3, [[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]]),
        (6, 2, [[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]]),
        (4, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
        (3, 1, [[0], [1], [2]], [[0, 1, 2]]),
    ],
)
def test_groups_are_consecutive_ranks_and_replicas_one_place_of_each(
    size, group_size, members, replicas
):
    assert groups.layout(size, group_size) == (members, replicas)


def test_only_sets_of_more_than_one_and_fewer_than_all_ranks_are_registered():
    assert groups.sets_to_register(4, 2) == [[0, 1], [2, 3], [0, 2], [1, 3]]
    assert groups.sets_to_register(8, 4) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [0, 4], [1, 5], [2, 6], [3, 7]
    ]  # fmt: skip
    assert groups.sets_to_register(4, 4) == []  # one group: all ranks (the global set)
    assert groups.sets_to_register(4, 1) == []  # nothing split: no group collective
    # Each rank list once: Horovod refuses a process set registered twice.
    for size, g in [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)]:
        sets = [tuple(s) for s in groups.sets_to_register(size, g)]
        assert len(sets) == len(set(sets)) == size // g + g


@pytest.mark.parametrize(
    ("size", "group_size", "message"),
    [
        (4, 3, "model_group_size 3 does not divide the 4 ranks of this job"),
        (2, 4, "model_group_size 4 does not divide the 2 ranks of this job"),
        (4, 0, "model_group_size must be a positive integer, got 0"),
        (4, True, "model_group_size must be a positive integer, got True"),
        (4, 2.0, "model_group_size must be a positive integer, got 2.0"),
    ],
)
def test_a_group_size_that_cannot_split_the_ranks_is_one_error(size, group_size, message):
    with pytest.raises(ValueError, match=message):
        groups.layout(size, group_size)
