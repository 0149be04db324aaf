"""The toolkit side by side with its peers, alternated in one run: ratios to the no-communication
ceiling, not absolute times (the cores are shared, so only what is measured together compares).

Every contestant trains the same model (the zoo's ResNet-20 by default) with Keras `fit()` on one
synthetic batch per process kept in memory (no input cost), SGD with momentum, the accuracy metric,
the same per-rank batch and compute threads. Each process fits one untimed epoch (tracing, the
start-of-training broadcast), then `epochs` timed epochs of `steps` steps; its rate is the median
over the timed epochs of samples per second of all ranks (ranks run in lock-step).

Contestants (`CONTESTANTS`):
  ceiling          np independent plain-Keras processes at once, their timed parts started
                   together: what the host gives with no communication at all
  keras            one plain-Keras process (the reference of the toolkit's overhead)
  toolkit          one process on the toolkit's fit path: `comm.init`, `DistributedOptimizer`,
                   `callbacks.distributed_callbacks()` and the agreed stop on TERM/USR1 (what
                   `train_and_evaluate` runs by default)
  toolkit-<l>      the same on np ranks under launcher <l> (mpirun, gloo = horovodrun --gloo)
  horovod-<l>      Horovod's own Keras recipe (classic stack only): hvd.DistributedOptimizer,
                   BroadcastGlobalVariablesCallback(0), MetricAverageCallback()
  mwms             TensorFlow's MultiWorkerMirroredStrategy, np local workers with TF_CONFIG
A contestant name may end in `@cycle=<ms>` to run it with HOROVOD_CYCLE_TIME set to that value, and
in `@pending=<ms>` for HOROVOD_PENDING_CYCLE_TIME (the installer's patched Horovod: its loop's cycle
while a tensor waits for the other ranks').

    python -m benchmarks.peers compare --np 2 --repeats 5 --name peers-classic \\
        ceiling mwms horovod-gloo horovod-mpirun toolkit-mpirun toolkit-gloo
    python -m benchmarks.peers compare --np 1 --repeats 5 --name overhead keras toolkit

Run from the repository root (`benchmarks/run.sh peers|overhead|cycle` does); every process it
starts runs there too, so that `python -m benchmarks.peers worker` finds this module.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hvd_train.core import launch, processes

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
LAUNCHERS = {"mpirun": "mpirun", "gloo": "horovodrun-gloo"}


# --- one process ---------------------------------------------------------------------------------


def _set_threads(threads: int) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)


def worker(
    mode: str,
    model_name: str,
    per_rank_batch_size: int,
    threads: int,
    steps: int,
    epochs: int,
    ready_dir: Path | None = None,
    ready_count: int = 1,
    step_ms: float | None = None,
) -> dict:
    """Train and time one contestant's process; returns its result (every rank).

    Args:
      mode: "keras", "toolkit", "horovod" or "mwms" (see the module docstring).
      ready_dir, ready_count: independent processes (the ceiling) each write a file there after
        their untimed epoch and start timing once `ready_count` files exist.
      step_ms: the toolkit's expected step time (`comm.init`), None: unknown.
    """
    rank, size, strategy = 0, 1, None
    if mode == "toolkit":
        from hvd_train import comm
        from hvd_train.keras.optimizer import DistributedOptimizer

        comm.init(threads=threads, step_ms=step_ms)
        rank, size = comm.rank(), comm.size()
    elif mode == "horovod":
        # The peer measured here is Horovod's own Keras integration, so this mode imports it
        # directly: the one use of horovod outside hvd_train.comm, in this harness outside the
        # package.
        import horovod.tensorflow.keras as hvd

        _set_threads(threads)
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        _set_threads(threads)
    import keras  # Keras 3 on the modern stack, Keras 2 (tf.keras) on the classic one
    import numpy as np
    import tensorflow as tf

    import models

    if mode == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        size = strategy.num_replicas_in_sync
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    rng = np.random.default_rng(rank)
    x = rng.standard_normal((per_rank_batch_size, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, (per_rank_batch_size,)).astype("int32")
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    lr = 0.01 * size  # scaled by the worker count, as every recipe does
    callbacks: list = []

    def compile_model(optimizer: object) -> object:
        model = models.build(model_name, (32, 32, 3), 10)
        # jit_compile=False: XLA is off on CPU hosts anyway; said so that no contestant differs.
        model.compile(optimizer, loss, metrics=["accuracy"], jit_compile=False)
        return model

    if mode == "mwms":
        with strategy.scope():
            model = compile_model(keras.optimizers.SGD(lr, momentum=0.9))
        data = strategy.distribute_datasets_from_function(
            lambda _: tf.data.Dataset.from_tensors((x, y)).repeat()
        )
    elif mode == "horovod":
        model = compile_model(hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)))
        callbacks = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
        ]
    elif mode == "toolkit":
        from hvd_train.callbacks import StopAtAgreedStep, distributed_callbacks
        from hvd_train.core import faults

        model = compile_model(DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)))
        # What train_and_evaluate runs on every rank by default: the distributed callbacks and
        # the agreed stop on TERM/USR1 (the watchdog's feed too, with more than one worker).
        stop = faults.StopRequest(["TERM", "USR1"])
        callbacks = [*distributed_callbacks(), StopAtAgreedStep(stop)]
    else:
        model = compile_model(keras.optimizers.SGD(lr, momentum=0.9))

    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            times.append(time.perf_counter() - self.start)
            if epoch == 0 and ready_dir is not None:
                (ready_dir / f"ready.{os.getpid()}").touch()
                while len(list(ready_dir.glob("ready.*"))) < ready_count:
                    time.sleep(0.01)

    # Last, so that its epoch time includes every other callback's work.
    callbacks.append(Timer())
    model.fit(data, epochs=1 + epochs, steps_per_epoch=steps, callbacks=callbacks, verbose=0)
    rates = [size * per_rank_batch_size * steps / t for t in times[1:]]
    return {
        "mode": mode,
        "model": model_name,
        "params": model.count_params(),
        "size": size,
        "rank": rank,
        "threads": threads,
        "per_rank_batch_size": per_rank_batch_size,
        "steps": steps,
        "warmup_epoch_s": times[0],
        "epoch_s": times[1:],
        "samples_per_s": statistics.median(rates),
        "step_ms": 1e3 * statistics.median(times[1:]) / steps,
        "horovod_cycle_time": os.environ.get("HOROVOD_CYCLE_TIME"),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


# --- contestants -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """What every contestant of one comparison shares."""

    np: int
    model: str = "resnet20"
    per_rank_batch_size: int = 64
    threads: int = 1
    steps: int = 10
    epochs: int = 3

    def worker_args(self, mode: str, step_ms: float | None = None) -> list[str]:
        known = [] if step_ms is None else ["--step-ms", f"{step_ms:.1f}"]
        return [
            sys.executable,
            "-m",
            "benchmarks.peers",
            "worker",
            "--mode",
            mode,
            "--model",
            self.model,
            "--batch-size",
            str(self.per_rank_batch_size),
            "--threads",
            str(self.threads),
            "--steps",
            str(self.steps),
            "--epochs",
            str(self.epochs),
            *known,
        ]


@dataclass(frozen=True)
class Contestant:
    """How to start one contestant: `kind` in ceiling | single | launched | mwms."""

    name: str
    kind: str
    mode: str
    launcher: str | None = None
    env: dict[str, str] = field(default_factory=dict)


CONTESTANTS = (
    "ceiling",
    "keras",
    "toolkit",
    "mwms",
    *(f"{mode}-{launcher}" for mode in ("toolkit", "horovod") for launcher in LAUNCHERS),
)


# A contestant's `@key=ms` suffixes: the Horovod setting each sets.
SUFFIXES = {"cycle": "HOROVOD_CYCLE_TIME", "pending": "HOROVOD_PENDING_CYCLE_TIME"}


def contestant(name: str) -> Contestant:
    """Parse a contestant name ("toolkit-gloo", "toolkit-gloo@cycle=20@pending=5", ...).

    Raises:
      ValueError: an unknown name or a malformed `@` suffix.
    """
    base, *suffixes = name.split("@")
    env: dict[str, str] = {}
    for suffix in suffixes:
        key, _, value = suffix.partition("=")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in SUFFIXES or ms < 0:
            raise ValueError(
                f"contestant {name!r}: a suffix must be @cycle=<ms >= 0> or @pending=<ms >= 0>"
            )
        env[SUFFIXES[key]] = value
    if base not in CONTESTANTS:
        raise ValueError(f"unknown contestant {base!r}; known: {', '.join(CONTESTANTS)}")
    if base == "ceiling":
        return Contestant(name, "ceiling", "keras", env=env)
    if base in ("keras", "toolkit"):
        return Contestant(name, "single", base, env=env)
    if base == "mwms":
        return Contestant(name, "mwms", "mwms", env=env)
    mode, launcher = base.split("-")
    return Contestant(name, "launched", mode, LAUNCHERS[launcher], env)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_processes(argvs: list[list[str]], envs: list[dict[str, str]]) -> None:
    # Each in a session of its own: on a failure or timeout its whole process group ends (a
    # launcher's ranks too), and nothing else.
    done = processes.run_all(argvs, envs, TIMEOUT_S, cwd=REPO)
    failed = [d for d in done if not d.ok]
    if failed:
        first = failed[0]
        raise RuntimeError(
            f"benchmark process failed ({first.outcome(TIMEOUT_S)}): {first.argv}\n{first.tail()}"
        )


def measure(who: Contestant, setting: Setting, step_ms: float | None = None) -> dict:
    """One run of one contestant; returns rank 0's result (the ceiling: each process's, summed).

    `step_ms` is the toolkit's expected step time (from an earlier run), given to its workers.
    """
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"r{i}.json" for i in range(setting.np)]
        base = setting.worker_args(who.mode, step_ms if who.mode == "toolkit" else None)
        env = processes.child_env(who.env)
        if who.kind == "single":
            _run_processes([[*base, "--out", str(outs[0])]], [env])
            return json.loads(outs[0].read_text())
        if who.kind == "launched":
            command = [*base, "--out", str(outs[0])]
            _run_processes([launch.build(who.launcher, setting.np, command)], [env])
            return json.loads(outs[0].read_text())
        if who.kind == "ceiling":
            ready = ["--ready-dir", tmp, "--ready-count", str(setting.np)]
            argvs = [[*base, *ready, "--out", str(out)] for out in outs]
            _run_processes(argvs, [env] * setting.np)
            results = [json.loads(out.read_text()) for out in outs]
            return {
                **results[0],
                "size": setting.np,
                "samples_per_s": sum(r["samples_per_s"] for r in results),
                "per_process": [r["samples_per_s"] for r in results],
            }
        ports = _free_ports(setting.np)
        cluster = {"worker": [f"localhost:{port}" for port in ports]}
        envs = [
            {
                **env,
                "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": i}}
                ),
            }
            for i in range(setting.np)
        ]
        _run_processes([[*base, "--out", str(out)] for out in outs], envs)
        return json.loads(outs[0].read_text())


def _load() -> list[float]:
    return list(os.getloadavg())


def compare(names: list[str], setting: Setting, repeats: int, reference: str) -> dict:
    """Run every contestant once per round, `repeats` rounds; ratios to `reference` per round.

    The order inside a round rotates, so that no contestant always runs first (the machine's load
    drifts); each ratio is taken within one round, side by side. The toolkit's workers are told
    the step time the latest ceiling run measured (one rank's step with the same threads, alone on
    its share of the cores): what the toolkit would know from an earlier run.
    """
    contestants = [contestant(name) for name in names]
    if reference not in names:
        raise ValueError(f"the reference {reference!r} is not among the contestants {names}")
    rounds = []
    step_ms = None
    for r in range(repeats):
        order = contestants[r % len(contestants) :] + contestants[: r % len(contestants)]
        row: dict[str, dict] = {}
        for who in order:
            load = _load()
            result = measure(who, setting, step_ms)
            result["load_before"] = load
            if who.kind == "ceiling":
                step_ms = result["step_ms"]
            row[who.name] = result
            print(
                f"round {r + 1}/{repeats} {who.name:<24} {result['samples_per_s']:7.1f} samples/s "
                f"(step {result['step_ms']:.0f} ms, load {load[0]:.2f})",
                flush=True,
            )
        rounds.append(row)
    summary = {}
    for name in names:
        rates = [row[name]["samples_per_s"] for row in rounds]
        ratios = [row[name]["samples_per_s"] / row[reference]["samples_per_s"] for row in rounds]
        summary[name] = {
            "samples_per_s_median": statistics.median(rates),
            "samples_per_s": rates,
            "step_ms_median": statistics.median(row[name]["step_ms"] for row in rounds),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratios": ratios,
        }
    return {
        "bench": "peers",
        "reference": reference,
        "setting": setting.__dict__,
        "repeats": repeats,
        "stack": {k: rounds[0][reference][k] for k in ("tensorflow", "keras")},
        "host_cpus": os.cpu_count(),
        "summary": summary,
        "rounds": rounds,
    }


def plot(result: dict, png: Path) -> None:
    """Each contestant's ratio to the reference: median bar, the rounds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4), layout="constrained")
    medians = [result["summary"][n]["ratio_median"] for n in names]
    ax.bar(range(len(names)), medians, color=["C0" if "toolkit" in n else "C7" for n in names])
    for i, name in enumerate(names):
        ratios = result["summary"][name]["ratios"]
        ax.scatter([i] * len(ratios), ratios, color="black", s=10, zorder=3)
        ax.annotate(f"{medians[i]:.2f}", (i, medians[i]), ha="center", va="bottom", fontsize=8)
    setting, stack = result["setting"], result["stack"]
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax.set(
        ylabel=f"samples/s / {result['reference']}",
        title=(
            f"{setting['model']}, {setting['np']} worker(s), batch {setting['per_rank_batch_size']}"
            f"/worker, {setting['threads']} thread(s)/worker; TF {stack['tensorflow']}, "
            f"Keras {stack['keras']} (median of {result['repeats']} rounds, dots: each round)"
        ),
    )
    ax.title.set_fontsize(8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(png, dpi=110)
    plt.close(fig)


# --- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("worker", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="resnet20")
        p.add_argument("--batch-size", type=int, default=64, help="per rank [64]")
        p.add_argument("--threads", type=int, default=1, help="compute threads per rank [1]")
        p.add_argument("--steps", type=int, default=10, help="steps per epoch [10]")
        p.add_argument("--epochs", type=int, default=3, help="timed epochs after one untimed [3]")
    w = sub.choices["worker"]
    w.add_argument("--mode", required=True, choices=["keras", "toolkit", "horovod", "mwms"])
    w.add_argument("--ready-dir", type=Path)
    w.add_argument("--ready-count", type=int, default=1)
    w.add_argument("--step-ms", type=float, help="toolkit: expected step time [unknown]")
    w.add_argument("--out", type=Path, help="rank 0 writes its result here")
    c = sub.choices["compare"]
    c.add_argument(
        "contestants", nargs="+", help=f"of {', '.join(CONTESTANTS)}[@cycle=MS][@pending=MS]"
    )
    c.add_argument("--np", type=int, default=2, help="workers [2]")
    c.add_argument("--repeats", type=int, default=5, help="rounds [5]")
    c.add_argument("--reference", help="ratios to this contestant [the first]")
    c.add_argument("--name", default="peers", help="result file name [peers]")
    c.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.command == "worker":
        result = worker(
            args.mode,
            args.model,
            args.batch_size,
            args.threads,
            args.steps,
            args.epochs,
            args.ready_dir,
            args.ready_count,
            args.step_ms,
        )
        if args.out and result["rank"] == 0:
            args.out.write_text(json.dumps(result, indent=1))
        return 0
    try:
        for name in args.contestants:
            contestant(name)
    except ValueError as err:
        parser.error(str(err))
    # A timeout's SIGTERM unwinds through `_run_processes`, which then ends the ranks it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    setting = Setting(args.np, args.model, args.batch_size, args.threads, args.steps, args.epochs)
    result = compare(args.contestants, setting, args.repeats, args.reference or args.contestants[0])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{args.name}.png")
    for name, s in result["summary"].items():
        print(
            f"{name:<24} {s['samples_per_s_median']:7.1f} samples/s, {s['ratio_median']:.3f} of "
            f"{result['reference']} [{s['ratio_min']:.3f}, {s['ratio_max']:.3f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
