"""Per-rank memory and step time of a click model whose embedding table is split by rows
(`hvd_train.ShardedEmbedding`) against the same model data parallel (Keras's Embedding, the whole
table on every rank): measured in the running ranks.

    .venv/bin/python -m benchmarks.embedding_memory [--rows 2000000] [--dim 32] [--workers 1,2,4]
        [--steps 5] [--out benchmarks/results]

Writes embedding-memory.json and .png into --out. For each worker count N and variant
(data-parallel, split), one job of N ranks under mpirun on this machine trains `--steps` steps of
Adam, 256 samples per rank of 4 dense features and 8 id fields drawn Zipf-skewed (a = 1.2) over the
table's rows. Each rank reports the bytes its table and the table's Adam slots hold, its resident
memory (VmRSS) after the model is built, its peak resident memory (getrusage) after the steps, and
the median step time of the steps after the first (the per-rank time of `train_on_batch`). The
figures are each job's largest rank. One host: the table's gradient of the data-parallel variant
is allreduced whole (densified) over loopback; across hosts it costs more.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from benchmarks.sharded_state import (
    _rss_bytes,
    finish,
    plot_memory,
    print_row,
    run_ranks,
    write_result,
)

REPO = Path(__file__).resolve().parents[1]
NAME = "embedding-memory"
VARIANTS = ("data-parallel", "split")
DENSE, FIELDS, BATCH = 4, 8, 256


def worker(variant: str, rows: int, dim: int, steps: int) -> dict:
    """One rank's figures (see the module docstring)."""
    import keras
    import numpy as np

    import hvd_train
    from hvd_train import comm
    from hvd_train.keras import embedding

    comm.init()
    packed = keras.Input((DENSE + FIELDS,))
    ids = packed[:, DENSE:]
    if variant == "split":
        table_layer = hvd_train.ShardedEmbedding(rows, dim, seed=0, name="table")
    else:
        table_layer = keras.layers.Embedding(rows, dim, name="table")
        ids = keras.ops.cast(ids, "int32")
    found = keras.layers.Flatten()(table_layer(ids))
    features = keras.layers.Concatenate()([packed[:, :DENSE], found])
    hidden = keras.layers.Dense(64, "relu")(features)
    model = keras.Model(packed, keras.layers.Dense(1)(hidden))
    rss_model = _rss_bytes()
    model.compile(
        optimizer=hvd_train.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(comm.rank())
    x = np.concatenate(
        [rng.normal(size=(BATCH, DENSE)), (rng.zipf(1.2, (BATCH, FIELDS)) - 1) % rows], axis=1
    ).astype("float32")
    y = rng.integers(0, 2, (BATCH, 1)).astype("float32")
    hvd_train.broadcast_model_state(model)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - started)
    table = model.get_layer("table").embeddings
    held = [table] + [v for v in model.optimizer.variables if tuple(v.shape) == tuple(table.shape)]
    return {
        "variant": variant,
        "workers": comm.size(),
        "rank": comm.rank(),
        "table_rows_here": int(table.shape[0]),
        "split": embedding.is_row_sharded(table),
        "table_and_slots_bytes": int(sum(np.prod(v.shape) * 4 for v in held)),
        "rss_after_model_bytes": rss_model,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_seconds": statistics.median(times[1:]) if len(times) > 1 else times[0],
    }


def measure(variant: str, workers: int, rows: int, dim: int, steps: int) -> dict:
    """One job's ranks, and its largest rank's figures."""
    module = ["benchmarks.embedding_memory", "worker", variant, str(rows), str(dim), str(steps)]
    ranks = run_ranks(module, workers, variant)
    keys = ("table_and_slots_bytes", "rss_after_model_bytes", "peak_rss_bytes", "step_seconds")
    return {
        "variant": variant,
        "workers": workers,
        **{key: max(r[key] for r in ranks) for key in keys},
        "ranks": ranks,
    }


def figure(result: dict, png: Path) -> None:
    """Table-and-slots bytes and peak RSS per rank, and the step time, against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, step) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    for variant, color in zip(VARIANTS, ("tab:gray", "tab:blue"), strict=True):
        rows = sorted(
            (r for r in result["rows"] if r["variant"] == variant), key=lambda r: r["workers"]
        )
        workers = [r["workers"] for r in rows]
        plot_memory(mem, rows, "table_and_slots_bytes", "table + Adam slots", color, variant)
        step.plot(
            workers, [r["step_seconds"] * 1e3 for r in rows], marker="o", color=color, label=variant
        )
    title = f"{result['table_rows']:,} x {result['dim']} table, Adam, one host"
    mem.set(xlabel="workers N", ylabel="GiB per rank (largest rank)", title=title, ylim=(0, None))
    step.set(
        xlabel="workers N",
        ylabel="ms per step (median, largest rank)",
        title=f"{BATCH} samples per rank, {FIELDS} Zipf id fields",
        ylim=(0, None),
    )
    finish(fig, (mem, step), workers, png)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        print(json.dumps(worker(argv[1], *map(int, argv[2:5]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    rows = []
    for workers in [int(n) for n in args.workers.split(",")]:
        for variant in VARIANTS:
            row = measure(variant, workers, args.rows, args.dim, args.steps)
            rows.append(row)
            print_row(row)
    result = {
        "what": "per-rank bytes of an embedding table and its Adam slots, peak RSS, step time",
        "how": "N ranks under mpirun on one host, measured in each rank; the largest rank",
        "table_rows": args.rows,
        "dim": args.dim,
        "steps": args.steps,
        "rows": rows,
    }
    write_result(result, args.out, NAME, figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
