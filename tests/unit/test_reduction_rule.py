"""The rule that picks flat or two-level reduction (`comm.reduction`), and what it reads: the
hosts from every rank's place, the override, the emulated host groups, the start settings."""

import pytest

from hvd_train.comm import reduction
from hvd_train.core import config


@pytest.mark.parametrize(
    ("local_sizes", "elastic", "dynamic"),
    [
        ([2, 2], False, True),  # 2 hosts x 2 slots
        ([4, 4, 4], False, True),
        ([1, 1], False, True),  # one rank per host
        ([4], False, True),  # one host
    ],
)
def test_two_level_runs_where_asked_and_possible_auto_stays_flat(local_sizes, elastic, dynamic):
    # auto: flat (measured: two-level's stages within the host cost more than the bytes they
    # save at every link rate of the cluster but 100 Mbit/s; docs/cluster.md).
    assert reduction.reduction_rule("auto", local_sizes, elastic, dynamic) == "flat"
    assert reduction.reduction_rule("flat", local_sizes, elastic, dynamic) == "flat"
    assert reduction.reduction_rule("two_level", local_sizes, elastic, dynamic) == "two_level"


@pytest.mark.parametrize(
    ("local_sizes", "elastic", "dynamic", "why"),
    [
        ([3, 1], False, True, "unequal numbers of ranks (3, 1)"),
        ([2, 2], True, True, "elastic"),
        ([2, 2], False, False, "HOROVOD_DYNAMIC_PROCESS_SETS=1"),
        (None, False, True, "cannot be told apart"),
    ],
)
def test_two_level_where_it_cannot_run_is_one_line_saying_why(local_sizes, elastic, dynamic, why):
    with pytest.raises(ValueError, match="two_level") as err:
        reduction.reduction_rule("two_level", local_sizes, elastic, dynamic)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_mode_is_refused_and_the_choices_are_the_configs():
    with pytest.raises(ValueError, match=r"'ring'.*auto, flat, two_level"):
        reduction.reduction_rule("ring", [2, 2], False, True)
    assert reduction.REDUCTIONS == config.REDUCTIONS == ("auto", "flat", "two_level")


def test_the_environment_overrides_the_configured_mode():
    assert reduction.override("auto", {}) == "auto"
    assert reduction.override("auto", {"HVD_TRAIN_REDUCTION": ""}) == "auto"
    assert reduction.override("auto", {"HVD_TRAIN_REDUCTION": "flat"}) == "flat"
    assert reduction.override("flat", {"HVD_TRAIN_REDUCTION": "two_level"}) == "two_level"
    with pytest.raises(ValueError, match="HVD_TRAIN_REDUCTION='2level'"):
        reduction.override("auto", {"HVD_TRAIN_REDUCTION": "2level"})


@pytest.mark.parametrize(
    ("environ", "size", "local_size", "wanted"),
    [
        ({}, 4, 2, True),  # 2 hosts x 2 slots
        ({}, 3, 2, True),  # h1:2,h2:1 (h2's rank sees local size 1 < 3 alike)
        ({}, 3, 1, True),
        ({}, 4, 4, False),  # one host
        ({}, None, None, False),  # no launcher
        ({"HVD_TRAIN_REDUCTION": "two_level"}, 4, 4, True),  # asked on one host
        ({"HOROVOD_ELASTIC": "1"}, 4, 2, False),
        ({"HVD_TRAIN_REDUCTION": "flat"}, 4, 2, False),
        ({"HOROVOD_DYNAMIC_PROCESS_SETS": "0"}, 4, 2, False),  # the user's setting stays
    ],
)
def test_init_switches_dynamic_process_sets_on_across_hosts_or_when_asked(
    environ, size, local_size, wanted
):
    assert reduction.wants_dynamic_process_sets(environ, size, local_size) is wanted


def test_hosts_from_every_ranks_place():
    # Open MPI's default mapping (by slot) and a round-robin one (by node).
    by_slot = [(0, "h1", 0, 2), (1, "h1", 1, 2), (2, "h2", 0, 2), (3, "h2", 1, 2)]
    by_node = [(0, "h1", 0, 2), (1, "h2", 0, 2), (2, "h1", 1, 2), (3, "h2", 1, 2)]
    assert reduction.group_hosts(by_slot) == [[0, 1], [2, 3]]
    assert reduction.group_hosts(list(reversed(by_node))) == [[0, 2], [1, 3]]
    assert reduction.group_hosts([(0, "a", 0, 3), (1, "a", 1, 3), (2, "a", 2, 3)]) == [[0, 1, 2]]
    # Two hosts with one name (Horovod says 2 ranks per host, the names say 4): unknown.
    same_name = [(r, "node", r % 2, 2) for r in range(4)]
    assert reduction.group_hosts(same_name) is None


def test_emulated_host_groups_must_split_the_ranks_evenly():
    assert reduction.check_local_groups([[3, 1], [2, 0]], 4) == [[0, 2], [1, 3]]
    assert reduction.check_local_groups([[0]], 1) == [[0]]
    for bad in ([[0, 1], [2]], [[0, 1], [1, 2]], [[0, 1]], []):
        with pytest.raises(ValueError, match="local_groups"):
            reduction.check_local_groups(bad, 3 if bad == [[0, 1], [2]] else 4)
