"""Where communication costs: the training step on the cluster's hosts at real link rates.

For each link rate the cluster (`mpi_scripts/cluster/cluster.sh`, 2 hosts, one CPU each) is brought
up with that rate on every data link, `hvd-train selftest` records the rate and latency the link
actually delivers, and then, for 2 hosts x 1 slot and 2 hosts x 2 slots, one job per stack runs
on the hosts. Its ranks measure, for each model, side by side and under the job's own CPU
confinement:

  forward      the forward pass and loss alone (a compiled function)
  backward     forward + backward (the gradients) minus forward
  ceiling      plain Keras `fit()` step, no communication: the no-communication ceiling
  allreduce    one grouped allreduce of the model's gradients (same shapes and bytes) alone
  <variant>    the `fit()` step of each variant (`VARIANTS`)

and the hidden part of the allreduce: hidden = (ceiling + allreduce - step) / allreduce. Every step
time is the median over the timed steps of rank 0 (the ranks run in lock-step). Compute alone does
not depend on the link: it is measured at the first rate and taken at the others. The classic
stack also runs MultiWorkerMirroredStrategy, in a job of its own (`mwms_job`). `hvd-train plan`'s
cluster model (`hvd_train.bench.plan.cluster_step`) predicts each variant's step from the
selftest's link rate and latency and the compute measured alone; the residuals go with the results.

    python -m benchmarks.network run [--rates unlimited 10gbit 1gbit] [--models ...] [--quick]
    python -m benchmarks.network plot benchmarks/results/network.json    # figures again
    python -m benchmarks.network table benchmarks/results/network.json   # Markdown

`run` needs root (the cluster) and must hold the machine's cluster lock: `benchmarks/run.sh
network` takes it. Run from the repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "mpi_scripts" / "cluster" / "cluster.sh"
STACKS = {
    "modern": REPO / ".venv" / "bin" / "python",
    "classic": REPO / ".venv-classic" / "bin" / "python",
}
LAYOUTS = {"2x1": ("h1:1,h2:1", 2), "2x2": ("h1:2,h2:2", 4)}
# Horovod's controller, and the launcher that starts a job under it. horovodrun starts its
# rendezvous server where it runs, which the hosts must reach: every job is launched on h1, as a
# user launches on the first node of an allocation.
CONTROLLERS = {"mpi": "mpirun", "gloo": "horovodrun-gloo"}
RATES = ("unlimited", "10gbit", "1gbit")
JOB_TIMEOUT_S = 1500
# The link rate a job's ranks size their gradient buckets by (hvd_train.core.environment).
LINK_GBIT = "HVD_TRAIN_LINK_GBIT"


@dataclass(frozen=True)
class ModelCase:
    """One model of the benchmark: a zoo model, its input and its batch per rank."""

    name: str
    zoo: str
    input_shape: tuple[int, ...]
    per_rank_batch_size: int
    params: dict = field(default_factory=dict)
    tokens: int = 0  # > 0: integer token ids below this (a sequence model); 0: float images
    clicks: int = 0  # > 0: click rows, CLICK_FIELDS Zipf-skewed ids below this, then dense floats


CLICK_FIELDS = 8
MODELS = {
    m.name: m
    for m in (
        ModelCase("resnet20", "resnet20", (32, 32, 3), 32),
        # About 94 MB of fp32 gradients, against 0.5 s of compute on one core.
        ModelCase("resnet50", "resnet50", (64, 64, 3), 16),
        ModelCase("transformer", "transformer", (64,), 32, tokens=10000),
        # Gradients large against its compute: about 42 MB of weights, a few ms of matmuls.
        ModelCase(
            "wide_mlp", "mlp", (32, 32, 3), 16, {"hidden": [2048, 2048], "activation": "relu"}
        ),
        # The click model with a 1,000,000 x 32 table (128 MB): split by rows over the ranks
        # (two alltoalls per lookup), or Keras's Embedding whole on every rank (its gradient
        # densified into the allreduce). Not for the allreduce figures: the split table's
        # gradient is never allreduced.
        *(
            ModelCase(
                f"dlrm-{kind}",
                "dlrm",
                (CLICK_FIELDS + 4,),
                256,
                {"rows": 1_000_000, "fields": CLICK_FIELDS, "dim": 32, "sharded": kind == "split"},
                clicks=1_000_000,
            )
            for kind in ("split", "dp")
        ),
    )
}


@dataclass(frozen=True)
class Variant:
    """One way of training the same model: who averages the gradients, and how.

    Attributes:
      name: its label in the results.
      stack: "modern" (Keras 3) or "classic" (Keras 2).
      kind: "toolkit" (the toolkit's DistributedOptimizer, compiled from its config with
        `overrides` as `hvd-train train` compiles it), "per_tensor" (a bare Keras 3 optimizer
        issuing Horovod's allreduce once per gradient), "horovod_keras" (Horovod's own Keras
        recipe: per-tensor allreduce, fused by Horovod's cycle), "mwms" (TensorFlow's
        MultiWorkerMirroredStrategy, in a job of its own: no Horovod).
      overrides: `--set` strings applied to the toolkit's default config.
      layouts: the layouts it runs in (two-level reduction needs several ranks per host).
    """

    name: str
    stack: str
    kind: str
    overrides: tuple[str, ...] = ()
    layouts: tuple[str, ...] = tuple(LAYOUTS)

    def setting(self, key: str, default: str) -> str:
        """The value its overrides give the dotted config `key`, else `default`."""
        values = dict(text.partition("=")[::2] for text in self.overrides)
        return values.get(key, default)


# Variants are data: a toolkit knob is one more entry of --set overrides. A variant whose keys this
# tree's config lacks is skipped (and named in the results).
VARIANTS = {
    v.name: v
    for v in (
        Variant("toolkit", "modern", "toolkit"),
        Variant("toolkit-one-group", "modern", "toolkit", ("optimizer.bucket_mb=0",)),
        Variant("toolkit-buckets", "modern", "toolkit", ("optimizer.bucket_mb=25",)),
        Variant("toolkit-buckets-4", "modern", "toolkit", ("optimizer.bucket_mb=4",)),
        Variant("toolkit-buckets-1", "modern", "toolkit", ("optimizer.bucket_mb=1",)),
        # Every gradient in its bucket, through Horovod's fusion buffer (before alone_mb).
        Variant("toolkit-none-alone", "modern", "toolkit", ("optimizer.alone_mb=0",)),
        Variant(
            "toolkit-one-group-none-alone",
            "modern",
            "toolkit",
            ("optimizer.bucket_mb=0", "optimizer.alone_mb=0"),
        ),
        Variant("toolkit-fp16", "modern", "toolkit", ("optimizer.compression=fp16",)),
        Variant(
            "toolkit-fp16-one-group",
            "modern",
            "toolkit",
            ("optimizer.compression=fp16", "optimizer.bucket_mb=0"),
        ),
        Variant(
            "toolkit-fp16-buckets-4",
            "modern",
            "toolkit",
            ("optimizer.compression=fp16", "optimizer.bucket_mb=4"),
        ),
        Variant("toolkit-bf16", "modern", "toolkit", ("optimizer.compression=bf16",)),
        Variant(
            "toolkit-two-level", "modern", "toolkit", ("optimizer.reduction=two_level",), ("2x2",)
        ),
        # ZeRO stage 1: a reduce-scatter and an allgather in place of each allreduce.
        Variant("toolkit-sharded", "modern", "toolkit", ("optimizer.shard_state=true",)),
        Variant("keras3-per-tensor", "modern", "per_tensor"),
        Variant("toolkit-classic", "classic", "toolkit"),
        Variant("toolkit-classic-one-group", "classic", "toolkit", ("optimizer.bucket_mb=0",)),
        Variant("toolkit-classic-buckets-1", "classic", "toolkit", ("optimizer.bucket_mb=1",)),
        Variant("horovod-keras", "classic", "horovod_keras"),
        Variant("mwms", "classic", "mwms"),
    )
}
QUICK_VARIANTS = ("toolkit", "keras3-per-tensor")


def config_has(key: str) -> bool:
    """Whether this tree's config has the dotted `key`, and the value a variant gives it is
    allowed (a knob, or a choice of one, that another change may add)."""
    from hvd_train.core import config

    section, _, name = key.partition(".")
    section_class = getattr(config, f"{section.capitalize()}Config", None)
    return section_class is not None and name in {f.name for f in dataclasses.fields(section_class)}


def available(names: Sequence[str]) -> tuple[list[Variant], dict[str, str]]:
    """The variants that can run in this tree, and why each other one cannot."""
    from hvd_train.core import config

    runnable, skipped = [], {}
    for name in names:
        variant = VARIANTS[name]
        missing = [text for text in variant.overrides if not config_has(text.partition("=")[0])]
        if not missing:
            try:
                config.load(None, variant.overrides, log_notes=False)
            except config.ConfigError as err:
                missing = [str(err)]
        if missing:
            skipped[name] = f"this tree's config does not take {'; '.join(missing)}"
        else:
            runnable.append(variant)
    return runnable, skipped


# --- one rank of a job ---------------------------------------------------------------------------


def synthetic_batch(case: ModelCase, rank: int) -> tuple:
    """One batch of this rank's synthetic inputs (ids for token models) and labels."""
    import numpy as np

    rng = np.random.default_rng(rank)
    shape = (case.per_rank_batch_size, *case.input_shape)
    if case.tokens:
        x = rng.integers(0, case.tokens, shape).astype("int32")
    elif case.clicks:
        ids = (rng.zipf(1.05, (case.per_rank_batch_size, CLICK_FIELDS)) - 1) % case.clicks
        dense = rng.standard_normal((case.per_rank_batch_size, shape[1] - CLICK_FIELDS))
        x = np.concatenate([ids, dense], axis=1).astype("float32")
    else:
        x = rng.standard_normal(shape).astype("float32")
    return x, rng.integers(0, 10, (case.per_rank_batch_size,)).astype("int32")


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def _batch_timer(keras):
    """A Keras callback that records each training batch's seconds in `.times`. A batch ends
    when its update is done: the optimizer's step counter is read back (under asynchronous
    execution, which MultiWorkerMirroredStrategy's Keras 2 fit uses, the call returns earlier)."""

    class BatchTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.model.optimizer.iterations.numpy()
            self.times.append(time.perf_counter() - self.t0)

    return BatchTimer()


def _timed(fns: Sequence, steps: int, warmup: int, barrier) -> list[list[float]]:
    """Each of `fns` `warmup` times untimed, then `steps` rounds of one timed call of each in turn
    (a load that drifts falls on all alike); the ranks start together. Seconds, per function."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    barrier()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(steps):
        for fn, mine in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - t0)
    return times


def worker(
    case: ModelCase,
    variants: list[Variant],
    steps: int,
    warmup: int,
    compute: dict | None = None,
) -> dict:
    """Measure one model on this rank: compute alone, allreduce alone and each variant's step
    (collective: every rank of the job runs it). Returns rank 0's view with every rank's step.

    `compute`: forward_ms, backward_ms and ceiling_ms measured by an earlier job of the same
    layout and stack (compute alone does not depend on the link), taken instead of measuring."""
    from hvd_train import comm

    comm.init(threads=1)  # one compute thread per rank, as the hosts give each rank one CPU
    import keras  # Keras 3 on the modern stack, Keras 2 (tf.keras) on the classic one
    import numpy as np
    import tensorflow as tf

    import models
    from hvd_train.core import config as config_lib
    from hvd_train.keras import compat
    from hvd_train.keras.optimizer import bucket_layout
    from hvd_train.training import setup

    rank, size = comm.rank(), comm.size()
    link = comm.link_gbit()  # HVD_TRAIN_LINK_GBIT as the driver passed it
    x, y = synthetic_batch(case, rank)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    lr = 0.01

    def build():
        keras.utils.set_random_seed(0)
        return models.build(case.zoo, case.input_shape, 10, **case.params)

    def fit_step_ms(model, optimizer, callbacks=()) -> tuple[float, list[float]]:
        if optimizer is not None:  # None: compiled already (the toolkit's own compile)
            model.compile(optimizer, loss_fn, metrics=["accuracy"], jit_compile=False)
        timer = _batch_timer(keras)  # last: its time includes every other callback's work
        comm.barrier()
        model.fit(
            data, epochs=1, steps_per_epoch=warmup + steps, callbacks=[*callbacks, timer], verbose=0
        )
        timed = timer.times[warmup:]
        return _median_ms(timed), [1e3 * t for t in timed]

    # Compute alone, every rank at once (the job's confinement), no communication.
    started = time.perf_counter()
    model = build()
    xs, ys = tf.constant(x), tf.constant(y)

    @tf.function
    def forward():
        return loss_fn(ys, model(xs, training=True))

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = loss_fn(ys, model(xs, training=True))
        return tape.gradient(loss, model.trainable_variables)

    if compute is None:
        alone = [lambda: forward().numpy(), lambda: gradients()[-1].numpy()]
        forward_ms, grads_ms = map(_median_ms, _timed(alone, steps, warmup, comm.barrier))
        ceiling_ms, _ = fit_step_ms(model, keras.optimizers.SGD(lr, momentum=0.9))
        compute = {
            "forward_ms": forward_ms,
            "backward_ms": grads_ms - forward_ms,
            "ceiling_ms": ceiling_ms,
        }
    grad_shapes = [tuple(v.shape) for v in model.trainable_variables]
    grad_bytes = sum(int(np.prod(s)) * 4 for s in grad_shapes)

    # The allreduce alone: one grouped allreduce of tensors of the gradients' shapes.
    tensors = [tf.ones(s) for s in grad_shapes]

    @tf.function
    def reduce():
        return comm.grouped_allreduce(tensors, op=comm.Average)

    [allreduce_s] = _timed([lambda: reduce()[-1].numpy()], steps, warmup, comm.barrier)

    result = {
        "model": case.name,
        "alone_wall_s": time.perf_counter() - started,
        "stack": "classic" if compat.CLASSIC else "modern",
        "size": size,
        "params": model.count_params(),
        "gradient_MB": grad_bytes / 1e6,
        "gradient_tensors": len(grad_shapes),
        "gradient_bytes_per_tensor": [int(np.prod(shape)) * 4 for shape in grad_shapes],
        **compute,
        "allreduce_ms": _median_ms(allreduce_s),
        "variants": {},
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        # Horovod's loop: its cycle (the toolkit's Gloo rule sets it at init) and, on the
        # installer's build, its cycle while a tensor waits for the other ranks'.
        "horovod_cycle_time_ms": float(os.environ.get("HOROVOD_CYCLE_TIME", "1")),
        "pending_cycle_time_ms": comm.pending_cycle_time_ms(),
    }
    for variant in variants:
        started = time.perf_counter()
        model = build()
        callbacks: list = []
        if variant.kind == "toolkit":
            from hvd_train.callbacks import distributed_callbacks

            # As `hvd-train train` compiles: the config's optimizer knobs, a constant rate.
            cfg = config_lib.load(None, variant.overrides, log_notes=False)
            setup.compile_distributed(model, cfg, lr)
            optimizer = None
            callbacks = list(distributed_callbacks())
            # The buckets its optimizer sends, by the rule it applies (`core.buckets`).
            shapes = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
            chosen = bucket_layout(shapes, cfg.optimizer.bucket_mb, cfg.optimizer.alone_mb)
        elif variant.kind == "per_tensor":
            optimizer = _per_tensor_sgd(keras, lr)
        else:
            optimizer, callbacks = _horovod_keras(keras, lr)
        step_ms, times = fit_step_ms(model, optimizer, callbacks)
        steps_all = comm.allgather_object(step_ms)
        result["variants"][variant.name] = {
            "step_ms": step_ms,
            "step_ms_per_rank": steps_all,
            "times_ms": times,
            "overrides": list(variant.overrides),
            "kind": variant.kind,
            "wall_s": time.perf_counter() - started,
        }
        if variant.kind == "toolkit":
            result["variants"][variant.name] |= {"buckets": len(chosen), "link_gbit": link}
        if rank == 0:
            print(f"{case.name} {variant.name}: {step_ms:.1f} ms/step", flush=True)
    return result


def _per_tensor_sgd(keras, lr: float):
    """A bare Keras 3 SGD that averages each gradient with its own Horovod allreduce, as a user
    wrapping Keras 3 by hand would: each op can start as soon as its gradient exists."""
    # The peer measured here is Horovod's own per-tensor allreduce, so it imports Horovod directly
    # (already started by comm.init): a harness outside the package.
    import horovod.tensorflow as hvd

    class PerTensorSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            grads = [hvd.allreduce(g, op=hvd.Average) for g in grads]
            return super().apply(grads, trainable_variables)

    return PerTensorSGD(lr, momentum=0.9)


def _horovod_keras(keras, lr: float):
    """Horovod's own Keras recipe (classic stack): its DistributedOptimizer (per-tensor allreduce,
    fused by Horovod's cycle), the initial broadcast and the metric average."""
    # As in benchmarks/peers.py: the peer is Horovod's Keras integration itself.
    import horovod.tensorflow.keras as hvd

    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
    ]
    return optimizer, callbacks


COMPUTE_KEYS = ("forward_ms", "backward_ms", "ceiling_ms")


def job(
    model_names: list[str],
    variant_names: list[str],
    steps: int,
    warmup: int,
    out: Path,
    compute_from: Path | None = None,
) -> None:
    """Every rank: each model in turn; rank 0 writes the list of results to `out`.
    `compute_from`: an earlier job's results (same layout and stack) whose compute to take."""
    from hvd_train import comm

    runnable, skipped = available(variant_names)
    if skipped:
        raise ValueError(f"variants that cannot run in this tree: {skipped}")
    earlier = {}
    if compute_from is not None:
        for r in json.loads(compute_from.read_text()):
            earlier[r["model"]] = {k: r[k] for k in COMPUTE_KEYS}
    results = []
    for name in model_names:
        results.append(worker(MODELS[name], runnable, steps, warmup, earlier.get(name)))
        if comm.rank() == 0:  # after each model: what a failed job measured before is kept
            out.write_text(json.dumps(results, indent=1))
    comm.barrier()


MWMS_PORT = 29400  # worker i of a host listens on MWMS_PORT + i (its local rank)


def mwms_workers(hosts: str) -> list[str]:
    """TF_CONFIG's worker list for mpirun's ranks over `hosts` ("h1:2,h2:2"): Open MPI places
    ranks by slot, so rank r is the r-th slot, hosts in order."""
    workers = []
    for entry in hosts.split(","):
        host, _, slots = entry.partition(":")
        workers += [f"{host}:{MWMS_PORT + i}" for i in range(int(slots or 1))]
    return workers


def mwms_job(model_names: list[str], hosts: str, steps: int, warmup: int, out: Path) -> None:
    """Every process of a MultiWorkerMirroredStrategy job started by mpirun (which only starts
    them: TensorFlow's gRPC collectives do the rest); worker 0 writes each model's step to `out`."""
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    workers = mwms_workers(hosts)
    cluster = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
    os.environ["TF_CONFIG"] = json.dumps(cluster)
    import keras  # Keras 2 (tf.keras) on the classic stack
    import tensorflow as tf

    import models

    tf.config.threading.set_intra_op_parallelism_threads(1)  # as the Horovod jobs' ranks
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    results = []
    for name in model_names:
        case = MODELS[name]
        started = time.perf_counter()
        x, y = synthetic_batch(case, rank)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = models.build(case.zoo, case.input_shape, 10, **case.params)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            model.compile(keras.optimizers.SGD(0.01, momentum=0.9), loss, metrics=["accuracy"])
        data = strategy.distribute_datasets_from_function(
            lambda _, x=x, y=y: tf.data.Dataset.from_tensors((x, y)).repeat()
        )
        timer = _batch_timer(keras)
        model.fit(data, epochs=1, steps_per_epoch=warmup + steps, callbacks=[timer], verbose=0)
        timed = timer.times[warmup:]
        results.append(
            {
                "model": name,
                "step_ms": _median_ms(timed),
                "times_ms": [1e3 * t for t in timed],
                "wall_s": time.perf_counter() - started,
            }
        )
        if rank == 0:
            print(f"{name} mwms: {results[-1]['step_ms']:.1f} ms/step", flush=True)
            out.write_text(json.dumps(results, indent=1))


# --- the driver: the cluster at each rate, the jobs, the analysis ------------------------------


def _cluster(command: str, rate: str, timeout: float = 300) -> str:
    env = {**os.environ, "HOSTS": "2", "RATE": rate}
    done = subprocess.run(
        ["bash", str(CLUSTER), command], env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"cluster.sh {command} (RATE={rate}) failed:\n{done.stderr[-2000:]}")
    return done.stdout


def cluster_env(python: Path) -> dict[str, str]:
    """The environment of a launch on the cluster (`cluster.sh env`), with `python`'s venv first."""
    env = dict(os.environ)
    for line in _cluster("env", os.environ.get("RATE", "unlimited")).splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value.strip('"').replace("$PATH", env["PATH"])
    env["PATH"] = f"{python.parent}:{env['PATH']}"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _launch(
    python: Path,
    hosts: str,
    np: int,
    command: list[str],
    timeout: float,
    controller: str = "mpi",
    link_gbit: float | None = None,
) -> None:
    """`command` on `np` ranks over `hosts` under `controller`'s launcher, started on h1; the
    toolkit's own commands (selftest) through `hvd-train launch`, anything else through
    `python -m hvd_train.core.launch`. `link_gbit` reaches the ranks as HVD_TRAIN_LINK_GBIT,
    as `--launcher auto` passes the rate it measured."""
    launcher = (
        ["hvd_train.cli", "launch"] if command[0] == "selftest" else ["hvd_train.core.launch"]
    )
    argv = ["bash", str(CLUSTER), "exec", "h1", str(python), "-m", *launcher]
    argv += ["--np", str(np), "--hosts", hosts, "--launcher", CONTROLLERS[controller]]
    argv += ["--", *command]
    print("+ " + shlex.join(argv), flush=True)
    t0 = time.perf_counter()
    # The job's output goes straight through: its progress shows while it runs.
    env = cluster_env(python)
    # A job runs several models one after another, each with its own tensor names: Horovod's
    # response cache (1024 by default) would fill and evict while the last variants run, which
    # a user's job of one model never does.
    env.setdefault("HOROVOD_CACHE_CAPACITY", "4096")
    if link_gbit is not None:
        env[LINK_GBIT] = f"{link_gbit:.2f}"
    done = subprocess.run(argv, cwd=REPO, env=env, timeout=timeout, check=False)
    print(f"  ({time.perf_counter() - t0:.0f} s, exit {done.returncode})", flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"the launch failed (exit {done.returncode}; its output is above)")


def state_dir() -> Path:
    """The cluster's state directory (shared by every host)."""
    return Path(os.environ.get("STATE", "/run/hvd_train_cluster"))


def selftest(python: Path, layout: str) -> dict:
    """The selftest on the layout's ranks: the link between h1 and h2 (the slower direction's
    MB/s, the latency) and the rate at which its allreduce moved bytes across each host's link."""
    report = state_dir() / "shared" / "network-selftest.json"  # rank 0 writes it on h1
    hosts, np = LAYOUTS[layout]
    _launch(python, hosts, np, ["selftest", "--json", str(report)], 120)
    found = json.loads(report.read_text())
    link = found["links"][0]
    keys = ("mb_per_s", "a_to_b_mb_per_s", "b_to_a_mb_per_s", "latency_us")
    # What `--launcher auto` measures before a job (hvd_train.core.linkrate), from h1 to h2.
    probe = [str(python), "-m", "hvd_train.core.linkrate", "h2"]
    done = subprocess.run(
        ["bash", str(CLUSTER), "exec", "h1", *probe],
        cwd=REPO,
        env=cluster_env(python),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {k: link[k] for k in keys} | {
        "allreduce_mb_per_s": found["allreduce"]["mb_per_s"],
        "tcp_probe_gbit_s": json.loads(done.stdout)["gbit_s"],
    }


def _jobs(
    rate: str,
    link: dict,
    layout: str,
    stacks: dict[str, list[str]],
    model_names: Sequence[str],
    timing: list[str],
    first: dict[tuple[str, str, str], tuple[str, str]],
    controllers: Sequence[str] = ("mpi",),
) -> list[dict]:
    """The jobs of one layout at one rate, one per stack and controller (and
    MultiWorkerMirroredStrategy's); their rows. `first`, per layout, stack and controller: the
    rate whose job measured compute alone and its results (compute does not depend on the link:
    measured at the first rate, then taken; it does depend on the controller, whose background
    work shares the cores)."""
    hosts, np = LAYOUTS[layout]
    rows = []
    for stack, names in stacks.items():
        names = [name for name in names if layout in VARIANTS[name].layouts]
        horovod = [name for name in names if VARIANTS[name].kind != "mwms"]
        if not horovod:
            continue
        for controller in controllers:
            rows += _job(rate, link, layout, stack, horovod, model_names, timing, first, controller)
        if "mwms" in names and "mpi" in controllers:
            # Its own job (no Horovod, started by mpirun), beside the classic Horovod job's
            # ceiling under MPI.
            here = [row for row in rows if row["stack"] == stack and row["controller"] == "mpi"]
            out = state_dir() / "shared" / f"network-mwms-{layout}-{rate}.json"
            command = [str(STACKS[stack]), "-m", "benchmarks.network", "mwms-job"]
            command += ["--models", *model_names, "--hosts", hosts, *timing, "--out", str(out)]
            _launch(STACKS[stack], hosts, np, command, JOB_TIMEOUT_S)
            for row, mwms in zip(here, json.loads(out.read_text()), strict=True):
                row["variants"]["mwms"] = {**mwms, "overrides": [], "kind": "mwms"}
    return rows


def _job(
    rate: str,
    link: dict,
    layout: str,
    stack: str,
    names: list[str],
    model_names: Sequence[str],
    timing: list[str],
    first: dict[tuple[str, str, str], tuple[str, str]],
    controller: str,
) -> list[dict]:
    """One Horovod job: `names`' variants of one stack under one controller; its rows."""
    hosts, np = LAYOUTS[layout]
    key = (layout, stack, controller)
    out = state_dir() / "shared" / f"network-{stack}-{controller}-{layout}-{rate}.json"
    command = [str(STACKS[stack]), "-m", "benchmarks.network", "job", "--models", *model_names]
    command += ["--variants", *names, *timing, "--out", str(out)]
    if key in first:
        earlier = out.with_name(f"network-compute-{stack}-{controller}-{layout}.json")
        earlier.write_text(first[key][1])
        command += ["--compute-from", str(earlier)]
    # The toolkit's buckets follow the link as under `--launcher auto`, from its probe's reading.
    ranks_link = link["tcp_probe_gbit_s"]
    _launch(STACKS[stack], hosts, np, command, JOB_TIMEOUT_S, controller, ranks_link)
    first.setdefault(key, (rate, out.read_text()))
    return [
        {"rate": rate, "link": link, "layout": layout, "controller": controller}
        | {"compute_rate": first[key][0], "ranks_link_gbit": round(ranks_link, 2)}
        | result
        for result in json.loads(out.read_text())
    ]


def measure(
    rates: Sequence[str],
    model_names: Sequence[str],
    variant_names: Sequence[str],
    layouts: Sequence[str],
    steps: int,
    warmup: int,
    partial: Path | None = None,
    controllers: Sequence[str] = ("mpi",),
) -> dict:
    """Bring the cluster up at each rate in turn (always down again) and run every job, under
    each of `controllers`; after each rate and layout the rows so far go to `partial` (what a
    failed run measured is kept)."""
    variants, skipped = available(variant_names)
    stacks = {stack: [v.name for v in variants if v.stack == stack] for stack in STACKS}
    timing = ["--steps", str(steps), "--warmup", str(warmup)]
    result = {
        "bench": "network",
        "rates": list(rates),
        "layouts": list(layouts),
        "controllers": list(controllers),
        "models": {name: dataclasses.asdict(MODELS[name]) for name in model_names},
        "variants": {v.name: dataclasses.asdict(v) for v in variants},
        "skipped_variants": skipped,
        "steps": steps,
        "warmup": warmup,
        "host_cpus": os.cpu_count(),
        "rows": [],
    }
    first: dict[tuple[str, str], tuple[str, str]] = {}
    for rate in rates:
        _cluster("down", rate)  # one left by a killed run
        _cluster("up", rate)
        try:
            for layout in layouts:
                link = selftest(STACKS["modern"], layout)
                print(
                    f"{rate} {layout}: link {link['mb_per_s']:.1f} MB/s, "
                    f"{link['latency_us']:.0f} us; allreduce {link['allreduce_mb_per_s']:.1f} "
                    f"MB/s; auto's TCP probe {link['tcp_probe_gbit_s']:.2f} Gbit/s",
                    flush=True,
                )
                result["rows"] += _jobs(
                    rate, link, layout, stacks, model_names, timing, first, controllers
                )
                if partial is not None:
                    partial.write_text(json.dumps(result, indent=1))
        finally:
            _cluster("down", rate)
    return result


def plan_inputs(row: dict, variant: Variant) -> dict:
    """What `plan.cluster_step` needs to know of one variant on one job: the bytes on the wire, in
    how many collectives they go out, the last one's bytes where they overlap the backward pass
    (None: one group after it) and the reduction. The toolkit's buckets are its own layout
    (`hvd_train.core.buckets`, the default size derived for the job's hosts); Horovod's
    per-tensor allreduce fuses what is ready each cycle, up to its 64 MiB fusion buffer, the
    first layer's gradient (made last) going out last; MultiWorkerMirroredStrategy reduces once
    the backward pass is done."""
    import math

    from hvd_train.core import buckets

    sizes = row["gradient_bytes_per_tensor"]
    total = sum(sizes)
    compression = variant.setting("optimizer.compression", "none")
    wire = 0.5 if compression in ("fp16", "bf16") else 1.0
    hosts, slots = 2, LAYOUTS[row["layout"]][1] // 2
    mode = variant.setting("optimizer.reduction", _default("reduction"))
    reduction = _reduction_rule(mode, [slots] * hosts)
    # The cluster's hosts have one CPU each, which one rank's compute fills and two oversubscribe:
    # no core is spare.
    spare = False
    if variant.kind == "mwms":  # Keras 2 reduces the gradients in apply_gradients, packed
        return {
            "wire_bytes": total,
            "buffers": 1,
            "last_bytes": None,
            "reduction": "flat",
            "spare_cpu": spare,
        }
    if variant.kind != "toolkit":
        buffers = max(1, math.ceil(total / (64 * buckets.MIB)))
        return {
            "wire_bytes": total,
            "buffers": buffers,
            "last_bytes": sizes[0],
            "reduction": "flat",
            "spare_cpu": spare,
        }
    bucket_mb = variant.setting("optimizer.bucket_mb", _default("bucket_mb"))
    chosen = None if bucket_mb in ("null", "~", "") else float(bucket_mb)
    size = buckets.bucket_bytes(
        total,
        hosts,
        chosen,
        spare_cpu=spare,
        oversubscribed=slots > 1,
        gloo=controller(row) == "gloo",
        # Rows from before the ranks were told the link's rate ran with it unknown.
        link_gbit=row.get("ranks_link_gbit"),
    )
    alone_mb = variant.setting("optimizer.alone_mb", _default("alone_mb"))
    alone = buckets.alone_bytes(
        None if alone_mb in ("null", "~", "") else float(alone_mb),
        hosts,
        gloo=controller(row) == "gloo",
        link_gbit=row.get("ranks_link_gbit"),
    )
    layout = buckets.layout(sizes, size, alone)
    # What waits for the backward pass's end: the bucket of the gradient made last (the first
    # layer's) and every one sent after it.
    tail = next(k for k, bucket in enumerate(layout) if 0 in bucket)
    last = sum(sizes[i] for b in layout[tail:] for i in b) * wire if tail > 0 else None
    return {
        "wire_bytes": total * wire,
        "buffers": len(layout),
        "last_bytes": last,
        "reduction": reduction,
        "spare_cpu": spare,
    }


def _default(key: str) -> str:
    """The toolkit's default of optimizer.`key`, as a --set string would spell it."""
    from hvd_train.core import config

    value = getattr(config.OptimizerConfig(), key, None)
    return "null" if value is None else str(value)


def _reduction_rule(mode: str, local_sizes: list[int]) -> str:
    """The toolkit's rule (`hvd_train.comm.reduction.reduction_rule`) for fixed workers, where
    comm.init starts Horovod with dynamic process sets across hosts."""
    from hvd_train.comm.reduction import reduction_rule

    return reduction_rule(mode, local_sizes, elastic=False, dynamic_process_sets=True)


def analyse(result: dict) -> dict:
    """Add each variant's hidden part of the allreduce, the plan's prediction and its residual
    (measured / predicted - 1), in place; returns `result`."""
    from hvd_train.bench import plan

    for row in result["rows"]:
        slots = LAYOUTS[row["layout"]][1] // 2
        compute = plan.Compute(
            row["forward_ms"] / 1e3, row["backward_ms"] / 1e3, row["ceiling_ms"] / 1e3
        )
        measured = row["link"]
        link = plan.Link(
            measured["mb_per_s"], measured["latency_us"], measured.get("allreduce_mb_per_s")
        )
        for name, v in row["variants"].items():
            v["hidden"] = (row["ceiling_ms"] + row["allreduce_ms"] - v["step_ms"]) / row[
                "allreduce_ms"
            ]
            v["efficiency"] = row["ceiling_ms"] / v["step_ms"]
            inputs = plan_inputs(row, Variant(**result["variants"][name]))
            predicted = plan.cluster_step(
                compute,
                link,
                inputs["wire_bytes"],
                2,
                slots,
                buffers=inputs["buffers"],
                last_bytes=inputs["last_bytes"],
                reduction=inputs["reduction"],
                spare_cpu=inputs["spare_cpu"],
            )
            v["plan_inputs"] = inputs
            v["predicted_step_ms"] = 1e3 * predicted["step"]
            v["predicted_comm_ms"] = 1e3 * predicted["comm"]
            v["predicted_hidden"] = predicted["hidden"]
            v["residual"] = v["step_ms"] / v["predicted_step_ms"] - 1
    residuals = [abs(v["residual"]) for row in result["rows"] for v in row["variants"].values()]
    result["residuals"] = {
        "points": len(residuals),
        "median_abs": statistics.median(residuals) if residuals else None,
        "max_abs": max(residuals) if residuals else None,
        "within_10pct": sum(r <= 0.10 for r in residuals),
    }
    return result


# --- figures -----------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(result: dict, plt, title: str) -> tuple[object, list[tuple[object, str, list[dict]]]]:
    """One panel per layout (rows) and model (columns): the figure and (axes, title, rows)."""
    models, layouts = list(result["models"]), result["layouts"]
    fig, axes = plt.subplots(
        len(layouts),
        len(models),
        figsize=(max(7.0, 3.6 * len(models) + 1), 3.0 * len(layouts) + 0.8),
        layout="constrained",
        squeeze=False,
    )
    fig.suptitle(title, fontsize=9)
    panels = []
    for i, layout in enumerate(layouts):
        for j, model in enumerate(models):
            rows = [r for r in result["rows"] if r["layout"] == layout and r["model"] == model]
            rows.sort(key=lambda r: r["link"]["mb_per_s"])
            panels.append(
                (axes[i][j], f"{model}, 2 hosts x {LAYOUTS[layout][1] // 2} slot(s)", rows)
            )
    return fig, panels


def controller(row: dict) -> str:
    """The row's Horovod controller (results before the controller choice ran under MPI)."""
    return row.get("controller", "mpi")


def _rows_by_job(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows by stack and controller, labelled "modern" or "modern, gloo" (MPI unnamed)."""
    by: dict[str, list[dict]] = {}
    for row in rows:
        label = row["stack"] + ("" if controller(row) == "mpi" else f", {controller(row)}")
        by.setdefault(label, []).append(row)
    return by


def plot(result: dict, out: Path, name: str = "network") -> list[Path]:
    """<name>.png (step time against the delivered link rate, per variant, the plan dotted),
    <name>-hidden.png (the allreduce's hidden part) and <name>-predicted.png; returns them."""
    plt = _pyplot()
    pngs = []
    for suffix, what in (("", "step"), ("-hidden", "hidden")):
        title = (
            "median step (ms) against the link rate selftest measured\n"
            "dotted crosses: hvd-train plan"
            if what == "step"
            else "hidden part of the allreduce\n"
            "(ceiling + allreduce alone - step) / allreduce alone"
        )
        fig, panels = _grid(result, plt, title)
        for ax, label, rows in panels:
            for job, stack_rows in _rows_by_job(rows).items():
                gloo = controller(stack_rows[0]) == "gloo"
                x = [r["link"]["mb_per_s"] for r in stack_rows]
                if what == "step":
                    ax.plot(
                        x,
                        [r["ceiling_ms"] for r in stack_rows],
                        "k--",
                        marker="_",
                        lw=0.8,
                        label=f"ceiling ({job})",
                    )
                for variant in stack_rows[0]["variants"]:
                    color = f"C{list(result['variants']).index(variant) % 10}"
                    # Gloo's lines: the variant's colour, dashed, with triangles.
                    ls, mark = ("--", "^") if gloo else ("-", "o")
                    legend = f"{variant} (gloo)" if gloo else variant
                    if what == "step":
                        y = [r["variants"][variant]["step_ms"] for r in stack_rows]
                        p = [r["variants"][variant]["predicted_step_ms"] for r in stack_rows]
                        ax.plot(x, y, ls=ls, marker=mark, color=color, label=legend)
                        ax.plot(x, p, ls=":", marker="x", color=color)
                    else:
                        y = [r["variants"][variant]["hidden"] for r in stack_rows]
                        ax.plot(x, y, ls=ls, marker=mark, color=color, label=legend)
            ax.set_xscale("log")
            # Ticks at the measured rates only: log minor labels collide over a short span.
            rates = sorted({r["link"]["mb_per_s"] for r in rows})
            ax.set_xticks(rates, [f"{rate:.0f}" for rate in rates])
            ax.minorticks_off()
            ax.set(title=label, xlabel="link (MB/s, selftest)")
            ax.title.set_fontsize(8)
            ax.grid(alpha=0.3, which="both")
            if what == "hidden":
                ax.axhline(0, color="gray", lw=0.8)
            ax.legend(fontsize=6)
        png = out / f"{name}{suffix}.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        pngs.append(png)
    fig, ax = plt.subplots(figsize=(5.5, 5), layout="constrained")
    for row in result["rows"]:
        for variant, v in row["variants"].items():
            color = f"C{list(result['variants']).index(variant) % 10}"
            ax.scatter(
                v["predicted_step_ms"],
                v["step_ms"],
                color=color,
                s=14,
                marker="o" if row["layout"] == "2x1" else "s",
            )
    for variant in result["variants"]:
        ax.scatter([], [], color=f"C{list(result['variants']).index(variant) % 10}", label=variant)
    points = [v["step_ms"] for row in result["rows"] for v in row["variants"].values()]
    points += [v["predicted_step_ms"] for row in result["rows"] for v in row["variants"].values()]
    lo, hi = min(points) / 1.3, max(points) * 1.3
    line = [lo * (hi / lo) ** (k / 9) for k in range(10)]
    ax.plot(line, line, "k-", lw=0.8)
    ax.fill_between(
        line,
        [0.9 * v for v in line],
        [1.1 * v for v in line],
        color="gray",
        alpha=0.2,
        label="within 10%",
    )
    res = result["residuals"]
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="predicted step (ms): hvd-train plan from selftest + compute alone",
        ylabel="measured step (ms)",
        title=f"{res['within_10pct']} of {res['points']} points within 10% "
        f"(median |residual| {100 * res['median_abs']:.0f}%); circles 2x1, squares 2x2",
    )
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    png = out / f"{name}-predicted.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [*pngs, png]


def table(result: dict) -> str:
    """The results as a Markdown table (docs/network.md): one line per job, model and variant."""
    lines = [
        "| rate (selftest MB/s) | hosts x slots | controller | model (grad MB) | variant | step ms "
        "| ceiling ms | allreduce alone ms | hidden | plan ms | residual |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for name, v in row["variants"].items():
            lines.append(
                f"| {row['rate']} ({row['link']['mb_per_s']:.0f}) | {row['layout']} "
                f"| {controller(row)} | {row['model']} ({row['gradient_MB']:.1f}) | {name} "
                f"| {v['step_ms']:.0f} "
                f"| {row['ceiling_ms']:.0f} | {row['allreduce_ms']:.0f} | {v['hidden']:.2f} "
                f"| {v['predicted_step_ms']:.0f} | {100 * v['residual']:+.0f}% |"
            )
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.network",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the whole benchmark (root, holding the cluster lock)")
    r.add_argument("--rates", nargs="+", default=list(RATES), help="tc rates [%(default)s]")
    r.add_argument("--models", nargs="+", choices=list(MODELS), help="[all but the dlrm ones]")
    r.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="[all available]")
    r.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    r.add_argument(
        "--controllers",
        nargs="+",
        choices=list(CONTROLLERS),
        default=["mpi"],
        help="Horovod's controller, one job each (mpi: mpirun; gloo: horovodrun --gloo) [mpi]",
    )
    r.add_argument("--steps", type=int, default=5, help="timed steps [5]")
    r.add_argument("--warmup", type=int, default=1, help="untimed steps first (tracing) [1]")
    r.add_argument("--quick", action="store_true", help="1 rate, resnet20, 2 variants, 2x1")
    r.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    r.add_argument("--name", help="result file name [network; --quick: network-quick]")
    j = sub.add_parser("job", help="one job's ranks (under a launcher, on the cluster)")
    j.add_argument("--models", nargs="+", choices=list(MODELS), required=True)
    j.add_argument("--variants", nargs="+", choices=list(VARIANTS), required=True)
    j.add_argument("--steps", type=int, required=True)
    j.add_argument("--warmup", type=int, required=True)
    j.add_argument("--out", type=Path, required=True)
    j.add_argument("--compute-from", type=Path, help="an earlier job's results: take its compute")
    m = sub.add_parser("mwms-job", help="one MultiWorkerMirroredStrategy job's processes")
    m.add_argument("--models", nargs="+", choices=list(MODELS), required=True)
    m.add_argument("--hosts", required=True, help="the launch's host:slots list")
    m.add_argument("--steps", type=int, required=True)
    m.add_argument("--warmup", type=int, required=True)
    m.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("plot", help="the figures (and the plan's residuals) of a result file")
    p.add_argument("json", type=Path)
    t = sub.add_parser("table", help="a result file as a Markdown table")
    t.add_argument("json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "job":
        job(args.models, args.variants, args.steps, args.warmup, args.out, args.compute_from)
        return 0
    if args.command == "mwms-job":
        mwms_job(args.models, args.hosts, args.steps, args.warmup, args.out)
        return 0
    if args.command == "table":
        print(table(analyse(json.loads(args.json.read_text()))))
        return 0
    if args.command == "plot":
        result = analyse(json.loads(args.json.read_text()))
        args.json.write_text(json.dumps(result, indent=1))
        plot(result, args.json.parent, args.json.stem)
        return 0
    if args.quick:
        rates, models = args.rates[-1:], args.models or ["resnet20"]
        variants, layouts = args.variants or list(QUICK_VARIANTS), args.layouts[:1]
        steps, warmup = min(args.steps, 4), 1
    else:
        rates, models = args.rates, args.models or [n for n, m in MODELS.items() if not m.clicks]
        variants, layouts, steps, warmup = (
            args.variants or list(VARIANTS),
            args.layouts,
            args.steps,
            args.warmup,
        )
    # A timeout's SIGTERM unwinds through `measure`, which then takes the cluster down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    name = args.name or ("network-quick" if args.quick else "network")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{name}.json"
    partial = args.out / f"{name}.partial.json"
    t0 = time.perf_counter()
    controllers = list(dict.fromkeys(args.controllers))
    result = analyse(measure(rates, models, variants, layouts, steps, warmup, partial, controllers))
    result["seconds"] = time.perf_counter() - t0
    partial.unlink(missing_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    for png in plot(result, args.out, name):
        print(f"wrote {png}")
    print(f"wrote {json_path} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
