"""Per-rank memory of Adam with and without sharded optimizer state (`optimizer.shard_state`,
hvd_train/keras/sharded.py): measured in the running ranks, not computed from the model.

    .venv/bin/python -m benchmarks.sharded_state [--models mlp100m,resnet50] [--workers 1,2,4]
        [--steps 3] [--out benchmarks/results]

Writes sharded-state.json and sharded-state.png into --out. For each model, worker count N and
variant (unsharded, sharded), one job of N ranks under mpirun on this machine trains `--steps`
steps of Adam on a synthetic batch; each rank reports the bytes of the variables its optimizer
holds (the unsharded optimizer's variables; the sharded one's scalars plus its shards: slots and
the weight shard its update writes, `sharded.state_bytes`), its resident memory after the model
is built and before the optimizer exists, and its peak resident memory (getrusage's ru_maxrss)
after the steps. The figures are each job's largest rank.

Models: "mlp100m", the zoo's mlp on 2048 inputs with hidden layers (8192, 8192, 2048): 100.7 M
parameters, batch 8 per rank; "resnet50", Keras's ResNet-50 with 10 classes (23.6 M trainable
parameters) on 64x64x3 images, batch 4 per rank (the parameter count does not depend on the image
size). Each job runs alone; the machine's other load slows the steps, not the memory figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from hvd_train.core import launch, processes

REPO = Path(__file__).resolve().parents[1]
NAME = "sharded-state"
# name: (zoo model, input shape, hidden layers or None, per-rank batch)
MODELS = {
    "mlp100m": ("mlp", (2048,), (8192, 8192, 2048), 8),
    "resnet50": ("resnet50", (64, 64, 3), None, 4),
}
VARIANTS = ("unsharded", "sharded")
TIMEOUT_S = 900


def _rss_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def worker(model_name: str, variant: str, steps: int) -> dict:
    """One rank's figures (see the module docstring)."""
    import keras
    import numpy as np

    import hvd_train
    import models
    from hvd_train import comm
    from hvd_train.keras import compat, sharded

    comm.init()
    zoo, shape, hidden, batch = MODELS[model_name]
    keras.utils.set_random_seed(0)
    params = {"hidden": hidden} if hidden else {}
    model = models.build(zoo, shape, 10, **params)
    rss_model = _rss_bytes()
    optimizer = hvd_train.DistributedOptimizer(
        keras.optimizers.Adam(1e-4), shard_state=variant == "sharded"
    )
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    rng = np.random.default_rng(comm.rank())
    x = rng.standard_normal((batch, *shape)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    callbacks = [hvd_train.BroadcastInitialState()]
    started = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=steps, verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - started
    shards = list(getattr(model.optimizer, "shard_variables", []))
    return {
        "model": model_name,
        "variant": variant,
        "workers": comm.size(),
        "rank": comm.rank(),
        "parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "optimizer_bytes": sharded.state_bytes(model.optimizer),
        "optimizer_variables": len(compat.optimizer_variables(model.optimizer)) + len(shards),
        "rss_after_model_bytes": rss_model,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "fit_seconds": seconds,
    }


def run_ranks(module_args: list[str], workers: int, label: str) -> list[dict]:
    """One job of `workers` ranks under mpirun, each running `python -m MODULE ARGS...` and
    printing one JSON line: those lines in rank order."""
    argv = launch.build("mpirun", workers, [sys.executable, "-m", *module_args])
    env = processes.child_env({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)})
    done = processes.run(argv, env, TIMEOUT_S, cwd=REPO, capture="separate")
    ranks = [json.loads(line) for line in (done.output or "").splitlines() if line[:1] == "{"]
    if not done.ok or len(ranks) != workers:
        raise RuntimeError(f"{label} np={workers}: {(done.errors or '')[-2000:]}")
    return sorted(ranks, key=lambda r: r["rank"])


def measure(model_name: str, variant: str, workers: int, steps: int) -> dict:
    """One job's ranks, and its largest rank's figures."""
    module = ["benchmarks.sharded_state", "worker", model_name, variant, str(steps)]
    ranks = run_ranks(module, workers, f"{model_name} {variant}")
    largest = {
        key: max(r[key] for r in ranks)
        for key in ("optimizer_bytes", "rss_after_model_bytes", "peak_rss_bytes", "fit_seconds")
    }
    return {
        "model": model_name,
        "variant": variant,
        "workers": workers,
        "parameters": ranks[0]["parameters"],
        **largest,
        "ranks": ranks,
    }


def plot_memory(
    ax: object, rows: list[dict], held: str, what: str, color: str, variant: str
) -> None:
    """Two lines against the worker count: the bytes of `held` (what the variables hold) and the
    peak resident memory, in GiB."""
    workers = [r["workers"] for r in rows]
    gib = 2**30
    ax.plot(
        workers, [r[held] / gib for r in rows], marker="o", color=color, label=f"{variant}: {what}"
    )
    ax.plot(
        workers,
        [r["peak_rss_bytes"] / gib for r in rows],
        marker="s",
        linestyle="--",
        color=color,
        label=f"{variant}: peak RSS",
    )


def print_row(row: dict) -> None:
    """A job's figures as one JSON line, without its ranks' (progress)."""
    print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)


def write_result(result: dict, out: Path, name: str, figure: Any) -> None:
    """NAME.json and NAME.png (`figure(result, png)`) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    figure(result, out / f"{name}.png")
    print(f"wrote {out / name}.json and .png")


def finish(fig: Any, axes: Any, workers: list[int], png: Path) -> None:
    """The worker counts as ticks, a grid and a legend on each axis; the figure saved and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_xticks(workers, [str(n) for n in workers])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def figure(result: dict, png: Path) -> None:
    """Per model: optimizer bytes and peak resident memory per rank against the worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, axes = plt.subplots(
        1, len(names), figsize=(6.2 * len(names), 4.4), layout="constrained", squeeze=False
    )
    for ax, name in zip(axes[0], names, strict=True):
        for variant, color in zip(VARIANTS, ("tab:gray", "tab:blue"), strict=True):
            rows = sorted(
                (r for r in result["rows"] if r["model"] == name and r["variant"] == variant),
                key=lambda r: r["workers"],
            )
            workers = [r["workers"] for r in rows]
            plot_memory(ax, rows, "optimizer_bytes", "optimizer variables", color, variant)
        params = next(r["parameters"] for r in result["rows"] if r["model"] == name)
        ax.set(
            xlabel="workers N (one host)",
            ylabel="GiB per rank (largest rank)",
            title=f"{name}: Adam, {params / 1e6:.1f} M parameters",
            ylim=(0, None),
        )
    finish(fig, axes[0], workers, png)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        print(json.dumps(worker(argv[1], argv[2], int(argv[3]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    rows = []
    for name in names:
        for workers in [int(n) for n in args.workers.split(",")]:
            for variant in VARIANTS:
                row = measure(name, variant, workers, args.steps)
                rows.append(row)
                print_row(row)
    result = {
        "what": "per-rank bytes of Adam's optimizer variables and peak RSS, sharded or not",
        "how": "N ranks under mpirun on one host, measured in each rank; the largest rank",
        "steps": args.steps,
        "rows": rows,
    }
    write_result(result, args.out, NAME, figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
