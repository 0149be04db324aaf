"""Per worker, the modern stack against the classic one: where Keras 3's extra step time goes.

One process, one compute thread, plain Keras `fit()` (no Horovod), synthetic data, the zoo's
ResNet-20 (32x32x3, batch 64) and ResNet-50 (64x64x3, batch 16), and, for the CPU kernels only,
its default CNN, Transformer and wide MLP (no BatchNormalization). Variants of each model's
BatchNormalization: Keras's own layer ("keras": on Keras 3 unfused, on Keras 2 the fused
kernel), the zoo's `FusedBatchNormalization` ("fused", Keras 3 only), and none at all ("none":
the same network without BatchNormalization, which shows what the rest costs). Each runs with
TensorFlow's oneDNN CPU kernels, as the toolkit sets them; Keras's layer on classic and the fused
layer on modern also run with Eigen's ("eigen": `TF_ENABLE_ONEDNN_OPTS=0`, TensorFlow's default on
x86 CPUs without AVX-512 VNNI or BF16, AVX-VNNI or AMX). Each variant runs in its own process,
rounds alternate the variants, and the median step over the rounds is kept.

    .venv/bin/python -m benchmarks.stacks [--rounds 3] [--out benchmarks/results]
Writes stacks.json and stacks.png: median step time per variant, and samples/s of each modern
variant as a fraction of the classic stack's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from hvd_train.core import processes

REPO = Path(__file__).resolve().parents[1]
# name: (zoo model, input shape, batch, zoo parameters, token ids below this or 0 for floats)
MODELS = {
    "resnet20": ("resnet20", (32, 32, 3), 64, {}, 0),
    "resnet50": ("resnet50", (64, 64, 3), 16, {}, 0),
    "cnn": ("cnn", (28, 28, 1), 32, {}, 0),
    "transformer": ("transformer", (64,), 32, {}, 10000),
    "wide_mlp": ("mlp", (32, 32, 3), 16, {"hidden": [2048, 2048]}, 0),
}
BATCHNORM_MODELS = ("resnet20", "resnet50")  # the others: only the Keras variants
# (stack, batch-norm variant, CPU kernels); the stack's venv is found by `venv_python`.
VARIANTS = [("classic", "keras", "onednn"), ("classic", "none", "onednn")]
VARIANTS += [("modern", v, "onednn") for v in ("keras", "fused", "none")]
VARIANTS += [("classic", "keras", "eigen"), ("modern", "fused", "eigen")]
KERNELS_ENV = {"onednn": "1", "eigen": "0"}  # TF_ENABLE_ONEDNN_OPTS
TIMEOUT_S = 900


def worker(model_name: str, variant: str, steps: int) -> dict:
    """One variant's median step time (ms) over `steps` steps after two warm-up fits."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np

    import models
    from models.layers import FusedBatchNormalization

    zoo, shape, batch, params, tokens = MODELS[model_name]
    keras.utils.set_random_seed(0)
    model = models.build(zoo, shape, 10, **params)
    norms = (keras.layers.BatchNormalization, FusedBatchNormalization)

    class NoNormalization(keras.layers.Layer):
        """Takes BatchNormalization's place (and call arguments) and passes its input on."""

        def call(self, inputs: object, training: object = None, mask: object = None) -> object:
            return inputs

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        if type(layer) in norms:
            if variant == "none":
                return NoNormalization(name=layer.name)
            fused = variant == "fused"
            kind = FusedBatchNormalization if fused else keras.layers.BatchNormalization
            return kind.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    model = keras.models.clone_model(model, clone_function=clone)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    if tokens:
        x = rng.integers(0, tokens, (batch, *shape)).astype("int32")
    else:
        x = rng.standard_normal((batch, *shape)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            times.append(time.perf_counter() - self.start)

    model.fit(data, steps_per_epoch=3, epochs=1, verbose=0)
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Clock()])
    kinds = sorted({type(layer).__name__ for layer in model.layers})
    return {"step_ms": 1000 * statistics.median(times), "layers": kinds, "keras": keras.__version__}


def venv_python(stack: str) -> str:
    name = os.environ.get("CLASSIC_VENV" if stack == "classic" else "VENV")
    venv = Path(name) if name else REPO / (".venv-classic" if stack == "classic" else ".venv")
    return str(venv / "bin" / "python")


def measure(stack: str, model_name: str, variant: str, kernels: str, steps: int) -> dict:
    argv = [venv_python(stack), "-m", "benchmarks.stacks", "worker", model_name, variant]
    argv.append(str(steps))
    settings = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    env = processes.child_env({**settings, "TF_ENABLE_ONEDNN_OPTS": KERNELS_ENV[kernels]})
    done = processes.run(argv, env, TIMEOUT_S, cwd=REPO, capture="separate")
    lines = [line for line in done.output.splitlines() if line.startswith("{")]
    if not done.ok or not lines:
        raise RuntimeError(f"{stack}/{variant}/{kernels} {model_name}: {done.errors[-2000:]}")
    return json.loads(lines[-1])


def compare(rounds: int, steps: int) -> dict:
    rows = []
    for model_name in MODELS:
        variants = [v for v in VARIANTS if model_name in BATCHNORM_MODELS or v[1] == "keras"]
        seen: dict[tuple[str, str, str], list[dict]] = {v: [] for v in variants}
        for r in range(rounds):
            for stack, variant, kernels in variants:
                got = measure(stack, model_name, variant, kernels, steps)
                seen[(stack, variant, kernels)].append(got)
                name = f"{stack}/{variant}/{kernels}"
                print(f"{model_name} round {r + 1}: {name} {got['step_ms']:.1f} ms", flush=True)
        for (stack, variant, kernels), runs in seen.items():
            rows.append(
                {
                    "model": model_name,
                    "stack": stack,
                    "variant": variant,
                    "kernels": kernels,
                    "step_ms": statistics.median(run["step_ms"] for run in runs),
                    "rounds_ms": [run["step_ms"] for run in runs],
                    "layers": runs[0]["layers"],
                    "keras": runs[0]["keras"],
                }
            )
    for row in rows:
        classic = next(
            r["step_ms"]
            for r in rows
            if r["model"] == row["model"]
            and (r["stack"], r["variant"], r["kernels"]) == VARIANTS[0]
        )
        row["per_worker_vs_classic"] = classic / row["step_ms"]
        if row["kernels"] == "eigen":  # how much slower the same variant runs without oneDNN
            row["eigen_vs_onednn"] = row["step_ms"] / next(
                r["step_ms"]
                for r in rows
                if (r["model"], r["stack"], r["variant"], r["kernels"])
                == (row["model"], row["stack"], row["variant"], "onednn")
            )
    return {"rounds": rounds, "steps": steps, "threads": 1, "rows": rows}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(3.4 * len(MODELS), 5), layout="constrained")
    for ax, model_name in zip(axes, MODELS, strict=True):
        rows = [r for r in result["rows"] if r["model"] == model_name]
        labels = [f"{r['stack']}\n{r['variant']}\n{r['kernels']}" for r in rows]
        bars = ax.bar(labels, [r["step_ms"] for r in rows], color="tab:blue")
        for bar, row in zip(bars, rows, strict=True):
            ax.annotate(
                f"{row['per_worker_vs_classic']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
            )
        ax.set(title=f"{model_name}: step, 1 thread", ylabel="ms/step (labels: vs classic)")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "worker":
        print(json.dumps(worker(args[1], args[2], int(args[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parsed = parser.parse_args(args)
    result = compare(parsed.rounds, parsed.steps)
    parsed.out.mkdir(parents=True, exist_ok=True)
    (parsed.out / "stacks.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, parsed.out / "stacks.png")
    for row in result["rows"]:
        eigen = row.get("eigen_vs_onednn")
        print(
            f"{row['model']:11} {row['stack']:8} {row['variant']:6} {row['kernels']:6} "
            f"{row['step_ms']:8.1f} ms  {row['per_worker_vs_classic']:.2f}x classic"
            + (f"  {eigen:.2f}x oneDNN's step" if eigen else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
