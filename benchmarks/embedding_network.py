"""A table split by rows against the same model data parallel, across the cluster's hosts.

The click model (`models/recommender.py`, 8 Zipf-skewed id fields and 4 dense features, 256 rows
per rank) with a 1,000,000 x 32 table (128 MB), in two variants of the same model:

  dlrm-split  the table split by rows over the ranks (`hvd_train.ShardedEmbedding`): two
              alltoalls per lookup, its gradient never allreduced
  dlrm-dp     Keras's Embedding, whole on every rank: its gradient densified into the allreduce

Each trains with the toolkit's DistributedOptimizer on the cluster (2 hosts, one CPU each; the
jobs of `benchmarks.network`) at 2 hosts x 1 slot and 2 hosts x 2 slots, at each link rate, with
the rate the link delivered (`hvd-train selftest`) beside the rate asked of `tc`. The figures are
the median step of rank 0 and the no-communication ceiling, one process's plain Keras step on
each rank at once. The split model's ceiling still runs its alltoalls (its forward pass is
them), so its ceiling is not communication-free.

    python -m benchmarks.embedding_network [--rates unlimited 1gbit] [--layouts 2x1 2x2]

It needs root (the cluster) and must hold the machine's cluster lock: `benchmarks/run.sh
embedding-network` takes it. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from benchmarks import network

MODELS = ("dlrm-split", "dlrm-dp")


def summary(result: dict) -> list[dict]:
    """One row per rate, layout and model: the step, the ceiling, the link."""
    return [
        {
            "rate": row["rate"],
            "link_MB_per_s": row["link"]["mb_per_s"],
            "layout": row["layout"],
            "model": row["model"],
            "step_ms": row["variants"]["toolkit"]["step_ms"],
            "step_ms_per_rank": row["variants"]["toolkit"]["step_ms_per_rank"],
            "ceiling_ms": row["ceiling_ms"],
            "params": row["params"],
        }
        for row in result["rows"]
    ]


def plot(rows: list[dict], out: Path) -> Path:
    """Step time against the link's delivered rate, per layout, split against data parallel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    layouts = sorted({r["layout"] for r in rows})
    fig, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 4), squeeze=False)
    for ax, layout in zip(axes[0], layouts, strict=True):
        rates: list[float] = []
        for model, style, color in zip(MODELS, ("o-", "s--"), ("C0", "C3"), strict=True):
            mine = sorted(
                (r for r in rows if r["layout"] == layout and r["model"] == model),
                key=lambda r: r["link_MB_per_s"],
            )
            rates = [r["link_MB_per_s"] for r in mine]
            steps, ceilings = [r["step_ms"] for r in mine], [r["ceiling_ms"] for r in mine]
            ax.plot(rates, steps, style, color=color, label=f"{model} step")
            ax.plot(rates, ceilings, ":", color=color, alpha=0.6, label=f"{model} ceiling")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(rates, [f"{rate:.0f}" for rate in rates])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("link rate delivered (MB/s, selftest)")
        ax.set_ylabel("median step (ms)")
        ax.set_title(f"{layout} (hosts x slots), 1M x 32 table")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = out / "embedding-network.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.embedding_network",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rates", nargs="+", default=["unlimited", "1gbit"])
    parser.add_argument(
        "--layouts", nargs="+", choices=list(network.LAYOUTS), default=["2x1", "2x2"]
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps [5]")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first [2]")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    # A timeout's SIGTERM unwinds through `measure`, which then takes the cluster down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "embedding-network.partial.json"
    t0 = time.perf_counter()
    result = network.measure(
        args.rates, MODELS, ["toolkit"], args.layouts, args.steps, args.warmup, partial
    )
    rows = summary(result)
    record = {
        "bench": "embedding-network",
        "rates": args.rates,
        "layouts": args.layouts,
        "steps": args.steps,
        "warmup": args.warmup,
        "models": {name: result["models"][name] for name in MODELS},
        "rows": rows,
        "jobs": result["rows"],
        "seconds": time.perf_counter() - t0,
    }
    partial.unlink(missing_ok=True)
    json_path = args.out / "embedding-network.json"
    json_path.write_text(json.dumps(record, indent=1))
    print("| rate (MB/s) | hosts x slots | model | step ms | ceiling ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rate']} ({r['link_MB_per_s']:.0f}) | {r['layout']} | {r['model']} "
            f"| {r['step_ms']:.0f} | {r['ceiling_ms']:.0f} |"
        )
    print(f"wrote {plot(rows, args.out)}")
    print(f"wrote {json_path} ({record['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
