"""Launch argv builders, to the exact list."""

import json
import os
import shlex
import sys
import time

import pytest

from hvd_train import cli
from hvd_train.core import environment, launch, linkrate, placement

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


def test_launch_env_quiets_tensorflow_start_up_unless_the_user_chose():
    assert launch.launch_env({"PATH": "/bin"}) == {"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/bin"}
    assert launch.launch_env({"TF_CPP_MIN_LOG_LEVEL": "0"}) == {"TF_CPP_MIN_LOG_LEVEL": "0"}


def test_build_mpirun_forwards_the_launch_env(monkeypatch):
    monkeypatch.setattr(launch, "ompi_major_version", lambda: 4)
    monkeypatch.setattr(launch.os, "environ", {"PATH": "/bin", "HOME": "/root"})
    monkeypatch.setattr(launch.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 8)
    assert launch.build("mpirun", 2, CMD) == [
        "mpirun",
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--bind-to",
        "none",
        "-x",
        "PATH",
        "-x",
        "TF_CPP_MIN_LOG_LEVEL",
        *CMD,
    ]


def test_supervise_runs_the_launcher_in_the_launch_env(monkeypatch, capsys):
    ran = {}

    def fake_run(argv, env, **options):
        ran.update(argv=argv, env=env, **options)
        return launch.processes.Finished(argv, 2, None, None, 0.1, False)

    monkeypatch.setattr(launch.processes, "run", fake_run)
    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(launch.os, "environ", {"PATH": "/bin"})
    parser = launch.make_parser("test")
    args, command = launch.parse(parser, ["--launcher", "horovodrun", "--", *CMD])
    assert launch.supervise(parser, args, command) == launch.Launched(2, False)
    assert ran["argv"] == ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", *CMD]
    assert ran["env"] == {"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/bin"}
    assert (ran["capture"], ran["new_session"]) == (None, False)
    # horovodrun (Gloo) prints its failure lines on stdout: both streams are filtered
    assert {"stdout_filter", "stderr_filter"} <= ran.keys()
    assert capsys.readouterr().out == shlex.join(ran["argv"]) + "\n"


@pytest.mark.parametrize(
    ("launcher", "environ", "filtered"),
    [
        ("mpirun", {}, {"stderr_filter"}),
        ("horovodrun-mpi", {}, {"stderr_filter"}),
        ("horovodrun-gloo", {}, {"stderr_filter", "stdout_filter"}),
        ("horovodrun", {"HVD_TRAIN_LAUNCH_RAW": "1"}, set()),
    ],
)
def test_supervise_filters_stderr_and_horovodruns_stdout_unless_raw(
    monkeypatch, launcher, environ, filtered
):
    ran = {}

    def fake_run(argv, env, **options):
        ran.update(options)
        return launch.processes.Finished(argv, 0, None, None, 0.1, False)

    monkeypatch.setattr(launch.processes, "run", fake_run)
    monkeypatch.setattr(launch, "_built", lambda parser, args, command: ["launcher", *command])
    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(launch.os, "environ", {"PATH": "/bin", **environ})
    parser = launch.make_parser("test")
    args, command = launch.parse(parser, ["--launcher", launcher, "--", *CMD])
    assert launch.supervise(parser, args, command) == launch.Launched(0, False)
    assert {name for name in ran if name.endswith("_filter")} == filtered


# --- what a supervised launch shows: the filter on real lines ------------------------------------
# As TensorFlow 2.21, Open MPI 4.1.4's mpirun and Horovod 0.28.1's horovodrun printed them for
# `hvd-train launch --np 2 [--launcher horovodrun] -- train --set run_dir=/proc/x`
# (cpu_feature_guard at TF_CPP_MIN_LOG_LEVEL=0), with rank 1 ending itself at start-up (exit 3,
# or SIGKILL), and for `mpirun -np 8 -H localhost:2 true` (the slots box, cut short).

ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = (
    "I0000 00:00:1796122519.131933   23082 port.cc:153] oneDNN custom operations are on. You may "
    "see slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`."
)
CPU_GUARD = (
    "I0000 00:00:1796122519.179347   23082 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations."
)
CPU_ENABLE = (
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 AVX_VNNI FMA, in "
    "other operations, rebuild TensorFlow with the appropriate compiler flags."
)
TF_NOISE = [ABSL, ONEDNN, CPU_GUARD, CPU_ENABLE]
ERROR = "hvd-train: error: run_dir /proc/x cannot be created: No such file or directory"
RULE = "-" * 74
MPIRUN_PRIMARY_BOX = [
    RULE,
    "Primary job  terminated normally, but 1 process returned",
    "a non-zero exit code. Per user-direction, the job has been aborted.",
    RULE,
]
MPIRUN_DETECTED_BOX = [
    RULE,
    "mpirun detected that one or more processes exited with non-zero status, thus causing",
    "the job to be terminated. The first process to do so was:",
    "",
    "  Process name: [[14040,1],0]",
    "  Exit code:    2",
    RULE,
]
MPIRUN_SIGNAL_BOX = [
    RULE,
    "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).",
    RULE,
]
MPIRUN_SLOTS_BOX = [
    RULE,
    "There are not enough slots available in the system to satisfy the 8",
    "slots that were requested by the application:",
    "",
    "  true",
    "",
    "Either request fewer slots for your application, or make more slots",
    "available for use.",
    RULE,
]
HOROVODRUN_STDOUT = [
    "Process 0 exit with status code 2.",
    "Terminating remaining workers after failure of Process 0.",
    "Process 1 exit with status code 2.",
]
HOROVODRUN_TERMINATED = ["[0]<stderr>:Terminated"]  # rank 0 ended by horovodrun, after rank 1
HOROVODRUN_KILLED = ["[1]<stderr>:Killed"]  # rank 1 killed by SIGKILL
_SITE = "/work/main/.venv/lib/python3.11/site-packages/horovod/runner"
HOROVODRUN_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/work/main/.venv/bin/horovodrun", line 8, in <module>',
    "    sys.exit(run_commandline())",
    "             ^^^^^^^^^^^^^^^^^",
    f'  File "{_SITE}/launch.py", line 837, in run_commandline',
    "    _run(args)",
    f'  File "{_SITE}/launch.py", line 827, in _run',
    "    return _run_static(args)",
    "           ^^^^^^^^^^^^^^^^^",
    f'  File "{_SITE}/launch.py", line 685, in _run_static',
    "    _launch_job(args, settings, nics, command)",
    f'  File "{_SITE}/launch.py", line 800, in _launch_job',
    "    run_controller(args.use_gloo, gloo_run_fn,",
    f'  File "{_SITE}/launch.py", line 754, in run_controller',
    "    gloo_run()",
    f'  File "{_SITE}/launch.py", line 792, in gloo_run_fn',
    "    gloo_run(settings, nics, env, driver_ip, command)",
    f'  File "{_SITE}/gloo_run.py", line 300, in gloo_run',
    "    launch_gloo(command, exec_command, settings, nics, env, server_ip)",
    f'  File "{_SITE}/gloo_run.py", line 284, in launch_gloo',
    "    raise RuntimeError('Horovod detected that one or more processes exited with non-zero '",
    "RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus "
    "causing the job to be terminated. The first process to do so was:",
    "Process name: 0",
    "Exit code: 2",
    "",
]
RANK_TRACEBACK = [  # a rank's own, under mpirun (no prefix): not horovodrun's report
    "Traceback (most recent call last):",
    '  File "<string>", line 1, in <module>',
    "ValueError: a rank's own error",
]


def lines(*groups: list[str], prefix: str = "") -> list[str]:
    return [f"{prefix}{line}\n" for group in groups for line in group]


def show(stream, fed: list[str]) -> str:
    return "".join(stream.line(line) for line in fed)


@pytest.mark.parametrize("prefix", ["", "[0]<stderr>:", "[1,0]<stderr>:"])
@pytest.mark.parametrize("noise", TF_NOISE, ids=["absl", "onednn", "cpu-guard", "cpu-enable"])
def test_tensorflow_start_up_lines_are_dropped_from_any_rank(prefix, noise):
    stream = launch.LaunchOutput().stream()
    assert stream.line(f"{prefix}{noise}\n") == ""
    assert stream.line(f"{prefix}{noise}") == ""  # unfinished, or the last line
    assert stream.end() == ""


@pytest.mark.parametrize(
    "line",
    [
        ONEDNN.replace("I0000", "W0000"),  # a warning, not the start-up notice
        ONEDNN.replace("are on.", "are off."),
        ONEDNN + " And more.",
        "I0000 00:00:1796122519.131933   23082 port.cc:153] another message",
        "E0000 00:00:1796122519.131933   23082 cuda_executor.cc:1228] failed call to cuInit",
        f"{ABSL} (not quite)",
        "oneDNN custom operations are on",
        "To enable the following instructions: AVX2 FMA",
        f"[0]<stdout>:loss {CPU_ENABLE}",
        "hvd-train: warning: not an error line",
    ],
)
def test_lines_that_are_not_known_noise_are_shown(line):
    output = launch.LaunchOutput()
    assert output.stream().line(line + "\n") == line + "\n"
    assert not output.error_shown


def test_mpirun_an_error_line_then_mpiruns_report_shows_the_error_alone():
    output = launch.LaunchOutput()
    err = output.stream()
    fed = lines(TF_NOISE, TF_NOISE, [ABSL, ONEDNN], [ERROR], MPIRUN_PRIMARY_BOX)
    fed += lines(MPIRUN_DETECTED_BOX)
    assert show(err, fed) + err.end() == ERROR + "\n"
    assert output.error_shown


def test_mpirun_report_that_comes_before_the_error_line_is_dropped_too():
    # rank 1 exits first (rank 0 told it the error), mpirun reports it, then rank 0's line comes
    output = launch.LaunchOutput()
    err = output.stream()
    fed = lines(MPIRUN_PRIMARY_BOX, [ONEDNN, ERROR], MPIRUN_DETECTED_BOX)
    assert show(err, fed) + err.end() == ERROR + "\n"


def test_horovodrun_its_report_on_both_streams_is_dropped_whichever_comes_first():
    output = launch.LaunchOutput()
    out, err = output.stream(), output.stream()
    # stdout's report read before stderr's error line: held, then dropped
    assert show(out, lines(HOROVODRUN_STDOUT)) == ""
    fed = lines(TF_NOISE) + lines(TF_NOISE, prefix="[0]<stderr>:")
    fed += lines(TF_NOISE, prefix="[1]<stderr>:") + lines([ERROR], prefix="[0]<stderr>:")
    fed += lines(HOROVODRUN_TERMINATED, HOROVODRUN_TRACEBACK)
    assert show(err, fed) == f"[0]<stderr>:{ERROR}\n"
    assert (out.end(), err.end()) == ("", "")
    assert output.error_shown


def test_mpirun_tag_output_may_split_the_error_line_and_it_still_counts():
    output = launch.LaunchOutput()
    err = output.stream()
    line = f"[1,0]<stderr>:{ERROR}[1,0]<stderr>:\n"  # its text and its newline tagged apart
    assert show(err, [line, *lines(MPIRUN_PRIMARY_BOX)]) + err.end() == line
    assert output.error_shown


def test_without_an_error_line_mpiruns_whole_report_is_shown_in_its_order():
    # rank 1 exited 3 at start-up: nothing else explains the failure
    output = launch.LaunchOutput()
    err = output.stream()
    fed = lines(MPIRUN_PRIMARY_BOX, [ABSL, ONEDNN], MPIRUN_DETECTED_BOX)
    assert show(err, fed) == ""  # held until the launcher's output ends
    assert err.end() == "".join(lines(MPIRUN_PRIMARY_BOX, MPIRUN_DETECTED_BOX))
    assert not output.error_shown


def test_without_an_error_line_horovodruns_whole_report_is_shown():
    output = launch.LaunchOutput()
    out, err = output.stream(), output.stream()
    assert show(out, lines(HOROVODRUN_STDOUT)) == ""
    fed = lines(TF_NOISE, ["a line of rank 1's"], prefix="[1]<stderr>:")
    fed += lines(HOROVODRUN_TERMINATED, HOROVODRUN_TRACEBACK)
    assert show(err, fed) == "[1]<stderr>:a line of rank 1's\n"
    assert out.end() == "".join(lines(HOROVODRUN_STDOUT))
    assert err.end() == "".join(lines(HOROVODRUN_TERMINATED, HOROVODRUN_TRACEBACK))


@pytest.mark.parametrize(
    "box",
    [MPIRUN_SIGNAL_BOX, MPIRUN_SLOTS_BOX, HOROVODRUN_KILLED],
    ids=["mpirun-signal", "mpirun-slots", "horovodrun-killed"],
)
def test_a_rank_killed_by_a_signal_or_too_few_slots_is_shown_even_after_an_error_line(box):
    output = launch.LaunchOutput()
    err = output.stream()
    assert show(err, lines([ERROR], box, [ONEDNN])) + err.end() == "".join(lines([ERROR], box))


def test_a_ranks_own_traceback_and_other_boxes_are_shown_whole_in_order():
    output = launch.LaunchOutput()
    err = output.stream()
    fed = lines([ERROR], RANK_TRACEBACK, ["after"], MPIRUN_SLOTS_BOX, [RULE, "a rule", RULE])
    fed += lines(["Traceback (most recent call last):", '  File "x.py", line 1'])  # cut short
    shown = show(err, fed) + err.end()
    assert shown == "".join(fed)


def test_the_report_is_held_only_while_no_error_line_came():
    output = launch.LaunchOutput()
    err = output.stream()
    assert show(err, lines(MPIRUN_PRIMARY_BOX)) == ""
    assert show(err, ["unrelated\n", f"{ERROR}\n"]) == f"unrelated\n{ERROR}\n"
    assert show(err, lines(MPIRUN_DETECTED_BOX, HOROVODRUN_STDOUT)) + err.end() == ""


def launch_filtered(monkeypatch, capfd, script: str) -> tuple[launch.Launched, str, str]:
    """supervise() of a real child standing in for the launcher; what it showed."""
    monkeypatch.setattr(
        launch, "_built", lambda parser, args, command: [sys.executable, "-c", script]
    )
    monkeypatch.delenv("HVD_TRAIN_LAUNCH_RAW", raising=False)
    parser = launch.make_parser("test")
    args, command = launch.parse(parser, ["--", *CMD])
    launched = launch.supervise(parser, args, command)
    shown = capfd.readouterr()
    return launched, shown.out, shown.err


def test_supervise_shows_a_ranks_error_alone_and_says_it_saw_one(monkeypatch, capfd):
    fed = "".join(lines(TF_NOISE, [ERROR], MPIRUN_PRIMARY_BOX, MPIRUN_DETECTED_BOX))
    script = f"import sys; print('progress', flush=True); sys.stderr.write({fed!r}); exit(2)"
    launched, out, err = launch_filtered(monkeypatch, capfd, script)
    assert launched == launch.Launched(2, True)
    assert out.splitlines()[1:] == ["progress"] and err == ERROR + "\n"


def test_supervise_shows_the_launchers_report_when_no_rank_explained(monkeypatch, capfd):
    fed = "".join(lines(TF_NOISE, MPIRUN_SIGNAL_BOX, MPIRUN_PRIMARY_BOX))
    launched, _, err = launch_filtered(
        monkeypatch, capfd, f"import sys; sys.stderr.write({fed!r}); exit(137)"
    )
    assert launched == launch.Launched(137, False)
    assert err == "".join(lines(MPIRUN_SIGNAL_BOX, MPIRUN_PRIMARY_BOX))


@pytest.mark.parametrize(
    ("code", "error_shown", "status", "expected"),
    [
        (1, True, None, 2),  # horovodrun's 1 after a rank's error line: a bad input
        (1, False, None, 1),  # no line: the launcher's
        (2, True, None, 2),  # mpirun's, the rank's own
        (137, True, None, 137),  # a signal is the launcher's to tell
        (1, True, "preempted", 75),  # this launch's status.json comes first
        (1, True, "old", 2),  # an earlier launch's status.json does not count
    ],
)
def test_launch_exit_code_after_a_ranks_error_line(tmp_path, code, error_shown, status, expected):
    status_file = tmp_path / "status.json"
    now = time.time()
    if status is not None:
        when = now - 60 if status == "old" else now + 1
        status_file.write_text(json.dumps({"status": "preempted", "time": when}))
    assert cli._launch_exit_code(code, status_file, now, error_shown=error_shown) == expected


def test_mpirun_argv_job_network_restricts_open_mpi_and_tells_the_ranks():
    argv = launch.mpirun_argv(2, CMD, hosts=["h1:1", "h2:1"], job_network="198.18.1.0/24")
    assert argv == [
        "mpirun",
        "-np",
        "2",
        "-H",
        "h1:1,h2:1",
        "--bind-to",
        "none",
        "--mca",
        "btl_tcp_if_include",
        "198.18.1.0/24",
        "-x",
        "HVD_TRAIN_IFACE=198.18.1.0/24",
        *CMD,
    ]


def test_horovodrun_argv_names_the_interface():
    argv = launch.horovodrun_argv(2, CMD, hosts=["h1:1", "h2:1"], interface="data0")
    assert argv == [
        "horovodrun",
        "-np",
        "2",
        "-H",
        "h1:1,h2:1",
        "--gloo",
        "--network-interfaces",
        "data0",
        *CMD,
    ]


def test_srun_argv_job_network_rides_the_export():
    argv = launch.srun_argv(2, CMD, job_network="ib0")
    assert "--export=ALL,HVD_TRAIN_IFACE=ib0" in argv and "--export=ALL" not in argv


def test_build_on_this_host_only_chooses_no_network(monkeypatch):
    monkeypatch.setattr(launch, "ompi_major_version", lambda: 4)
    monkeypatch.delenv("OMPI_MCA_btl_tcp_if_include", raising=False)
    argv = launch.build("mpirun", 2, CMD, ["localhost:2"])
    assert "--mca" not in argv and not any(a.startswith("HVD_TRAIN_IFACE") for a in argv)
    # The override applies on one host too.
    argv = launch.build("mpirun", 2, CMD, ["localhost:2"], network_interface="lo")
    assert argv[argv.index("btl_tcp_if_include") + 1] == "127.0.0.0/8"


def test_launch_refuses_a_network_interface_this_host_lacks(capsys):
    code = cli.main(["launch", "--network-interface", "nosuch0", "--dry-run", "--", "train"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--network-interface nosuch0: no such IPv4 interface or network on this host" in err
    assert "lo 127.0.0.1/8" in err  # what the host has


def test_read_hostfile_gives_the_hosts_argument(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# our nodes\nnode1 slots=4\n\nnode2   # one slot\n")
    assert launch.read_hostfile(str(hostfile)) == ["node1:4", "node2:1"]
    assert launch.read_hostfile(None) is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("node1 slots=four\n", r":1: expected 'host slots=N', got 'node1 slots=four'"),
        ("node1\nnode2 slots=2 max_slots=4\n", r":2: expected 'host slots=N'"),
        ("# nothing\n", "names no host"),
    ],
)
def test_read_hostfile_refuses_bad_lines(tmp_path, text, error):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    with pytest.raises(ValueError, match=error):
        launch.read_hostfile(str(hostfile))


def test_launch_with_hostfile_and_hosts_is_a_usage_error(tmp_path, capsys):
    code = cli.main(["launch", "--hosts", "a:1", "--hostfile", "f", "--dry-run", "--", "train"])
    assert code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# A remote shell (as Open MPI's agent) that runs the probe here, whatever the host: every "host"
# then has this host's CPUs and GPUs.
HERE_AGENT = "sh -c 'eval \"$1\"'"


FILLED = "CPU-only hosts whose ranks' compute fills every core"


def test_auto_asks_the_hosts_and_measures_the_link_only_where_the_ranks_fill_cpu_only_cores(
    monkeypatch,
):
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", HERE_AGENT)
    found = placement.probe()
    if found["gpus"]:
        pytest.skip("this host has GPUs: the hosts are never filled CPU-only ones")
    cpus = found["cpus"]
    # fake-b answers the CPU probe (the agent runs it here) but has no address: its link's rate
    # stays unknown, and mpirun runs.
    unknown = "the link rate is unknown (host 'fake-b' does not resolve"
    # One rank per core on this host and on another: filled, none shared.
    chosen, why, gbit = launch.choose_launcher([f"localhost:{cpus}", f"fake-b:{cpus}"], 2 * cpus)
    assert chosen == "mpirun" and FILLED in why and unknown in why and gbit is None
    assert f"fake-b: {cpus} rank(s), {cpus} CPU(s), 0 GPU(s)" in why
    # One rank per host, its threads taking every core: filled as well.
    assert unknown in launch.choose_launcher(["localhost:1", "fake-b:1"], 2).why
    # More ranks than cores: they take turns on a core.
    chosen, why, _ = launch.choose_launcher([f"localhost:{cpus + 1}", "fake-b:1"], cpus + 2)
    assert chosen == "mpirun" and why.startswith("not every host is CPU-only")
    # The ranks fill the first host and never reach the second: one host, nothing asked.
    assert launch.choose_launcher([f"localhost:{cpus}", "fake-b:1"], cpus) == (
        "mpirun",
        "every rank on this host",
        None,
    )
    # A host whose shell runs on one CPU (a binding, as the test cluster's): two ranks share it.
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", f"taskset -c 0 {HERE_AGENT}")
    why = launch.choose_launcher([f"localhost:{cpus}", "fake-b:2"], cpus + 2).why
    assert FILLED not in why and "fake-b: 2 rank(s), 1 CPU(s), 0 GPU(s)" in why
    assert FILLED in launch.choose_launcher([f"localhost:{cpus}", "fake-b:1"], cpus + 1).why


@pytest.mark.parametrize(
    ("gbit", "chosen"),
    [(0.94, "horovodrun-gloo"), (launch.GLOO_BELOW_GBIT, "mpirun"), (9.4, "mpirun")],
)
def test_auto_runs_gloo_on_filled_hosts_under_the_rate_where_it_steps_faster(
    monkeypatch, gbit, chosen
):
    # The rule alone, on rates given: the probe's own measurement is tested in
    # tests/unit/test_linkrate.py and, on a shaped link, in tests/cluster/test_cluster.py.
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", HERE_AGENT)
    if placement.probe()["gpus"]:
        pytest.skip("this host has GPUs: the hosts are never filled CPU-only ones")
    asked = []

    def measure(host, remote_shell):
        asked.append((host, remote_shell))
        return linkrate.LinkRate(host, megabytes=gbit * 125, seconds=1.0)

    monkeypatch.setattr(linkrate, "measure", measure)
    got, why, measured = launch.choose_launcher(["localhost:1", "fake-b:1"], 2)
    assert (got, asked) == (chosen, [("fake-b", shlex.split(HERE_AGENT))])
    assert measured == pytest.approx(gbit)
    assert f"{FILLED} (localhost: 1 rank(s)" in why and f"; TCP to fake-b: {gbit:.2f} Gbit/s" in why
    # From outside the hosts the link measured would not be the job's: nothing is measured.
    asked.clear()
    got, why, measured = launch.choose_launcher(["fake-a:1", "fake-b:1"], 2)
    assert got == "mpirun" and not asked and why.endswith("run from one of the hosts")
    assert measured is None


@pytest.mark.parametrize(("user_set", "passed"), [(None, "9.40"), ("1.5", "1.5")])
def test_auto_passes_the_rate_it_measured_to_the_ranks_unless_the_user_gave_one(
    monkeypatch, capsys, user_set, passed
):
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", HERE_AGENT)
    if placement.probe()["gpus"]:
        pytest.skip("this host has GPUs: the hosts are never filled CPU-only ones")
    monkeypatch.setattr(
        linkrate, "measure", lambda host, shell: linkrate.LinkRate(host, 9.4 * 125, 1.0)
    )
    # Set, then removed: the test's end restores the variable's absence, whatever `main` set.
    monkeypatch.setenv(environment.LINK_GBIT, "")
    monkeypatch.delenv(environment.LINK_GBIT)
    if user_set is not None:
        monkeypatch.setenv(environment.LINK_GBIT, user_set)
    argv = ["--launcher", "auto", "--hosts", "localhost:1,fake-b:1", "--", *CMD]
    args, _ = launch.parse(launch.make_parser("launch"), argv)
    assert args.launcher == "mpirun"
    assert "TCP to fake-b: 9.40 Gbit/s" in capsys.readouterr().err
    assert os.environ[environment.LINK_GBIT] == passed
    # Every launcher passes it on to the ranks (mpirun with -x).
    assert environment.LINK_GBIT in launch.forwarded_env_names(launch.launch_env(os.environ))


def test_auto_on_this_host_asks_nothing_and_runs_mpirun(monkeypatch, capsys):
    monkeypatch.setattr(launch, "ompi_major_version", lambda: 4)
    # A probe would fail: this agent answers nothing.
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", "false")
    assert launch.main(["--launcher", "auto", "--dry-run", "--", *CMD]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("mpirun ")
    assert err == "launch: --launcher auto: mpirun (every rank on this host)\n"


def test_auto_names_a_host_that_does_not_answer(monkeypatch, capsys):
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", "false")
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--launcher", "auto", "--hosts", "fake-a:1,fake-b:1", "--dry-run", "--", "x"])
    assert exit_info.value.code == 2
    assert "host fake-a: the CPU and GPU probe failed (exit 1)" in capsys.readouterr().err


def test_auto_refuses_slots_that_are_no_number(capsys):
    with pytest.raises(SystemExit):
        launch.main(["--launcher", "auto", "--hosts", "fake-a:x", "--dry-run", "--", "x"])
    assert "host 'fake-a:x': slots must be a positive number" in capsys.readouterr().err
