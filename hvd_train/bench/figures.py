"""The figures of the instruments `hvd-train bench allreduce|scaling|controllers` and `hvd-train
plan`: each result's PNG, written next to its JSON. matplotlib (Agg) is imported only here, when a
figure is drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def allreduce(result: dict, png: Path) -> None:
    """Bus bandwidth against message size, one line per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for method in dict.fromkeys(r["method"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["method"] == method]
        label = "memcpy (copy GB/s, one process)" if method == "memcpy" else method
        ax.plot([r["MiB"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="message (MiB)",
        ylabel="bus bandwidth (GB/s)",
        title=f"allreduce, {result['np']} ranks on one host",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def scaling(result: dict, png: Path) -> None:
    """Throughput against workers beside the ceiling; each rank's step breakdown."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    nps = [r["np"] for r in result["rows"]]
    left.plot(
        nps,
        [r["toolkit_median"] for r in result["rows"]],
        marker="o",
        label="hvd_train (Horovod allreduce)",
    )
    left.plot(
        nps,
        [r["ceiling_median"] for r in result["rows"]],
        marker="s",
        label="ceiling: independent runs, no communication",
    )
    left.plot(
        nps,
        [n * result["rows"][0]["toolkit_median"] for n in nps],
        ls="--",
        c="gray",
        label="linear from 1 worker",
    )
    left.set(
        xlabel="workers",
        ylabel="samples/s (all workers)",
        xticks=nps,
        title=f"{result['model']}, batch {result['per_rank_batch_size']} per worker",
    )
    left.grid(alpha=0.3)
    left.legend()
    labels, bars = [], []
    for b in result["breakdowns"]:
        for r, phases in enumerate(b["median_ms_per_rank"]):
            tag = f"rank {r}" + (
                f"\n(+{b['delay_ms']:.0f} ms on rank {b['straggler_rank']})"
                if b["straggler_rank"] is not None
                else ""
            )
            labels.append(tag)
            bars.append(phases)
    bottoms = np.zeros(len(bars))
    for phase in ("compute", "straggle", "wait", "allreduce", "apply"):
        values = np.array([b[phase] for b in bars])
        right.bar(range(len(bars)), values, bottom=bottoms, label=phase)
        bottoms += values
    right.set_xticks(range(len(bars)), labels, fontsize=8)
    right.set(ylabel="ms per step (median)", title="where a step's time goes")
    right.legend()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def controllers(result: dict, png: Path) -> None:
    """Each controller's step breakdown and CPU per thread group, per rank."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    labels, rows = [], []
    for name, row in result["summary"].items():
        two_lines = name.replace(", ", "\n")
        for r, v in enumerate(row["per_rank"]):
            labels.append(f"{two_lines}\nrank {r}")
            rows.append(v)
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for phase in ("compute", "wait", "allreduce", "apply"):
        values = np.array([v[phase] for v in rows])
        left.bar(x, values, bottom=bottom, label=phase)
        bottom += values
    left.set_xticks(x, labels, fontsize=7)
    left.set(ylabel="ms per step (median)", title="where a step's time goes, by controller")
    left.legend()
    bottom = np.zeros(len(rows))
    for group in ("compute", "main", "other"):
        values = np.array([v[f"{group}_cores"] for v in rows])
        right.bar(x, values, bottom=bottom, label=f"{group} threads")
        bottom += values
    for i, v in enumerate(rows):
        right.annotate(
            f"{v['compute_preemptions_per_s']:.0f}/s",
            (i, bottom[i]),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    right.set_xticks(x, labels, fontsize=7)
    right.set(
        ylabel="cores used (1 = one core)",
        title="CPU per thread group; compute threads preempted per s",
    )
    right.legend(fontsize=8)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plan(result: dict, png: Path) -> None:
    """Predicted efficiency bands against workers; the published figures as stars."""
    workers, predictions = result["workers"], result["predictions"]
    comparison = result["published_comparison"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    shown = [f"{p['hardware']}/{p['workload']}" for p in comparison]
    shown.append("v100-nvlink-100gb-ib/resnet50-v100")  # a current cluster, no published figure
    for i, key in enumerate(shown):
        rows, color = predictions[key], f"C{i}"
        ax.fill_between(
            workers,
            [r["efficiency_no_overlap"] for r in rows],
            [r["efficiency_full_overlap"] for r in rows],
            color=color,
            alpha=0.2,
        )
        ax.plot(workers, [r["efficiency_no_overlap"] for r in rows], color=color, label=key)
        for pub in comparison:
            if f"{pub['hardware']}/{pub['workload']}" == key:
                ax.scatter(
                    [pub["workers"]],
                    [pub["efficiency"]],
                    color=color,
                    marker="*",
                    s=120,
                    edgecolor="black",
                    zorder=3,
                )
    ax.set(
        xscale="log",
        xlabel="workers",
        ylabel="scaling efficiency",
        title="predicted (band: no overlap .. full overlap), published (stars)",
    )
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(png, dpi=110)
    plt.close(fig)
