"""The breakdown's per-thread CPU reading: /proc parsing on a made-up task tree (closed form) and
on this process's own threads (against the kernel's per-thread clock)."""

import os
import threading
import time
from pathlib import Path

import pytest

from hvd_train.bench.breakdown import thread_times, thread_usage

TICK = 1 / os.sysconf("SC_CLK_TCK")


def _task(root: Path, tid: int, name: str, utime: int, stime: int, preempted: int) -> None:
    task = root / str(tid)
    task.mkdir(parents=True)
    # /proc/PID/task/TID/stat: utime and stime are fields 14 and 15; a name may hold spaces
    # and parentheses.
    rest = ["S", "1", *["0"] * 9, str(utime), str(stime), *["0"] * 20]
    (task / "stat").write_text(f"{tid} ({name}) {' '.join(rest)}\n")
    (task / "status").write_text(
        f"Name:\t{name}\nvoluntary_ctxt_switches:\t7\nnonvoluntary_ctxt_switches:\t{preempted}\n"
    )


def test_threads_are_grouped_and_counted_from_proc(tmp_path):
    tasks = tmp_path / "4242" / "task"
    _task(tasks, 4242, "python", 10, 5, 1)
    _task(tasks, 4250, "tf_Compute", 100, 20, 30)
    _task(tasks, 4251, "tf_Compute", 50, 0, 5)
    _task(tasks, 4260, "a (b) c", 8, 2, 9)
    before = thread_times(tasks)
    assert before == {
        4242: ("main", 15 * TICK, 1),
        4250: ("compute", 120 * TICK, 30),
        4251: ("compute", 50 * TICK, 5),
        4260: ("other", 10 * TICK, 9),
    }
    after = dict(before)
    after[4250] = ("compute", 220 * TICK, 50)
    after[4270] = ("compute", 30 * TICK, 10)  # born in between: counts from zero
    after[4260] = ("other", 30 * TICK, 9)
    del after[4251]  # ended in between: not counted
    usage = thread_usage(before, after, seconds=2.0)
    assert usage["compute_cores"] == pytest.approx(130 * TICK / 2)
    assert usage["other_cores"] == pytest.approx(20 * TICK / 2)
    assert usage["main_cores"] == 0.0
    assert usage["compute_preemptions_per_s"] == pytest.approx(30 / 2)


def test_a_busy_thread_is_read_as_its_own_cpu_time():
    go, spun, leave, own = threading.Event(), threading.Event(), threading.Event(), {}

    def spin() -> None:
        # Named like TensorFlow's compute threads, so it is counted in that group.
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text("tf_spin")
        go.wait()
        t0 = time.thread_time()
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        own["cpu"] = time.thread_time() - t0
        spun.set()
        leave.wait()

    worker = threading.Thread(target=spin)
    worker.start()
    while not Path(f"/proc/self/task/{worker.native_id}/comm").read_text().startswith("tf_"):
        time.sleep(0.01)
    before = thread_times()
    go.set()
    spun.wait()
    after = thread_times()
    leave.set()
    worker.join()
    group, cpu, _ = after[worker.native_id]
    assert group == "compute"
    # The kernel counts in ticks; the thread's own clock in nanoseconds.
    assert cpu - before[worker.native_id][1] == pytest.approx(own["cpu"], abs=2 * TICK)
    assert own["cpu"] > 0.05
    usage = thread_usage(before, after, seconds=1.0)
    assert usage["compute_cores"] >= cpu - before[worker.native_id][1]
