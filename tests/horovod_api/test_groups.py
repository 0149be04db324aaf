"""Horovod's `groups` as bucket layouts (`hvd_train.keras.optimizer.group_layout`), exactly."""

import keras
import pytest

from hvd_train.keras.optimizer import DistributedOptimizer, group_layout


def test_an_int_splits_in_variable_order_into_near_equal_groups():
    variables = [object() for _ in range(7)]

    assert group_layout(3, variables) == [[0, 1, 2], [3, 4], [5, 6]]  # Horovod's split_list
    assert group_layout(10, variables[:2]) == [[0], [1]]  # no empty groups


def test_lists_make_groups_and_every_other_variable_its_own():
    a, b, c, d = (object() for _ in range(4))

    assert group_layout([[c, a]], [a, b, c, d]) == [[0, 2], [1], [3]]
    assert group_layout([[d], [b]], [a, b, c, d]) == [[3], [1], [0], [2]]


@pytest.mark.parametrize("groups", [0, -1, "2", [1, 2]])
def test_bad_groups_are_refused_with_the_value(groups):
    with pytest.raises(ValueError, match="groups must be an int > 0 or a list of lists"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), groups=groups)
