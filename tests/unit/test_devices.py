"""Thread and GPU placement rules (pure functions)."""

import json

import pytest

from hvd_train.core import placement as devices


@pytest.mark.parametrize(
    ("mask", "host", "local_size", "threads"),
    [
        (2, 2, 2, 1),  # our CI: two unbound ranks on two cores
        (2, 2, 3, 1),  # oversubscribed: never zero
        (16, 16, 2, 8),  # unbound ranks split the host
        (8, 16, 2, 8),  # bound to their own socket: keep it
        (8, 16, 4, 4),  # two ranks bound to each socket: their share only
        (1, 16, 16, 1),  # bound to one core each
        (64, 4, 2, 2),  # container cpuset or quota of 4 CPUs on a big host
    ],
)
def test_compute_threads(mask, host, local_size, threads):
    assert devices.compute_threads(mask, host, local_size) == threads


def test_compute_threads_rejects_non_positive_counts():
    with pytest.raises(ValueError, match="local_size=0"):
        devices.compute_threads(4, 4, 0)


@pytest.mark.parametrize(("text", "count"), [("0-3", 4), ("0-3,8,10-11\n", 7), ("5", 1)])
def test_parse_cpu_list(text, count):
    assert devices.parse_cpu_list(text) == count


def test_host_cpu_count_reads_cpuset_and_quota(tmp_path):
    (tmp_path / "cpuset.cpus.effective").write_text("0-5\n")
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert devices.host_cpu_count(tmp_path) == min(3, devices.os.cpu_count())
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert devices.host_cpu_count(tmp_path) == min(6, devices.os.cpu_count())


def test_gpu_for_local_rank():
    assert devices.gpu_for_local_rank(0, 0) is None
    assert [devices.gpu_for_local_rank(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="-1"):
        devices.gpu_for_local_rank(-1, 2)


@pytest.mark.parametrize(
    ("threads", "local_size", "host", "gpus", "expected"),
    [
        (1, 2, 2, 0, True),  # our CI: two 1-thread ranks fill both cores
        (4, 2, 16, 0, False),  # 8 of 16 cores used: MPI may poll on a free one
        (8, 2, 16, 0, True),
        (8, 2, 16, 2, False),  # GPUs: Horovod's and Open MPI's defaults stay
    ],
)
def test_mpi_yields_when_compute_threads_fill_the_host(threads, local_size, host, gpus, expected):
    assert devices.mpi_should_yield(threads, local_size, host, gpus) is expected


@pytest.mark.parametrize(
    ("mask", "host", "local_size", "cpus"),
    [
        (1, 2, 1, 1),  # the test cluster: one rank pinned to one CPU of a 2-core machine
        (16, 16, 2, 16),  # unbound ranks see the whole host
        (1, 16, 4, 4),  # bound to a core each (--bind-to core): the union of the masks
        (4, 8, 4, 8),  # masks that overlap: at most the host
    ],
)
def test_job_cpus_before_start_count_the_bound_ranks_cpus(mask, host, local_size, cpus):
    assert devices.job_cpus_before_start(mask, host, local_size) == cpus


def test_a_pinned_rank_fills_its_host_for_the_start_rules():
    """One rank with one compute thread pinned to one of two cores fills its share: the MPI
    yield and the cycle rules take it as a full host (counting the whole machine they did
    not)."""
    cpus = devices.job_cpus_before_start(1, 2, 1)
    assert devices.mpi_should_yield(1, 1, cpus, 0)
    for controller in ("gloo", "mpi"):
        assert devices.cycle_time_ms(controller, 0, 1, 1, cpus, None, wakes_on_enqueue=True) == 50
    assert not devices.mpi_should_yield(1, 1, 2, 0)  # negative control: the whole machine


@pytest.mark.parametrize(
    ("controller", "gpus", "threads", "local_size", "host", "step_ms", "expected"),
    [
        ("gloo", 0, 1, 2, 2, 250.0, 27.4),  # our CI: ResNet-20, two 1-thread ranks on 2 cores
        ("gloo", 0, 1, 2, 2, 9.0, 2.2),  # a short step: capped at a quarter of it
        ("gloo", 0, 1, 2, 2, 2.0, 1.0),  # never below Horovod's default
        ("gloo", 0, 1, 2, 2, 10_000.0, 173.2),  # sqrt(2 * 1.5 * 10000)
        ("gloo", 0, 1, 2, 2, None, None),  # no step time: Horovod's default stays
        ("mpi", 0, 1, 2, 2, 250.0, None),  # MPI: Horovod's default, its wakes cost little
        ("gloo", 2, 1, 2, 2, 250.0, None),  # GPUs: Horovod's default
        ("gloo", 0, 4, 2, 16, 250.0, None),  # free cores: the cycle costs no compute
        ("gloo", 0, 8, 2, 16, 250.0, 27.4),
    ],
)
def test_cycle_time_without_the_patch(
    controller, gpus, threads, local_size, host, step_ms, expected
):
    cycle = devices.cycle_time_ms(controller, gpus, threads, local_size, host, step_ms)
    assert cycle == expected


@pytest.mark.parametrize(
    ("controller", "gpus", "threads", "local_size", "host", "step_ms", "expected"),
    [
        ("gloo", 0, 1, 2, 2, 250.0, devices.WAKING_CYCLE_MS),
        ("gloo", 0, 1, 2, 2, None, devices.WAKING_CYCLE_MS),  # no step time needed
        ("mpi", 0, 1, 2, 2, 250.0, devices.WAKING_CYCLE_MS),  # Open MPI's wakes as well
        ("mpi", 0, 1, 2, 2, None, devices.WAKING_CYCLE_MS),
        ("mpi", 2, 1, 2, 2, None, None),
        ("mpi", 0, 4, 2, 16, None, None),
        ("gloo", 2, 1, 2, 2, 250.0, None),
        ("gloo", 0, 4, 2, 16, None, None),
    ],
)
def test_cycle_time_where_horovod_wakes_on_enqueue(
    controller, gpus, threads, local_size, host, step_ms, expected
):
    cycle = devices.cycle_time_ms(
        controller, gpus, threads, local_size, host, step_ms, wakes_on_enqueue=True
    )
    assert cycle == expected


def test_cycle_time_rejects_non_positive_step():
    with pytest.raises(ValueError, match="got 0"):
        devices.cycle_time_ms("gloo", 0, 1, 2, 2, 0)


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        # The cluster of tests/cluster: two hosts, each pinned to one CPU, one 1-thread rank each.
        ([("h1", [0], 1, 0), ("h2", [1], 1, 0)], False),
        # mpirun --bind-to none on two 8-core hosts, 2 ranks of 2 threads each: 4 cores spare.
        ([("a", range(8), 2, 0), ("a", range(8), 2, 0), ("b", range(8), 2, 0)], True),
        # A scheduler binding each of 4 ranks to its own 2 cores of an 8-core host: filled.
        ([("a", [2 * r, 2 * r + 1], 2, 0) for r in range(4)], False),
        # One host filled is enough to say no (the buckets must suit every host).
        ([("a", range(8), 1, 0), ("b", [0, 1], 2, 0)], False),
        # GPUs compute: the cores are free for communication.
        ([("h1", [0], 1, 1), ("h2", [1], 1, 1)], True),
    ],
)
def test_spare_cpu_per_host_from_the_ranks_affinity(ranks, expected):
    assert devices.spare_cpu(ranks) is expected


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        # The cluster of tests/cluster at 2 slots per host: two 1-thread ranks on one CPU.
        ([("h1", [0], 1, 0), ("h1", [0], 1, 0), ("h2", [1], 1, 0), ("h2", [1], 1, 0)], True),
        # Exactly filled is not oversubscribed.
        ([("h1", [0], 1, 0), ("h2", [1], 1, 0)], False),
        ([("a", [2 * r, 2 * r + 1], 2, 0) for r in range(4)], False),
        # One host over its CPUs is enough (its ranks straggle).
        ([("a", range(8), 1, 0), ("b", [0], 2, 0)], True),
        # GPUs compute: the host threads do not count.
        ([("h1", [0], 2, 1), ("h2", [1], 2, 1)], False),
    ],
)
def test_oversubscribed_when_a_hosts_threads_exceed_its_cpus(ranks, expected):
    assert devices.oversubscribed(ranks) is expected


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        # The cluster of tests/cluster at one slot per host: filled, none shared.
        ([(1, 1, 0), (1, 1, 0)], True),
        # Two slots per one-CPU host: the ranks take turns on the core.
        ([(1, 2, 0), (1, 2, 0)], False),
        # Two 8-core hosts, 2 ranks of 4 threads each: filled.
        ([(8, 8, 0), (8, 8, 0)], True),
        # A core spare on one host.
        ([(8, 7, 0), (8, 8, 0)], False),
        # GPUs compute.
        ([(1, 1, 1), (1, 1, 1)], False),
        # One host.
        ([(2, 2, 0)], False),
    ],
)
def test_cpu_hosts_are_filled_only_where_the_ranks_take_exactly_every_core(loads, expected):
    assert devices.fills_cpu_hosts(loads) is expected


@pytest.mark.parametrize(
    ("cpus", "slots", "gpus", "load"),
    [(1, 1, 0, (1, 1, 0)), (1, 2, 0, (1, 2, 0)), (16, 2, 0, (16, 16, 0)), (3, 2, 1, (3, 2, 1))],
)
def test_host_load_before_the_ranks_start(cpus, slots, gpus, load):
    assert devices.host_load(cpus, slots, gpus) == load
    assert devices.fills_cpu_hosts([load, load]) is (not gpus and load[1] == cpus)


def test_probe_answers_one_json_line(capsys):
    assert devices.main() == 0
    answer = json.loads(capsys.readouterr().out)
    cpus = min(devices.host_cpu_count(), devices.affinity_cpu_count())
    assert answer == {"cpus": cpus, "gpus": answer["gpus"]}
    assert answer["gpus"] >= 0


@pytest.mark.parametrize(
    ("environ", "machine", "value"),
    [
        ({}, "x86_64", "1"),
        ({}, "AMD64", "1"),
        ({"TF_ENABLE_ONEDNN_OPTS": "0"}, "x86_64", "0"),  # the user's choice
        ({"TF_ENABLE_ONEDNN_OPTS": "1"}, "x86_64", "1"),
        ({}, "aarch64", None),  # TensorFlow's own choice: its Arm builds decide by themselves
    ],
)
def test_prefer_onednn(environ, machine, value):
    before = dict(environ)
    changed = devices.prefer_onednn(environ, machine)
    assert environ.get("TF_ENABLE_ONEDNN_OPTS") == value
    assert changed is (environ != before)
