"""Launch argv builders, to the exact list."""

import pytest

from hvd_train.core import launch

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


SRUN_TAIL = ["--kill-on-bad-exit=1", "--cpu-bind=none", "--export=ALL", *CMD]


def test_srun_argv_defaults():
    assert launch.srun_argv(4, CMD) == ["srun", "--ntasks=4", "--mpi=pmix", *SRUN_TAIL]


def test_srun_argv_nodes_cpus_gpus():
    argv = launch.srun_argv(8, CMD, nodes=2, cpus_per_task=6, gpus_per_task=1)
    assert argv == [
        "srun",
        "--ntasks=8",
        "--nodes=2",
        "--cpus-per-task=6",
        "--gpus-per-task=1",
        "--mpi=pmix",
        *SRUN_TAIL,
    ]


def test_srun_argv_pmi2_cpus_only():
    argv = launch.srun_argv(1, CMD, cpus_per_task=2, mpi="pmi2")
    assert argv == ["srun", "--ntasks=1", "--cpus-per-task=2", "--mpi=pmi2", *SRUN_TAIL]


def test_build_srun_reads_nothing_from_the_machine(monkeypatch):
    monkeypatch.setattr(launch, "ompi_major_version", lambda: pytest.fail("probed Open MPI"))
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "1")
    assert launch.build("srun", 4, CMD, nodes=2, mpi="pmi2") == launch.srun_argv(
        4, CMD, nodes=2, mpi="pmi2"
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: launch.mpirun_argv(0, CMD), "np >= 1"),
        (lambda: launch.mpirun_argv(2, []), "a command"),
        (lambda: launch.mpirun_argv(2, CMD, ompi_major=3), "4 or 5, got 3"),
        (lambda: launch.horovodrun_argv(2, CMD, controller="nccl"), "gloo or mpi, got 'nccl'"),
        (lambda: launch.build("slurm", 2, CMD), "unknown launcher 'slurm'"),
        (lambda: launch.srun_argv(0, CMD), "np >= 1 and a command, got np=0"),
        (lambda: launch.srun_argv(2, []), "a command"),
        (lambda: launch.srun_argv(2, CMD, nodes=3), "between 1 and np=2, got 3"),
        (lambda: launch.srun_argv(2, CMD, nodes=0), "between 1 and np=2, got 0"),
        (lambda: launch.srun_argv(2, CMD, cpus_per_task=0), "cpus_per_task must be >= 1.*got 0"),
        (lambda: launch.srun_argv(2, CMD, gpus_per_task=-1), "gpus_per_task must be >= 1.*got -1"),
        (lambda: launch.srun_argv(2, CMD, mpi="openmpi"), "pmix, pmi2, got 'openmpi'"),
        (lambda: launch.build("srun", 2, CMD, hosts=["a:2"]), "hosts are not used"),
        (lambda: launch.build("horovodrun", 2, CMD, nodes=2), r"\(nodes\) do not apply to horov"),
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


def test_dry_run_srun_without_slurm(capsys):
    argv = ["--launcher", "srun", "--np", "4", "--gpus-per-task", "1", "--dry-run", "--", *CMD]
    assert launch.main(argv) == 0
    assert capsys.readouterr().out.strip() == (
        "srun --ntasks=4 --gpus-per-task=1 --mpi=pmix --kill-on-bad-exit=1 --cpu-bind=none"
        " --export=ALL python train.py --epochs 2"
    )


def test_srun_option_with_another_launcher_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--launcher", "horovodrun", "--mpi", "pmi2", "--dry-run", "--", *CMD])
    assert exit_info.value.code == 2
    assert "srun's options (mpi) do not apply to horovodrun" in capsys.readouterr().err


def test_horovodrun_elastic_argv_quotes_the_discovery_command():
    argv = launch.horovodrun_elastic_argv(
        2, CMD, min_np=1, max_np=3, discovery=["mpi_scripts/discover_hosts.sh", "my hosts"]
    )
    assert argv == [
        "horovodrun",
        "-np",
        "2",
        "--min-np",
        "1",
        "--max-np",
        "3",
        "--host-discovery-script",
        "mpi_scripts/discover_hosts.sh 'my hosts'",
        *CMD,
    ]
    argv = launch.horovodrun_elastic_argv(
        2, CMD, min_np=2, max_np=2, discovery=["d.sh"], reset_limit=3, cooldown_range=(10, 60)
    )
    assert argv[9:15] == ["--reset-limit", "3", "--blacklist-cooldown-range", "10", "60", *CMD[:1]]


@pytest.mark.parametrize(
    ("np", "min_np", "max_np", "extra", "message"),
    [
        (2, 3, 4, {}, "1 <= min_np <= np <= max_np"),
        (3, 1, 2, {}, "1 <= min_np <= np <= max_np"),
        (2, 1, 2, {"reset_limit": -1}, "reset_limit must be >= 0"),
        (2, 1, 2, {"cooldown_range": (0, 5)}, "1 <= low <= high"),
        (2, 1, 2, {"cooldown_range": (9, 5)}, "1 <= low <= high"),
    ],
)
def test_horovodrun_elastic_argv_rejects(np, min_np, max_np, extra, message):
    with pytest.raises(ValueError, match=message):
        launch.horovodrun_elastic_argv(
            np, CMD, min_np=min_np, max_np=max_np, discovery=["d.sh"], **extra
        )
