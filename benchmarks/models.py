"""The model table of the README: parameters, samples/s per worker at 1 and N workers (synthetic
data, the toolkit's fit path), and accuracy on digits and on a CIFAR-sized synthetic task.

    .venv/bin/python benchmarks/models.py [--np 2] [--out benchmarks/results]
Prints the table as Markdown and writes models.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from hvd_train.bench import runner
from hvd_train.core import processes

REPO = Path(__file__).resolve().parents[1]
# name -> input shape (token models take sequences of ids)
MODELS = {
    "mlp": [64],
    "cnn": [32, 32, 3],
    "resnet20": [32, 32, 3],
    "resnet56": [32, 32, 3],
    "mobilenetv2": [32, 32, 3],
    "efficientnetb0": [32, 32, 3],
    "resnet50": [32, 32, 3],
    "transformer": [64],
}
TASKS = {"digits": "configs/digits.yaml", "synthetic 32x32x3": "configs/synthetic.yaml"}


def accuracy(config: str, np: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            sys.executable,
            "-m",
            "hvd_train.cli",
            "launch",
            "--np",
            str(np),
            "--",
            "train",
            "--config",
            config,
            "--set",
            f"run_dir={tmp}/run",
            "--set",
            "logging.tensorboard=false",
        ]
        done = processes.run(
            argv, processes.child_env(), runner.TIMEOUT_S, cwd=REPO, capture="separate"
        )
        found = re.findall(r"result (\{.*\})", done.output)
        if not done.ok or not found:
            raise RuntimeError(
                f"training {config} failed ({done.outcome(runner.TIMEOUT_S)}):\n"
                f"{done.errors[-2000:]}"
            )
        return json.loads(found[-1])["final"]["accuracy"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    rows = []
    for name, shape in MODELS.items():
        row = {"model": name, "input": shape}
        for np in (1, args.np):
            result = runner.synthetic(np, name, shape, args.batch_size, 3, 5, 3, None, echo=False)
            row["params"] = result["params"]
            row[f"per_worker_np{np}"] = result["img_per_sec_per_worker"]
            row[f"ci95_np{np}"] = result["img_per_sec_ci95"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    tasks = {task: accuracy(config, args.np) for task, config in TASKS.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "models.json").write_text(
        json.dumps(
            {"np": args.np, "batch_size": args.batch_size, "rows": rows, "accuracy": tasks},
            indent=1,
        )
    )
    print(
        f"\n| model | input | parameters | samples/s per worker, 1 worker | "
        f"samples/s per worker, {args.np} workers |"
    )
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {'x'.join(map(str, r['input']))} | {r['params']:,} | "
            f"{r['per_worker_np1']:.1f} ± {r['ci95_np1']:.1f} | "
            f"{r[f'per_worker_np{args.np}']:.1f} ± {r[f'ci95_np{args.np}']:.1f} |"
        )
    for task, acc in tasks.items():
        print(f"\n{task}: validation accuracy {acc:.4f} on {args.np} workers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
