"""Final validation accuracy against the global batch, for five learning-rate recipes
(docs/large-batch.md): what a larger global batch does to accuracy in a fixed number of epochs.

    .venv/bin/python -m benchmarks.large_batch [--tasks mnist_5k,synthetic] [--seeds 3]
        [--batches 32,128,256,512,1024,2048] [--recipes none,linear,warmup,lars,lamb] [--out DIR]

Writes large-batch.json and large-batch.png into --out (benchmarks/results).

Each point trains the toolkit's `cnn` from scratch with the toolkit's own pieces (config
validation, data source and pipeline, model, schedule, optimizer) in this one process, with the
global batch as its batch. That is what 2 workers with per-rank batch b and
`backward_passes_per_step` k compute for a global batch of 2 * b * k: tests/parallel/
test_equivalence.py and test_large_batch_optimizers.py prove N ranks x b (x k passes) update like
one process with N*b*k, for SGD, LARS and LAMB alike. The rows say which 2-worker set-up each
global batch stands for.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NAME = "large-batch"
WORKERS = 2  # the set-up each global batch stands for: 2 workers
MAX_PER_RANK = 256  # beyond it, a worker accumulates (backward_passes_per_step > 1)
BASE_BATCH = 32  # every recipe's base_lr is tuned for this global batch
# The zoo's cnn at half width (0.4M parameters): the whole sweep fits in half an hour on 2 cores.
MODEL_PARAMS = "{filters: [16, 32], dense: 64}"

# Each task: its data section, epochs and seeds. 4,500 training images each, so that the largest
# batch still makes two updates per epoch.
TASKS: dict[str, dict[str, Any]] = {
    "mnist_5k": {
        "data": ["data.source=mnist_5k", "data.validation_fraction=0.1"],
        "epochs": 10,
        "seeds": 3,
    },
    "synthetic": {
        "data": [
            "data.source=synthetic",
            "data.shape=[32, 32, 3]",
            "data.num_samples=5000",
            "data.validation_fraction=0.1",
        ],
        "epochs": 4,
        "seeds": 2,
    },
}

# The recipes: config overrides. The same warmup (20% of the run) and polynomial decay (power 2,
# to 0) wherever there is a warmup; (a) and (b) decay the same way from their peak without one.
RECIPES: dict[str, dict[str, Any]] = {
    "none": {
        "label": "(a) SGD, no LR scaling",
        "set": ["optimizer.name=sgd", "optimizer.base_lr=0.05", "optimizer.warmup_epochs=0"],
        "unscaled": True,
    },
    "linear": {
        "label": "(b) SGD, linear scaling, no warmup",
        "set": ["optimizer.name=sgd", "optimizer.base_lr=0.05", "optimizer.warmup_epochs=0"],
    },
    "warmup": {
        "label": "(c) SGD, linear scaling + warmup",
        "set": ["optimizer.name=sgd", "optimizer.base_lr=0.05"],
        "warmup": True,
    },
    "lars": {
        "label": "(d) LARS, sqrt scaling + warmup",
        "set": [
            "optimizer.name=lars",
            "optimizer.base_lr=0.1",
            "optimizer.lr_rule=sqrt",
            "optimizer.trust_coefficient=0.02",
            "optimizer.weight_decay=0.0001",
        ],
        "warmup": True,
    },
    "lamb": {
        "label": "(e) LAMB, sqrt scaling + warmup",
        "set": [
            "optimizer.name=lamb",
            "optimizer.base_lr=0.01",
            "optimizer.lr_rule=sqrt",
            "optimizer.weight_decay=0.01",
        ],
        "warmup": True,
    },
}


def two_workers(global_batch: int) -> dict[str, int]:
    """The 2-worker set-up a global batch stands for: per-rank batch x passes x workers."""
    per_rank = min(global_batch // WORKERS, MAX_PER_RANK)
    return {
        "workers": WORKERS,
        "per_rank_batch_size": per_rank,
        "backward_passes_per_step": global_batch // (WORKERS * per_rank),
    }


def overrides(task: str, recipe: str, global_batch: int, seed: int, epochs: int) -> list[str]:
    """The config of one point, as `--set` overrides (`hvd-train train` would take the same)."""
    spec = RECIPES[recipe]
    base_batch = global_batch if spec.get("unscaled") else BASE_BATCH
    warmup = 0.2 * epochs if spec.get("warmup") else 0
    return [
        *TASKS[task]["data"],
        f"data.seed={seed}",
        "model.name=cnn",
        f"model.params={MODEL_PARAMS}",
        *spec["set"],
        f"optimizer.base_batch_size={base_batch}",
        f"optimizer.warmup_epochs={warmup}",
        "optimizer.decay=polynomial",
        "optimizer.decay_power=2",
        f"train.epochs={epochs}",
        f"train.global_batch_size={global_batch}",
        f"train.seed={seed}",
    ]


@functools.cache
def _source(data: str) -> Any:
    """A data section's source, loaded once per sweep (mnist_5k parses a CSV file)."""
    from hvd_train.core import config as config_lib
    from hvd_train.data import sources

    return sources.load(config_lib.load(None, json.loads(data), log_notes=False).data)


def train_point(settings: list[str]) -> dict[str, Any]:
    """Train one configuration in this process; its final validation metrics."""
    import keras

    from hvd_train.core import config as config_lib
    from hvd_train.data import pipeline
    from hvd_train.training import setup

    config = config_lib.load(None, settings, log_notes=False)
    global_batch = config.train.global_batch_size
    setup.apply_numerics(config.train)
    source = _source(json.dumps([s for s in settings if s.startswith("data.")]))
    train, steps = pipeline.train_dataset(
        source, global_batch, 0, 1, seed=config.data.seed, augment=config.data.augment
    )
    val = pipeline.validation_dataset(source, 500, 0, 1)
    model = setup.build_model(config, source.input_shape, source.num_classes)
    schedule = setup.make_schedule(config, global_batch, steps)
    model.compile(
        optimizer=setup.make_optimizer(config.optimizer, schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    history = model.fit(train, epochs=config.train.epochs, steps_per_epoch=steps, verbose=0)
    loss, accuracy = model.evaluate(val, verbose=0)
    return {
        "val_accuracy": float(accuracy),
        "val_loss": float(loss),
        "train_loss": float(history.history["loss"][-1]),
        "updates": steps * config.train.epochs,
        "seconds": round(time.perf_counter() - start, 2),
    }


def _run(point: dict[str, Any], epochs: int | None) -> dict[str, Any]:
    """One point of the sweep (in a pool process): its epochs and final metrics."""
    epochs = epochs or TASKS[point["task"]]["epochs"]
    task, recipe, batch, seed = (point[k] for k in ("task", "recipe", "global_batch", "seed"))
    settings = overrides(task, recipe, batch, seed, epochs)
    return {"epochs": epochs, **train_point(settings)}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean, min and max of the final accuracy over seeds, per task, recipe and global batch."""
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        key = (row["task"], row["recipe"], row["global_batch"])
        groups.setdefault(key, []).append(row["val_accuracy"])
    return [
        {
            "task": task,
            "recipe": recipe,
            "global_batch": batch,
            "seeds": len(values),
            "mean": round(statistics.fmean(values), 4),
            "min": round(min(values), 4),
            "max": round(max(values), 4),
        }
        for (task, recipe, batch), values in groups.items()
    ]


def figure(result: dict[str, Any], png: Path) -> None:
    """One panel per task: final validation accuracy against the global batch, one line per
    recipe (the mean over seeds), the band from the worst to the best seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in result["summary"]))
    fig, axes = plt.subplots(
        1, len(tasks), figsize=(6.2 * len(tasks), 4.4), layout="constrained", squeeze=False
    )
    for ax, task in zip(axes[0], tasks, strict=True):
        for recipe in dict.fromkeys(r["recipe"] for r in result["summary"]):
            rows = sorted(
                (r for r in result["summary"] if r["task"] == task and r["recipe"] == recipe),
                key=lambda r: r["global_batch"],
            )
            batches = [r["global_batch"] for r in rows]
            (line,) = ax.plot(
                batches, [r["mean"] for r in rows], marker="o", label=RECIPES[recipe]["label"]
            )
            ax.fill_between(
                batches,
                [r["min"] for r in rows],
                [r["max"] for r in rows],
                color=line.get_color(),
                alpha=0.15,
            )
        epochs, seeds = result["tasks"][task]["epochs"], result["tasks"][task]["seeds"]
        ax.set(
            xscale="log",
            xlabel="global batch (2 workers x per-rank batch x backward passes)",
            ylabel="final validation accuracy",
            title=f"{task}: cnn, {epochs} epochs, {seeds} seeds (band: min-max)",
            ylim=(0, 1.02),
        )
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--batches", default="32,128,256,512,1024,2048")
    parser.add_argument("--seeds", type=int, default=None, help="instead of each task's own")
    parser.add_argument("--epochs", type=int, default=None, help="instead of each task's own")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--name", default=NAME)
    parser.add_argument("--jobs", type=int, default=2, help="points trained at the same time")
    args = parser.parse_args(argv)
    tasks, recipes = args.tasks.split(","), args.recipes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    for name, known in (("task", TASKS), ("recipe", RECIPES)):
        unknown = [v for v in (tasks if name == "task" else recipes) if v not in known]
        if unknown:
            parser.error(f"unknown {name}(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    bad = [b for b in batches if b < WORKERS or b % WORKERS]
    if bad or (args.seeds is not None and args.seeds < 1) or args.jobs < 1:
        parser.error(f"batches must be even and >= {WORKERS}, seeds and jobs >= 1")
    points = [
        {"task": task, "recipe": recipe, "global_batch": batch, "seed": seed}
        for task in tasks
        for seed in range(args.seeds or TASKS[task]["seeds"])
        for recipe in recipes
        for batch in batches
    ]
    rows = []
    started = time.perf_counter()
    # Independent points in `--jobs` processes: small batches keep less than one core busy, so
    # two processes use a 2-core machine better than one.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        results = pool.map(_run, points, [args.epochs] * len(points))
        for point, metrics in zip(points, results, strict=True):
            row = {**point, **two_workers(point["global_batch"]), **metrics}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "what": "final validation accuracy against the global batch, per learning-rate recipe",
        "how": "one process with the global batch (= 2 workers x per-rank batch x passes)",
        "tasks": {
            t: {
                "epochs": args.epochs or TASKS[t]["epochs"],
                "seeds": args.seeds or TASKS[t]["seeds"],
                "data": TASKS[t]["data"],
            }
            for t in tasks
        },
        "model": {"name": "cnn", "params": MODEL_PARAMS},
        "recipes": {
            r: {"label": RECIPES[r]["label"], "overrides": RECIPES[r]["set"]} for r in recipes
        },
        "base_batch_size": BASE_BATCH,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
        "summary": summarise(rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    figure(result, args.out / f"{args.name}.png")
    print(f"wrote {args.out / args.name}.json and .png in {result['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
