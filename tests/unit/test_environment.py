"""The launcher's environment, read in one place (`core.environment`), and one vocabulary for how a
job ended (`core.outcome`)."""

import pytest

from hvd_train.core import environment, outcome
from hvd_train.core.environment import LauncherEnvironmentError


@pytest.mark.parametrize(
    ("environ", "controller", "local_size", "rank", "size"),
    [
        ({}, None, None, 0, None),
        (
            {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "4"}
            | {"HOROVOD_LOCAL_SIZE": "2"},
            "gloo",
            2,
            1,
            4,
        ),
        (
            {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2"}
            | {"OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
            "mpi",
            3,
            2,
            3,
        ),
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_PROCID": "5"}, None, None, 5, 8),
        # srun: the step's tasks on this node, before Open MPI starts.
        (
            {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "7", "SLURM_PROCID": "6"}
            | {"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"},
            None,
            1,
            6,
            7,
        ),
        (
            {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "7", "SLURM_PROCID": "1"}
            | {"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "0"},
            None,
            2,
            1,
            7,
        ),
        # The batch script (no step) is no worker.
        ({"SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}, None, None, 0, None),
    ],
)
def test_read_tells_what_each_launcher_set(environ, controller, local_size, rank, size):
    got = environment.read(environ)
    assert (got.controller, got.local_size, got.rank, got.size) == (
        controller,
        local_size,
        rank,
        size,
    )


def test_tuning_variables_and_what_the_user_set():
    got = environment.read(
        {"HVD_TRAIN_STEP_MS": "250", "HVD_TRAIN_GLOO_CYCLE_COST_MS": "2.5"}
        | {"HOROVOD_CYCLE_TIME": "20", "OMPI_MCA_mpi_yield_when_idle": "0"}
        | {"HVD_TRAIN_LINK_GBIT": "9.56"}
    )
    assert (got.step_ms, got.gloo_cycle_cost_ms, got.link_gbit) == (250.0, 2.5, 9.56)
    assert got.user_set_cycle_time and got.user_set_mpi_yield
    plain = environment.read({})
    assert plain.step_ms is None and plain.gloo_cycle_cost_ms is None and plain.link_gbit is None
    assert not plain.user_set_cycle_time and not plain.user_set_mpi_yield


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"HVD_TRAIN_STEP_MS": "fast"}, "HVD_TRAIN_STEP_MS must be a positive number of ms"),
        ({"HVD_TRAIN_GLOO_CYCLE_COST_MS": "-1"}, "HVD_TRAIN_GLOO_CYCLE_COST_MS must be a positive"),
        ({"HVD_TRAIN_LINK_GBIT": "10g"}, "HVD_TRAIN_LINK_GBIT must be a positive number of Gbit/s"),
        ({"HVD_TRAIN_LINK_GBIT": "inf"}, "HVD_TRAIN_LINK_GBIT must be a positive number of Gbit/s"),
        ({"HOROVOD_LOCAL_SIZE": "0"}, "HOROVOD_LOCAL_SIZE: expected a positive count, got '0'"),
        (
            {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2x3", "SLURM_NODEID": "0"},
            "SLURM_STEP_TASKS_PER_NODE='2x3': expected counts such as '2(x3),1'",
        ),
        (
            {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "2"},
            "SLURM_NODEID='2' is no node of SLURM_STEP_TASKS_PER_NODE='2(x2)'",
        ),
        ({"OMPI_COMM_WORLD_RANK": "one"}, "OMPI_COMM_WORLD_RANK='one' is not an integer rank"),
    ],
)
def test_a_bad_variable_is_one_line_naming_it(environ, message):
    with pytest.raises(LauncherEnvironmentError) as info:
        environment.read(environ)
    text = str(info.value).replace("milliseconds", "ms")
    assert message in text and "\n" not in text


def test_every_status_has_one_exit_code():
    codes = {status.value: outcome.exit_code(status.value) for status in outcome.Status}
    assert codes == {
        "finished": 0,
        "preempted": 75,
        "stalled": 3,
        "lost": 3,
        "diverged": 4,
        "write_failed": 74,
    }
    assert outcome.exit_code("exploded") is None
    assert str(outcome.Status.LOST) == "lost"
