"""Launch argv builders, to the exact list."""

import pytest

from hvd_train import launch

CMD = ["python", "train.py", "--epochs", "2"]


def test_mpirun_argv_open_mpi_4_as_root_oversubscribed():
    argv = launch.mpirun_argv(
        3, CMD, env_names=["PATH", "HOROVOD_CYCLE_TIME"], as_root=True, oversubscribe=True
    )
    assert argv == [
        "mpirun",
        "-np",
        "3",
        "-H",
        "localhost:3",
        "--bind-to",
        "none",
        "--allow-run-as-root",
        "--oversubscribe",
        "-x",
        "PATH",
        "-x",
        "HOROVOD_CYCLE_TIME",
        *CMD,
    ]


def test_mpirun_argv_open_mpi_5_hosts():
    argv = launch.mpirun_argv(4, CMD, hosts=["a:2", "b:2"], oversubscribe=True, ompi_major=5)
    assert argv == [
        "mpirun",
        "-np",
        "4",
        "-H",
        "a:2,b:2",
        "--bind-to",
        "none",
        "--map-by",
        ":OVERSUBSCRIBE",
        *CMD,
    ]


def test_horovodrun_argv():
    assert launch.horovodrun_argv(2, CMD) == [
        "horovodrun",
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        *CMD,
    ]
    assert launch.horovodrun_argv(2, CMD, controller="mpi", hosts=["n1:1", "n2:1"])[5] == "--mpi"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: launch.mpirun_argv(0, CMD), "np >= 1"),
        (lambda: launch.mpirun_argv(2, []), "a command"),
        (lambda: launch.mpirun_argv(2, CMD, ompi_major=3), "4 or 5, got 3"),
        (lambda: launch.horovodrun_argv(2, CMD, controller="nccl"), "gloo or mpi, got 'nccl'"),
        (lambda: launch.build("slurm", 2, CMD), "unknown launcher 'slurm'"),
    ],
)
def test_bad_launch_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_forwarded_env_names():
    environ = {
        "PATH": "/bin",
        "HOME": "/root",
        "HOROVOD_FUSION_THRESHOLD": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "HVD_TRAIN_X": "1",
        "SECRET": "x",
        "PYTHONPATH": ".",
    }
    assert launch.forwarded_env_names(environ) == [
        "HOROVOD_FUSION_THRESHOLD",
        "HVD_TRAIN_X",
        "PATH",
        "PYTHONPATH",
        "TF_CPP_MIN_LOG_LEVEL",
    ]


def test_dry_run_prints_the_command(capsys):
    assert launch.main(["--np", "2", "--launcher", "horovodrun", "--dry-run", "--", *CMD]) == 0
    assert capsys.readouterr().out.strip() == (
        "horovodrun -np 2 -H localhost:2 --gloo python train.py --epochs 2"
    )
