"""Collectives before and after a ReduceScatter, under Gloo and under MPI, side by side.

Horovod's Gloo ReduceScatter is one of Gloo's old-style algorithms, whose TCP pair set SO_SNDBUF
to the size of its first send: one notification byte, so the kernel kept that socket at 4.6 kB
and switched its autotuning off, and every later large send of the pair crawled (allgathers,
broadcasts, alltoalls; the sharded optimizer's step, which reduce-scatters and allgathers every
step). The installer's Horovod carries a fix (mpi_scripts/patches/*-gloo-send-buffer.patch);
docs/performance.md has the figures with and without it. The jobs also time one compressed
allreduce (`compressed_ms`: 32 MiB of float32 sent as is, as fp16 and, where the build reduces
it, as bf16), whose sums Gloo ran in scalar code before the installer's gloo-avx patch.

    .venv/bin/python -m benchmarks.gloo_pairs [--np 2] [--repeats 5] [--out benchmarks/results]
        [--other-horovod DIR] [--name gloo-pairs]

Writes NAME.json and NAME.png into --out. One job per controller (horovodrun --gloo,
mpirun) on this machine: per collective of 8 MiB the median time over --repeats before any
ReduceScatter and after one tiny ReduceScatter, then the median step of an MLP (three layers of
1024) with and without sharded optimizer state (`optimizer.shard_state`). Rank 0's figures.
--other-horovod DIR also measures, in the same run, another Horovod build installed into DIR
(e.g. the unpatched wheel: `pip install --no-deps --target DIR horovod-...-r2/*.whl`), which
the ranks then import in place of the environment's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hvd_train.core import launch, processes

REPO = Path(__file__).resolve().parents[1]
NAME = "gloo-pairs"
COLLECTIVES = ("allgather", "broadcast", "alltoall", "allreduce")
LAUNCHERS = {"gloo": "horovodrun", "mpi": "mpirun"}
TIMEOUT_S = 900


def worker(repeats: int) -> dict:
    """Rank 0's figures (see the module docstring); every rank runs the same collectives."""
    import keras
    import numpy as np
    import tensorflow as tf

    import hvd_train
    from hvd_train import comm

    comm.init()
    tensor = tf.ones([2 * 2**20 // comm.size()])  # 8 MiB gathered, 8 MiB elsewhere per rank

    def run(name: str) -> float:
        call = {
            "allgather": lambda: comm.allgather(tensor),
            "broadcast": lambda: comm.broadcast(tf.ones([2 * 2**20])),
            "alltoall": lambda: comm.alltoall(tf.ones([2 * 2**20]))[0],
            "allreduce": lambda: comm.allreduce(tf.ones([2 * 2**20]), op=comm.Sum),
        }[name]
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            call().numpy()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    before = {name: run(name) for name in COLLECTIVES}
    comm.grouped_reducescatter([tf.ones([comm.size() * 3])], op=comm.Sum)
    after = {name: run(name) for name in COLLECTIVES}

    def step_ms(shard: bool) -> float:
        layers = [keras.layers.Dense(1024) for _ in range(2)] + [keras.layers.Dense(10)]
        model = keras.Sequential([keras.Input((1024,)), *layers])
        optimizer = hvd_train.DistributedOptimizer(keras.optimizers.Adam(1e-3), shard_state=shard)
        model.compile(optimizer=optimizer, loss="mse")
        x, y = np.ones((64, 1024), "float32"), np.ones((64, 10), "float32")
        model.train_on_batch(x, y)  # traces the step
        times = []
        for _ in range(4 * repeats):
            started = time.perf_counter()
            model.train_on_batch(x, y)
            times.append(time.perf_counter() - started)
        return 1e3 * statistics.median(times)

    def compressed_ms(kind: str) -> float:
        values = tf.ones([8 * 2**20])
        compression = getattr(comm.Compression, kind)
        comm.allreduce(values, op=comm.Sum, compression=compression).numpy()  # negotiation
        times = []
        for _ in range(repeats):
            comm.barrier()
            started = time.perf_counter()
            comm.allreduce(values, op=comm.Sum, compression=compression).numpy()
            times.append(time.perf_counter() - started)
        return 1e3 * statistics.median(times)

    kinds = ("none", "fp16", "bf16") if comm.reduces_bfloat16() else ("none", "fp16")
    steps = {"unsharded": step_ms(False), "sharded": step_ms(True)}
    return {"controller": comm.controller(), "rank": comm.rank(), "before_s": before} | {
        "after_s": after,
        "step_ms": steps,
        "compressed_ms": {kind: compressed_ms(kind) for kind in kinds},
    }


def measure(controller: str, workers: int, repeats: int, horovod: Path | None) -> dict:
    """One job under the controller's launcher, importing Horovod from `horovod` when given:
    rank 0's figures."""
    command = [sys.executable, "-m", "benchmarks.gloo_pairs", "worker", str(repeats)]
    argv = launch.build(LAUNCHERS[controller], workers, command)
    path = [str(horovod)] if horovod else []
    env = processes.child_env({"PYTHONPATH": os.pathsep.join([*path, str(REPO)])})
    done = processes.run(argv, env, TIMEOUT_S, cwd=REPO, capture="separate")
    build = f"other ({horovod})" if horovod else "installed"
    return rank_zero(done, workers, controller) | {"horovod": build}


def rank_zero(done: processes.Finished, workers: int, controller: str) -> dict:
    """Rank 0's JSON line of a finished job whose every rank printed one.

    Raises:
      RuntimeError: the job failed, or not every rank printed its line.
    """
    # horovodrun prefixes each rank's lines with "[rank]<stdout>:"
    lines = [re.sub(r"^\[\d+\]<stdout>:", "", line) for line in (done.output or "").splitlines()]
    ranks = [json.loads(line) for line in lines if line[:1] == "{"]
    if not done.ok or len(ranks) != workers:
        raise RuntimeError(f"{controller} np={workers}: {(done.errors or '')[-2000:]}")
    return next(r for r in ranks if r["rank"] == 0)


def save(result: dict, out: Path, name: str, figure: Callable[[dict, Path], None]) -> None:
    """NAME.json and, drawn by `figure`, NAME.png into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    figure(result, out / f"{name}.png")
    print(f"{name}: wrote {out / name}.json and .png", flush=True)


def figure(result: dict, png: Path) -> None:
    """Per controller: each collective's time after a ReduceScatter against before it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.4), layout="constrained")
    rows = result["rows"]
    width = 0.8 / len(rows)
    colors = ("tab:blue", "tab:gray", "tab:red", "tab:olive")
    for k, (row, color) in enumerate(zip(rows, colors, strict=False)):
        ratios = [row["after_s"][c] / row["before_s"][c] for c in COLLECTIVES]
        xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(COLLECTIVES))]
        step = row["step_ms"]["sharded"]
        label = f"{row['controller']}, Horovod {row['horovod']}: sharded step {step:.0f} ms"
        ax.bar(xs, ratios, width, color=color, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(COLLECTIVES)), [f"{c}\n8 MiB" for c in COLLECTIVES])
    ax.set_yscale("log")
    ax.set_ylabel("time after one ReduceScatter / before")
    ax.set_title(f"Collectives after a ReduceScatter, {result['workers']} ranks on one host")
    ax.legend(fontsize=8)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["worker"]:
        print(json.dumps(worker(int(args[1]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(
        prog="benchmarks.gloo_pairs", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--other-horovod", type=Path, help="another Horovod build, installed here")
    parser.add_argument("--name", default=NAME, help="the result files' name")
    options = parser.parse_args(args)
    rows = []
    builds = [None, options.other_horovod] if options.other_horovod else [None]
    for horovod in builds:
        for controller in LAUNCHERS:
            print(f"{NAME}: {controller}, np={options.np}, Horovod {horovod or 'installed'}")
            row = measure(controller, options.np, options.repeats, horovod)
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"workers": options.np, "repeats": options.repeats, "rows": rows}
    save(result, options.out, options.name, figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
