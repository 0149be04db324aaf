"""Where a distributed step's time goes, per rank: compute, waiting for the slowest rank, allreduce.

A measuring loop (not the training path): each step computes the gradients (a compiled function,
finished before the clock reads), optionally sleeps on a straggler rank, then runs a one-float
allreduce, which returns only when every rank has arrived (the wait for the slowest, plus one
Horovod cycle), then the grouped allreduce of the gradients (the transfer), then the update.
Over the timed steps it also reads, from /proc (Linux), how much CPU this rank's threads used:
TensorFlow's compute threads, the main thread, and the rest (Horovod's background thread, the
controller's transport threads), and how often the compute threads were preempted.

    mpirun -np 2 python -m hvd_train.bench.breakdown --model resnet20 --out b.json \
        [--straggler-rank 1 --delay-ms 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

PHASES = ("compute", "straggle", "wait", "allreduce", "apply")
THREAD_GROUPS = ("compute", "main", "other")


def thread_times(task_dir: Path = Path("/proc/self/task")) -> dict[int, tuple[str, float, int]]:
    """{thread id: (group, CPU seconds, involuntary context switches)} of this process's threads.

    Groups: "compute" (TensorFlow's pools, threads named tf_*), "main" (the process's first
    thread), "other". Empty where /proc is not there (not Linux).
    """
    ticks = os.sysconf("SC_CLK_TCK")
    owner = task_dir.parent.name
    main_tid = os.getpid() if owner == "self" else int(owner)
    threads = {}
    for task in task_dir.glob("[0-9]*"):
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:  # the thread ended while we looked
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        preempted = next(
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith("nonvoluntary_ctxt_switches:")
        )
        tid = int(task.name)
        group = "compute" if name.startswith("tf_") else "main" if tid == main_tid else "other"
        threads[tid] = (group, cpu, preempted)
    return threads


def thread_usage(
    before: dict[int, tuple[str, float, int]],
    after: dict[int, tuple[str, float, int]],
    seconds: float,
) -> dict[str, float]:
    """CPU used by each thread group over `seconds` (in cores: 1.0 = one core all the time), and
    the compute threads' preemptions per second. Threads born in between count from zero."""
    usage = {f"{group}_cores": 0.0 for group in THREAD_GROUPS}
    preempted = 0
    for tid, (group, cpu, switches) in after.items():
        _, cpu0, switches0 = before.get(tid, (group, 0.0, 0))
        usage[f"{group}_cores"] += (cpu - cpu0) / seconds
        if group == "compute":
            preempted += switches - switches0
    usage["compute_preemptions_per_s"] = preempted / seconds
    return usage


def run(
    model_name: str,
    shape: tuple[int, ...],
    batch: int,
    steps: int,
    straggler_rank: int | None,
    delay_ms: float,
) -> dict:
    from hvd_train import comm

    comm.init()
    import keras
    import numpy as np
    import tensorflow as tf

    import models

    rank, size = comm.rank(), comm.size()
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.standard_normal((batch, *shape)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, (batch,)).astype("int32"))
    model = models.build(model_name, shape, 10)
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    comm.broadcast_variables(model.variables)

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def apply(grads):
        optimizer.apply(grads, model.trainable_variables)

    @tf.function
    def reduce(grads):
        return comm.grouped_allreduce(list(grads), op=comm.Average)

    flag = tf.constant(0.0)
    samples = {phase: [] for phase in PHASES}
    for step in range(steps + 3):  # 3 untimed steps trace and warm up
        if step == 3:
            threads_before, timed_from = thread_times(), time.perf_counter()
        t0 = time.perf_counter()
        grads = gradients()
        grads[-1].numpy()
        t1 = time.perf_counter()
        if rank == straggler_rank:
            time.sleep(delay_ms / 1e3)
        t2 = time.perf_counter()
        comm.allreduce(flag, op=comm.Sum, name="hvd_train.breakdown.wait").numpy()
        t3 = time.perf_counter()
        reduced = reduce(grads) if size > 1 else grads
        reduced[-1].numpy()
        t4 = time.perf_counter()
        apply(reduced)
        t5 = time.perf_counter()
        if step >= 3:
            for phase, seconds in zip(
                PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
            ):
                samples[phase].append(seconds)
    usage = thread_usage(threads_before, thread_times(), time.perf_counter() - timed_from)
    mine = {phase: 1e3 * statistics.median(v) for phase, v in samples.items()}
    per_rank = comm.allgather_object(mine)
    threads_per_rank = comm.allgather_object(usage)
    grad_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    return {
        "bench": "breakdown",
        "model": model_name,
        "np": size,
        "batch": batch,
        "gradient_MB": grad_bytes / 1e6,
        "straggler_rank": straggler_rank,
        "delay_ms": delay_ms,
        "median_ms_per_rank": per_rank,
        "threads_per_rank": threads_per_rank,
        # horovodrun sets HOROVOD_CONTROLLER; mpirun and srun leave Horovod on MPI.
        "controller": os.environ.get("HOROVOD_CONTROLLER", "mpi"),
        "horovod_cycle_time_ms": float(os.environ.get("HOROVOD_CYCLE_TIME", "1")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_train.bench.breakdown")
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--shape", type=int, nargs="+", default=[32, 32, 3])
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--straggler-rank", type=int)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = run(
        args.model,
        tuple(args.shape),
        args.batch_size,
        args.steps,
        args.straggler_rank,
        args.delay_ms,
    )
    from hvd_train import comm

    if comm.is_chief():
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
