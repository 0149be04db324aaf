"""PNG figures next to the JSON results (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

from hvd_train.core import inject


def training_curves(metrics_json: Path, png: Path) -> Path:
    """Plot loss and accuracy per epoch (train and validation) and the learning rate, from a run's
    metrics.json; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = json.loads(Path(metrics_json).read_text())
    epochs = [r["epoch"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), layout="constrained")
    for ax, name in zip(axes[:2], ("loss", "accuracy"), strict=True):
        for key, label in ((name, "train (all ranks)"), (f"val_{name}", "validation")):
            if all(key in r for r in records):
                ax.plot(epochs, [r[key] for r in records], marker="o", ms=3, label=label)
        ax.set(title=name, xlabel="epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[2].plot(epochs, [r["learning_rate"] for r in records], marker="o", ms=3)
    axes[2].set(title="learning rate at epoch end", xlabel="epoch")
    axes[2].grid(alpha=0.3)
    inject.fail_point("metrics.png", png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
