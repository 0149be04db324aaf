"""The peers harness (benchmarks/peers.py): contestant names parse into how each is started (no
process runs)."""

import pytest

from benchmarks import peers


def test_contestants_parse():
    assert peers.contestant("ceiling") == peers.Contestant("ceiling", "ceiling", "keras")
    assert peers.contestant("toolkit").kind == "single"
    gloo = peers.contestant("toolkit-gloo@cycle=20")
    assert (gloo.kind, gloo.mode, gloo.launcher) == ("launched", "toolkit", "horovodrun-gloo")
    assert gloo.env == {"HOROVOD_CYCLE_TIME": "20"}
    both = peers.contestant("toolkit-gloo@cycle=50@pending=5")
    assert both.env == {"HOROVOD_CYCLE_TIME": "50", "HOROVOD_PENDING_CYCLE_TIME": "5"}
    assert peers.contestant("horovod-mpirun").launcher == "mpirun"
    assert peers.contestant("mwms").kind == "mwms"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("horovod", "unknown contestant 'horovod'"),
        ("toolkit-gloo@cycle=-1", "@cycle=<ms >= 0>"),
        ("toolkit-gloo@fusion=1", "@cycle=<ms >= 0> or @pending"),
        ("toolkit-gloo@pending=x", "@pending=<ms >= 0>"),
    ],
)
def test_contestant_errors_name_the_value(name, message):
    with pytest.raises(ValueError, match=message):
        peers.contestant(name)


def test_worker_args_pass_the_step_time_only_when_known():
    setting = peers.Setting(np=2, steps=4, epochs=2)
    args = setting.worker_args("toolkit")
    assert args[1:] == [
        "-m",
        "benchmarks.peers",
        "worker",
        "--mode",
        "toolkit",
        "--model",
        "resnet20",
        "--batch-size",
        "64",
        "--threads",
        "1",
        "--steps",
        "4",
        "--epochs",
        "2",
    ]
    assert setting.worker_args("toolkit", 251.04)[-2:] == ["--step-ms", "251.0"]
