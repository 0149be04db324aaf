"""The launcher side of `hvd-train bench ...` and `hvd-train plan`: start the ranks, collect the
JSON, write it with a PNG beside it (`figures`), print the figures. Every launch has a timeout
(`hvd_train.core.processes`)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hvd_train.bench import figures
from hvd_train.bench import plan as plan_lib
from hvd_train.core import launch, processes

TIMEOUT_S = 1200


def _python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"hvd_train.bench.{module}", *args]


def _launch(
    np: int,
    command: list[str],
    env: dict[str, str] | None = None,
    launcher: str = "mpirun",
    echo: bool = False,
) -> None:
    argv = launch.build(launcher, np, command)
    done = processes.run(argv, processes.child_env(env), TIMEOUT_S, capture="separate")
    if echo:
        print("\n".join(line for line in done.output.splitlines() if not line.startswith("I0000")))
    if not done.ok:
        raise RuntimeError(
            f"benchmark launch failed ({done.outcome(TIMEOUT_S)}): {argv}\n{done.tail()}"
        )


def _write(out_dir: Path, name: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


# --- allreduce ----------------------------------------------------------------------------------


def allreduce(np: int, mib: list[int], out_dir: Path, env: dict[str, str] | None = None) -> dict:
    """Allreduce bandwidth of Horovod, mpi4py and the reference ring under mpirun."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        args = ["--out", str(out), "--mib", *map(str, mib), "--timeline", tmp]
        # DYNAMIC: Horovod records its timeline only around the largest size's allreduces.
        _launch(
            np, _python_module("allreduce", *args), {"HOROVOD_TIMELINE": "DYNAMIC", **(env or {})}
        )
        result = json.loads(out.read_text())
    _write(out_dir, "allreduce", result)
    figures.allreduce(result, out_dir / "allreduce.png")
    for row in result["rows"]:
        print(
            f"{row['method']:<20} {row['MiB']:>5} MiB  {row['ms_median']:9.2f} ms  "
            f"busbw {row['busbw_GBps']:.3f} GB/s"
        )
    for activity, ms in result.get("timeline_ms_per_allreduce", {}).items():
        print(f"horovod timeline at {result['timeline_MiB']} MiB: {activity} {ms:.2f} ms")
    return result


# --- synthetic and scaling -----------------------------------------------------------------------


def _synthetic_args(
    model: str, shape: list[int], batch: int, iters: int, per_iter: int, warmup: int
) -> list[str]:
    return [
        "--model",
        model,
        "--shape",
        *map(str, shape),
        "--batch-size",
        str(batch),
        "--num-iters",
        str(iters),
        "--num-batches-per-iter",
        str(per_iter),
        "--num-warmup-batches",
        str(warmup),
    ]


def synthetic(
    np: int,
    model: str,
    shape: list[int],
    batch: int,
    iters: int,
    per_iter: int,
    warmup: int,
    out_dir: Path | None,
    launcher: str = "mpirun",
    env: dict[str, str] | None = None,
    echo: bool = True,
) -> dict:
    """One run of the synthetic benchmark on `np` ranks (the toolkit's fit path)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        args = _synthetic_args(model, shape, batch, iters, per_iter, warmup)
        _launch(np, _python_module("synthetic", *args, "--out", str(out)), env, launcher, echo)
        result = json.loads(out.read_text())
    if out_dir is not None:
        _write(out_dir, f"synthetic-{model}-np{np}", result)
    return result


def ceiling(
    np: int, model: str, shape: list[int], batch: int, iters: int, per_iter: int, warmup: int
) -> dict:
    """`np` independent single-worker runs at once, each with its share of the cores, timed over
    the same wall-clock window: the throughput with no communication at all."""
    threads = max(1, (os.cpu_count() or 1) // np)
    start_at = time.time() + 30.0 + 10.0 * np  # after every process has imported and warmed up
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"r{i}.json" for i in range(np)]
        args = _synthetic_args(model, shape, batch, iters, per_iter, warmup)
        timing = ["--threads", str(threads), "--start-at", str(start_at)]
        commands = [_python_module("synthetic", *args, *timing, "--out", str(o)) for o in outs]
        env = processes.child_env()
        for done in processes.run_all(commands, [env] * np, TIMEOUT_S, capture="separate"):
            if not done.ok:
                raise RuntimeError(
                    f"ceiling run failed ({done.outcome(TIMEOUT_S)}): {done.errors[-2000:]}"
                )
        results = [json.loads(o.read_text()) for o in outs]
    return {
        "np": np,
        "threads": threads,
        "img_per_sec_total": sum(r["img_per_sec_per_worker"] for r in results),
        "per_process": [r["img_per_sec_per_worker"] for r in results],
    }


def scaling(
    model: str,
    shape: list[int],
    batch: int,
    max_np: int,
    repeats: int,
    iters: int,
    per_iter: int,
    warmup: int,
    straggler: tuple[int, float] | None,
    out_dir: Path,
    env: dict[str, str] | None = None,
) -> dict:
    """Throughput at 1..max_np workers against the ceiling, alternating the two `repeats` times;
    then the per-rank step breakdown at max_np (with a straggler when asked)."""
    rows = []
    for np in range(1, max_np + 1):
        toolkit, bound = [], []
        for _ in range(repeats):
            toolkit.append(
                synthetic(
                    np, model, shape, batch, iters, per_iter, warmup, None, env=env, echo=False
                )["img_per_sec_total"]
            )
            bound.append(
                ceiling(np, model, shape, batch, iters, per_iter, warmup)["img_per_sec_total"]
            )
        ratios = [t / b for t, b in zip(toolkit, bound, strict=True)]
        rows.append(
            {
                "np": np,
                "toolkit": toolkit,
                "ceiling": bound,
                "toolkit_median": statistics.median(toolkit),
                "ceiling_median": statistics.median(bound),
                "of_ceiling_median": statistics.median(ratios),
                "of_ceiling_min": min(ratios),
                "of_ceiling_max": max(ratios),
            }
        )
        print(
            f"np={np}: toolkit {rows[-1]['toolkit_median']:.1f} img/s, ceiling "
            f"{rows[-1]['ceiling_median']:.1f}, of ceiling {rows[-1]['of_ceiling_median']:.3f} "
            f"[{rows[-1]['of_ceiling_min']:.3f}, {rows[-1]['of_ceiling_max']:.3f}]",
            flush=True,
        )
    one = rows[0]["toolkit_median"]
    for row in rows:
        row["efficiency_vs_one_worker"] = row["toolkit_median"] / (row["np"] * one)
    breakdowns = [_breakdown(model, shape, batch, max_np, None, 0.0, env)]
    if straggler is not None:
        breakdowns.append(_breakdown(model, shape, batch, max_np, *straggler, env))
    result = {
        "bench": "scaling",
        "model": model,
        "shape": shape,
        "per_rank_batch_size": batch,
        "repeats": repeats,
        "rows": rows,
        "breakdowns": breakdowns,
        "horovod_env": {k: v for k, v in (env or {}).items() if k.startswith("HOROVOD_")},
    }
    _write(out_dir, f"scaling-{model}", result)
    figures.scaling(result, out_dir / f"scaling-{model}.png")
    return result


def _breakdown(
    model: str,
    shape: list[int],
    batch: int,
    np: int,
    rank: int | None,
    delay_ms: float,
    env: dict[str, str] | None,
    launcher: str = "mpirun",
    steps: int = 20,
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b.json"
        args = [
            "--model",
            model,
            "--shape",
            *map(str, shape),
            "--batch-size",
            str(batch),
            "--steps",
            str(steps),
            "--out",
            str(out),
        ]
        if rank is not None:
            args += ["--straggler-rank", str(rank), "--delay-ms", str(delay_ms)]
        _launch(np, _python_module("breakdown", *args), env, launcher)
        result = json.loads(out.read_text())
    for r, phases in enumerate(result["median_ms_per_rank"]):
        print(
            f"  breakdown np={np} rank {r}: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in phases.items())
        )
    return result


# --- controllers --------------------------------------------------------------------------------

# (name, launcher, how the Horovod cycle is chosen). "derived" passes the step time the MPI run of
# the same round measured, so `comm.init` derives the Gloo cycle (placement.cycle_time_ms).
CONTROLLERS = (
    ("mpi", "mpirun", "default"),
    ("gloo, 1 ms cycle", "horovodrun-gloo", "1"),
    ("gloo, derived cycle", "horovodrun-gloo", "derived"),
)


def _step_ms(breakdown: dict) -> float:
    """The slowest rank's median step (every phase)."""
    return max(sum(phases.values()) for phases in breakdown["median_ms_per_rank"])


def controllers(
    model: str, shape: list[int], batch: int, np: int, repeats: int, out_dir: Path
) -> dict:
    """The step breakdown and each thread group's CPU under the MPI and the Gloo controller.

    Per round: MPI first (its step time feeds the derived Gloo cycle), then the Gloo runs in an
    order that rotates every round. Figures: per contestant and rank, the median over rounds.
    """
    rounds: list[dict[str, dict]] = []
    gloo = [c for c in CONTROLLERS if c[1] != "mpirun"]
    for i in range(repeats):
        runs: dict[str, dict] = {}
        order = [CONTROLLERS[0], *gloo[i % len(gloo) :], *gloo[: i % len(gloo)]]
        for name, launcher, cycle in order:
            env = {}
            if cycle == "derived":
                env["HVD_TRAIN_STEP_MS"] = f"{_step_ms(runs['mpi']):.1f}"
            elif cycle != "default":
                env["HOROVOD_CYCLE_TIME"] = cycle
            print(f"round {i + 1}/{repeats}: {name}", flush=True)
            runs[name] = _breakdown(model, shape, batch, np, None, 0.0, env, launcher, steps=30)
        rounds.append(runs)
    summary = {}
    for name, _, _ in CONTROLLERS:
        per_rank = []
        for r in range(np):
            phases = {
                key: statistics.median(run[name][field][r][key] for run in rounds)
                for field in ("median_ms_per_rank", "threads_per_rank")
                for key in rounds[0][name][field][r]
            }
            per_rank.append(phases)
        summary[name] = {
            "per_rank": per_rank,
            "cycle_ms": [run[name]["horovod_cycle_time_ms"] for run in rounds],
            "step_ms": statistics.median(_step_ms(run[name]) for run in rounds),
        }
    result = {
        "bench": "controllers",
        "model": model,
        "shape": shape,
        "per_rank_batch_size": batch,
        "np": np,
        "repeats": repeats,
        "load_after": os.getloadavg()[0],
        "summary": summary,
        "rounds": rounds,
    }
    _write(out_dir, "controllers", result)
    figures.controllers(result, out_dir / "controllers.png")
    for name, row in summary.items():
        print(f"{name:<20} step {row['step_ms']:6.1f} ms (cycle {row['cycle_ms'][0]:g} ms)")
        for r, v in enumerate(row["per_rank"]):
            print(
                f"  rank {r}: compute {v['compute']:.1f}, wait {v['wait']:.1f}, "
                f"allreduce {v['allreduce']:.1f}, apply {v['apply']:.1f} ms; cores used: "
                f"compute threads {v['compute_cores']:.2f}, main {v['main_cores']:.2f}, "
                f"other {v['other_cores']:.2f}; compute threads preempted "
                f"{v['compute_preemptions_per_s']:.0f}/s"
            )
    return result


# --- plan ---------------------------------------------------------------------------------------


def plan(workers: list[int], out_dir: Path) -> dict[str, Any]:
    """Predict every profile x workload, compare with the published results; JSON + PNG."""
    predictions = {
        f"{hw}/{wl}": plan_lib.predict(plan_lib.HARDWARE[hw], plan_lib.WORKLOADS[wl], workers)
        for hw in plan_lib.HARDWARE
        for wl in plan_lib.WORKLOADS
        if wl.endswith(hw.split("-")[0])
    }
    comparison = plan_lib.compare_published()
    result = {
        "bench": "plan",
        "workers": workers,
        "predictions": predictions,
        "published_comparison": comparison,
        **plan_lib.describe(),
    }
    _write(out_dir, "plan", result)
    figures.plan(result, out_dir / "plan.png")
    for pub in comparison:
        print(
            f"{pub['workload']:<16} on {pub['hardware']:<18} x{pub['workers']:<4} published "
            f"{pub['efficiency']:.2f}  model {pub['model_no_overlap']:.2f}..."
            f"{pub['model_full_overlap']:.2f}  (midpoint error {pub['error_points']:+.1f} "
            "points)"
        )
    return result
