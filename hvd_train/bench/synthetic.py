"""Training throughput on synthetic data, by the method of Horovod's synthetic benchmark.

Any registered model, one synthetic batch per rank kept in memory (no input cost), the toolkit's
DistributedOptimizer and callbacks in Keras `fit()`: `warmup_batches` untimed, then `iters`
timed iterations of `batches_per_iter` batches. Rank 0 prints Horovod's summary lines word for word,
which cluster regression checks parse:
    Img/sec per CPU: 84.1 +-1.2
    Total img/sec on 2 CPU(s): 168.2 +-2.4
(GPU instead of CPU where GPUs are used; +- is 1.96 standard deviations of the per-iteration rate.)

    mpirun -np 2 python -m hvd_train.bench.synthetic --model resnet20 --shape 32 32 3 --out r.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hvd_train.bench.stats import summary


def run(
    model_name: str,
    shape: tuple[int, ...],
    num_classes: int,
    per_rank_batch_size: int,
    warmup_batches: int,
    batches_per_iter: int,
    iters: int,
    threads: int | None = None,
    start_at: float | None = None,
) -> dict:
    """Measure; returns the result on every rank (rank 0 prints Horovod's lines)."""
    from hvd_train import comm
    from hvd_train.keras.optimizer import DistributedOptimizer

    comm.init(threads=threads)
    import keras
    import numpy as np
    import tensorflow as tf

    import models
    from hvd_train.callbacks import distributed_callbacks

    rank, size = comm.rank(), comm.size()
    rng = np.random.default_rng(rank)
    if len(shape) == 1:  # token ids for the text model
        x = rng.integers(0, 1000, (per_rank_batch_size, *shape)).astype("int32")
    else:
        x = rng.standard_normal((per_rank_batch_size, *shape)).astype("float32")
    y = rng.integers(0, num_classes, (per_rank_batch_size,)).astype("int32")
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    model = models.build(model_name, shape, num_classes)
    model.compile(
        optimizer=DistributedOptimizer(keras.optimizers.SGD(0.01 * size, momentum=0.9)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callbacks = distributed_callbacks()[:1]  # broadcast only: no metrics to reduce here
    model.fit(data, steps_per_epoch=warmup_batches, epochs=1, callbacks=callbacks, verbose=0)

    if start_at is not None:
        # Independent processes (the no-communication ceiling) start their timed part together.
        time.sleep(max(0.0, start_at - time.time()))
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(data, steps_per_epoch=batches_per_iter, epochs=iters, callbacks=[Timer()], verbose=0)
    rates = [per_rank_batch_size * batches_per_iter / t for t in times]
    stats = summary(rates)
    device = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    if rank == 0:
        print(f"Model: {model_name}")
        print(f"Batch size: {per_rank_batch_size}")
        print(f"Number of {device}s: {size}")
        for i, rate in enumerate(rates):
            print(f"Iter #{i}: {rate:.1f} img/sec per {device}")
        print(f"Img/sec per {device}: {stats['mean']:.1f} +-{stats['ci95']:.1f}")
        print(
            f"Total img/sec on {size} {device}(s): {size * stats['mean']:.1f} "
            f"+-{size * stats['ci95']:.1f}",
            flush=True,
        )
    return {
        "bench": "synthetic",
        "model": model_name,
        "params": model.count_params(),
        "np": size,
        "device": device,
        "threads": comm.compute_threads(),
        "per_rank_batch_size": per_rank_batch_size,
        "img_per_sec_per_worker": stats["mean"],
        "img_per_sec_ci95": stats["ci95"],
        "img_per_sec_total": size * stats["mean"],
        "step_ms_median": 1e3 * summary(times)["median"] / batches_per_iter,
        "rates": rates,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_train.bench.synthetic")
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--shape", type=int, nargs="+", default=[32, 32, 3])
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=10)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--threads", type=int, help="compute threads per rank [derived]")
    parser.add_argument("--start-at", type=float, help="wall-clock time to start timing at")
    parser.add_argument("--out", type=Path, help="rank 0 writes the JSON result here")
    args = parser.parse_args(argv)
    result = run(
        args.model,
        tuple(args.shape),
        args.num_classes,
        args.batch_size,
        args.num_warmup_batches,
        args.num_batches_per_iter,
        args.num_iters,
        args.threads,
        args.start_at,
    )
    from hvd_train import comm

    if args.out and comm.is_chief():
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
