"""The gradients' allreduce in buckets with and without large tensors alone, both controllers.

Horovod copies the tensors of every collective of two or more into its fusion buffer and out
again, on its one background thread; a collective of one tensor it reduces in place. The
toolkit's buckets (`hvd_train.core.buckets`) therefore send a gradient of at least `alone_mb` in
a bucket of its own. This measures what that saves and what the extra collectives cost: one job
per controller (horovodrun --gloo, mpirun) on this machine; per model, the allreduce of tensors
of its gradients' shapes in each layout (one bucket or 1 MiB buckets, with and without the large
ones alone, and Horovod's own per-tensor allreduce for reference), the layouts alternated, the
median over --repeats rounds; rank 0's figures.

    .venv/bin/python -m benchmarks.fusion_copies [--np 2] [--repeats 15]
        [--models resnet50 wide_mlp] [--out benchmarks/results] [--name fusion-copies]

Writes NAME.json and NAME.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import gloo_pairs
from hvd_train.core import launch, processes

REPO = Path(__file__).resolve().parents[1]
NAME = "fusion-copies"
LAUNCHERS = {"mpi": "mpirun", "gloo": "horovodrun"}
MODELS = ("resnet50", "wide_mlp")
# (label, bucket MiB, alone MiB): 0 bucket MiB is one bucket, 0 alone MiB none alone.
LAYOUTS = (
    ("one group", 0, 0),
    ("one group, alone from 1 MiB", 0, 1),
    ("1 MiB buckets", 1, 0),
    ("1 MiB buckets, alone from 1 MiB", 1, 1),
)
PER_TENSOR = "per tensor (Horovod's fusion)"
TIMEOUT_S = 900


def gradient_shapes(model: str) -> list[tuple[int, ...]]:
    """The shapes of a network benchmark model's gradients (benchmarks/network.py's cases)."""
    import models
    from benchmarks import network

    case = network.MODELS[model]
    built = models.build(case.zoo, case.input_shape, 10, **case.params)
    return [tuple(v.shape) for v in built.trainable_variables]


def worker(models: list[str], repeats: int) -> dict:
    """Rank 0's figures (see the module docstring); every rank runs the same collectives."""
    import numpy as np
    import tensorflow as tf

    from hvd_train import comm
    from hvd_train.core import buckets

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    comm.init()
    import horovod.tensorflow as hvd  # the reference: Horovod's own per-tensor allreduce

    rows = []
    for model in models:
        shapes = gradient_shapes(model)
        nbytes = [int(np.prod(s)) * 4 for s in shapes]
        tensors = [tf.ones(s) for s in shapes]
        calls = {}
        layouts = {}
        for label, bucket_mb, alone_mb in LAYOUTS:
            layout = buckets.layout(nbytes, round(bucket_mb * buckets.MIB), alone_mb * buckets.MIB)
            layouts[label] = len(layout)

            def reduce(layout=layout, tensors=tensors):
                return [
                    comm.grouped_allreduce([tf.identity(tensors[i]) for i in b], op=comm.Average)
                    for b in layout
                ]

            calls[label] = tf.function(reduce)
        order = list(range(len(shapes)))[::-1]

        def per_tensor(order=order, tensors=tensors):
            return [hvd.allreduce(tf.identity(tensors[i]), op=hvd.Average) for i in order]

        calls[PER_TENSOR] = tf.function(per_tensor)
        layouts[PER_TENSOR] = len(shapes)
        times: dict[str, list[float]] = {label: [] for label in calls}
        for round_ in range(repeats + 2):
            for label, call in calls.items():
                comm.barrier()
                started = time.perf_counter()
                call()[-1][-1].numpy() if label != PER_TENSOR else call()[-1].numpy()
                if round_ >= 2:  # the first two: tracing and Horovod's first negotiation
                    times[label].append(time.perf_counter() - started)
        rows.append(
            {
                "model": model,
                "gradient_MiB": sum(nbytes) / buckets.MIB,
                "tensors": len(shapes),
                "collectives": layouts,
                "ms": {label: 1e3 * statistics.median(t) for label, t in times.items()},
            }
        )
    return {"controller": comm.controller(), "rank": comm.rank(), "models": rows}


def measure(controller: str, workers: int, models: list[str], repeats: int) -> dict:
    """One job under the controller's launcher: rank 0's figures."""
    command = [sys.executable, "-m", "benchmarks.fusion_copies", "worker", str(repeats), *models]
    argv = launch.build(LAUNCHERS[controller], workers, command)
    # Every layout's tensors have names of their own, more than Horovod's default cache holds:
    # `comm.init` sizes it (docs/knobs.md).
    env = processes.child_env({"PYTHONPATH": str(REPO)})
    done = processes.run(argv, env, TIMEOUT_S, cwd=REPO, capture="separate")
    return gloo_pairs.rank_zero(done, workers, controller)


def figure(result: dict, png: Path) -> None:
    """Per controller and model: each layout's allreduce time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(row["controller"], m) for row in result["rows"] for m in row["models"]]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.2 * len(panels), 4.4), layout="constrained", squeeze=False
    )
    labels = [label for label, _, _ in LAYOUTS] + [PER_TENSOR]
    colors = ("tab:gray", "tab:blue", "tab:olive", "tab:green", "tab:red")
    for ax, (controller, model) in zip(axes[0], panels, strict=True):
        ms = [model["ms"][label] for label in labels]
        ax.bar(range(len(labels)), ms, color=colors)
        for i, label in enumerate(labels):
            ax.text(i, ms[i], str(model["collectives"][label]), ha="center", va="bottom")
        ax.set_xticks(
            range(len(labels)),
            [label.replace(", ", ",\n").replace(" (", "\n(") for label in labels],
        )
        ax.tick_params(axis="x", labelsize=6)
        ax.set_title(f"{model['model']} ({model['gradient_MiB']:.0f} MiB), {controller}")
        ax.set_ylabel("allreduce of the gradients, ms (collectives above)")
    fig.suptitle(f"Large gradients alone: no fusion-buffer copies, {result['workers']} ranks")
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["worker"]:
        print(json.dumps(worker(args[2:], int(args[1]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(
        prog="benchmarks.fusion_copies", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--name", default=NAME, help="the result files' name")
    options = parser.parse_args(args)
    rows = []
    for controller in LAUNCHERS:
        print(f"{NAME}: {controller}, np={options.np}", flush=True)
        row = measure(controller, options.np, options.models, options.repeats)
        for model in row["models"]:
            for label, ms in model["ms"].items():
                count = model["collectives"][label]
                print(f"  {model['model']:9s} {label:34s} {count:4d} collectives  {ms:7.1f} ms")
        rows.append(row)
    result = {"workers": options.np, "repeats": options.repeats, "rows": rows}
    gloo_pairs.save(result, options.out, options.name, figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
