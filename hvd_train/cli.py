"""The `hvd-train` command line: parses, checks, then calls one library function per subcommand.

Every check that needs no TensorFlow (the config, the worker count, the model name, the run
directory) runs before TensorFlow is imported and, under `hvd-train launch`, before any worker
starts. A bad input ends with one line `hvd-train: error: ...` and exit code 2; the other exit
codes (a stalled or lost rank, diverged weights, a preempted run) are in `hvd_train.core.faults`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hvd_train import doctor, selftest
from hvd_train.core import config as config_lib
from hvd_train.core import environment, faults, inject, launch, outcome, rundir
from hvd_train.errors import UserError


class UsageError(Exception):
    """A bad input found by the CLI itself (the message is the whole error line)."""


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvd-train train", add_help=True)
    parser.add_argument("--config", help="YAML experiment file (defaults apply without one)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.epochs=3 (after the YAML file)",
    )
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing hvd_train run in run_dir"
    )
    parser.add_argument(
        "--stop-after-epochs",
        type=int,
        metavar="N",
        help="train at most N epochs in this launch, checkpoint, exit (resume later)",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="keep training while workers leave and join (under horovodrun --min-np/--max-np "
        "--host-discovery-script; hvd_train.training.elastic)",
    )
    return parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input
        raise UsageError(f"{self.prog}: {message}")


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    parser.__class__ = _Parser
    return parser.parse_args(argv)


def check_train_args(
    argv: Sequence[str], size: int, log_notes: bool = True
) -> tuple[argparse.Namespace, object]:
    """Parse and check a `train` command line for `size` workers, without TensorFlow.

    `log_notes`: log the config's notes (a null section means its defaults); one process of a
    job says them.

    Raises:
      UsageError, config_lib.ConfigError: the one line to show.
    """
    args = _parse(_train_parser(), argv)
    if args.stop_after_epochs is not None and args.stop_after_epochs < 1:
        raise UsageError(f"--stop-after-epochs must be >= 1, got {args.stop_after_epochs}")
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if args.elastic and (args.resume or args.stop_after_epochs is not None):
        raise UsageError("--elastic takes neither --resume nor --stop-after-epochs")
    config = config_lib.load(args.config, args.set, log_notes=log_notes)
    # A bad HVD_TRAIN_FAIL_IN or HVD_TRAIN_SLOW_IN fails here, before any worker starts.
    inject.plan(), inject.slow()
    config_lib.validate(config, size)
    if args.elastic:
        config_lib.check_elastic(config)
    import models

    if config.model.file is not None:
        models.load_file(config.model.file)  # the user's builders, before the name is checked
    if config.model.name not in models.names():
        raise config_lib.ConfigError(
            f"model.name: unknown model {config.model.name!r} (known: {', '.join(models.names())})"
        )
    return args, config


def cmd_train(argv: Sequence[str]) -> int:
    launcher = environment.read(os.environ)
    args, config = check_train_args(argv, launcher.size or 1, log_notes=launcher.rank == 0)
    alone = (launcher.size or 1) == 1
    if alone:
        _check_on_rank0(args, config)  # before TensorFlow: no other rank to tell
    if args.elastic:
        from hvd_train.training import elastic

        if launcher.rank == 0 and not alone:
            _check_on_rank0(args, config)  # no collective may come before the first sync
        result = elastic.train_elastic(
            config, Path(config.run_dir), argv=["hvd-train", "train", *argv]
        )
    else:
        # Before TensorFlow loads (seconds): a stop signal that comes meanwhile (SLURM may send
        # its warning up to a minute early) stops the job after its first step instead of
        # killing this rank.
        stop = faults.StopRequest(config.fault.stop_signals)
        try:
            from hvd_train.training import fit as train

            result = train.train_and_evaluate(
                config,
                Path(config.run_dir),
                resume=args.resume,
                overwrite=args.overwrite,
                prepared=alone,
                stop_after_epochs=args.stop_after_epochs,
                argv=["hvd-train", "train", *argv],
                stop=stop,
            )
        finally:
            stop.close()
    from hvd_train import comm

    if comm.is_chief():
        summary = {
            "run_dir": str(config.run_dir),
            "workers": comm.size(),
            "status": result.status,
            "epochs_done": result.epochs_done,
            "final": result.final,
            "best": result.best,
            "seconds": round(result.seconds, 1),
        }
        if result.stopped_at is not None:
            summary["stopped_at"] = result.stopped_at
        print("result " + json.dumps(summary), flush=True)
    if not args.elastic and comm.size() > 1:
        # The ranks leave together, after rank 0's result line: a launcher that ends the job at
        # the first non-zero exit (a stop's 75) would otherwise end rank 0 mid-report.
        comm.barrier()
    return outcome.EXIT_CODES[result.status]


def _check_on_rank0(args: argparse.Namespace, config: Any) -> None:
    """Rank 0's checks of what only it reads first and writes: the data files (before the run
    directory exists, so that a missing file leaves none behind), then the run directory."""
    from hvd_train.data import sources

    sources.check(config.data)
    rundir.prepare(config.run_dir, args.resume, args.overwrite)


def cmd_launch(argv: Sequence[str]) -> int:
    parser = launch.make_parser("hvd-train launch")
    parser.__class__ = _Parser
    args, command = launch.parse(parser, argv)
    if command[:1] == ["selftest"]:
        _selftest_options(command[1:])  # a bad option fails here, before any worker starts
        full = [sys.executable, "-m", "hvd_train.cli", *command]
        if args.dry_run:
            return launch.execute(parser, args, full)
        return launch.supervise(parser, args, full).exit_code
    if command[:1] != ["train"]:
        raise UsageError(
            "hvd-train launch: the job after -- must be: train [train options] | selftest "
            "[selftest options]"
        )
    # Fail here, before any worker starts; the ranks' rank 0 says the config's notes.
    _, config = check_train_args(command[1:], args.np, log_notes=False)
    full = [sys.executable, "-m", "hvd_train.cli", *command]
    if args.dry_run:
        return launch.execute(parser, args, full)
    started = time.time()
    launched = launch.supervise(parser, args, full)
    status_file = Path(config.run_dir) / "status.json"
    return _launch_exit_code(
        launched.exit_code, status_file, started, error_shown=launched.error_shown
    )


def _launch_exit_code(
    code: int, status_file: Path, started: float, *, error_shown: bool = False
) -> int:
    """The launcher's exit code, or the job's own where the launcher hides it (horovodrun ends
    with 1 whatever its ranks returned): rank 0's status.json of this launch tells; without one,
    a rank's `hvd-train: error:` line (`error_shown`) means a bad input, exit 2."""
    if code == 0:
        return 0
    try:
        status = json.loads(status_file.read_text())
    except (OSError, ValueError):
        status = {}
    if status.get("time", 0) < started:  # none, or an earlier launch's
        return outcome.EXIT_USAGE if error_shown and code == 1 else code
    mapped = outcome.exit_code(str(status.get("status")))
    return code if mapped is None or mapped == outcome.EXIT_OK else mapped


def cmd_models(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="hvd-train models", description="list the models")
    parser.add_argument("--file", help="also a Python file of your own models (as model.file)")
    args = _parse(parser, argv)
    import models  # registers the zoo without importing TensorFlow

    if args.file is not None:
        models.load_file(args.file)
    names = models.names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {models.summary(name)}".rstrip())
    return 0


def _straggler(text: str) -> tuple[int, float]:
    """ "rank=R,delay_ms=D" -> (R, D)."""
    try:
        fields = dict(item.split("=", 1) for item in text.split(","))
        return int(fields["rank"]), float(fields["delay_ms"])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"--straggler wants rank=R,delay_ms=D, got {text!r}"
        ) from None


def cmd_bench(argv: Sequence[str]) -> int:
    parser = _Parser(
        prog="hvd-train bench", description="measure this cluster; JSON (+ PNG) in --out"
    )
    parser.add_argument(
        "kind",
        choices=["allreduce", "synthetic", "scaling", "controllers"],
        help="controllers: step breakdown and thread CPU under MPI and Gloo",
    )
    parser.add_argument("--np", type=int, default=2, help="workers (max workers for scaling)")
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--shape", type=int, nargs="+", default=[32, 32, 3])
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="scaling, controllers: alternations")
    parser.add_argument("--straggler", type=_straggler, help="scaling: rank=R,delay_ms=D")
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--launcher", default="mpirun", choices=launch.LAUNCHERS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.np < 1:
        raise UsageError(f"hvd-train bench: --np must be >= 1, got {args.np}")
    if args.repeats < 1:
        raise UsageError(f"hvd-train bench: --repeats must be >= 1, got {args.repeats}")
    from hvd_train.bench import runner

    common = (args.model, args.shape, args.batch_size)
    loop = (args.num_iters, args.num_batches_per_iter, args.num_warmup_batches)
    if args.kind == "allreduce":
        runner.allreduce(args.np, args.mib, args.out)
    elif args.kind == "synthetic":
        runner.synthetic(args.np, *common, *loop, args.out, args.launcher)
    elif args.kind == "controllers":
        runner.controllers(*common, args.np, args.repeats, args.out)
    else:
        runner.scaling(*common, args.np, args.repeats, *loop, args.straggler, args.out)
    return 0


def _selftest_options(argv: Sequence[str]) -> selftest.Options:
    return selftest.options(_parse(selftest.make_parser(), argv))


def cmd_selftest(argv: Sequence[str]) -> int:
    return selftest.run(_selftest_options(argv))


def _dims(text: str) -> tuple[int, ...]:
    """ "224,224,3" -> (224, 224, 3)."""
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 224,224,3, got {text!r}")
    return dims


def cmd_plan(argv: Sequence[str]) -> int:
    parser = _Parser(
        prog="hvd-train plan",
        description="predicted scaling at 8..1024 workers, or (--memory) the memory per rank",
    )
    parser.add_argument("--workers", type=int, nargs="+", help="default 8..1024; --memory: 1 2 4 8")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    memory = parser.add_argument_group("memory per rank (--memory MODEL)")
    memory.add_argument("--memory", metavar="MODEL", help="a zoo model: print its bytes per rank")
    memory.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    memory.add_argument("--optimizer", default="adam", help="sgd, adam, adamw, lamb, lion, lars")
    memory.add_argument("--momentum", type=float, default=0.9, help="SGD's (0: no slot)")
    memory.add_argument("--input-shape", type=_dims, help="e.g. 224,224,3 (default: the model's)")
    memory.add_argument("--classes", type=int, help="default: the model's")
    memory.add_argument("--mixed-precision", action="store_true", help="mixed_float16 activations")
    args = parser.parse_args(argv)
    if args.workers is not None and min(args.workers) < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.memory is None:
        from hvd_train.bench import runner

        runner.plan(args.workers or [8, 16, 32, 64, 128, 256, 512, 1024], args.out)
        return 0
    from hvd_train.bench import memory as memory_lib

    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        memory_lib.slots(args.optimizer, args.momentum)
        shape = memory_lib.zoo_shape(args.memory, args.input_shape, args.classes)
    except (KeyError, ValueError) as err:
        parser.error(str(err).strip("'\""))
    rows = memory_lib.table(
        args.memory,
        shape,
        args.workers or [1, 2, 4, 8],
        args.batch_size,
        args.optimizer,
        args.momentum,
        args.mixed_precision,
    )
    print(
        f"{args.memory}: {shape.trainable_elements:,} trainable + {shape.non_trainable:,} other "
        f"weights, {shape.activations_per_sample:,} activations per sample; {args.optimizer}, "
        f"{args.batch_size} samples per rank; MiB per rank:"
    )
    print(memory_lib.render(rows))
    return 0


COMMANDS = {
    "train": (cmd_train, "train a config on this job's workers (run it under a launcher)"),
    "launch": (cmd_launch, "start N workers of a train command under mpirun/horovodrun/srun"),
    "doctor": (lambda argv: doctor.run(sys.stdout), "versions, the Horovod build, what is wrong"),
    "selftest": (cmd_selftest, "check a job's allocation on every rank (under a launcher)"),
    "models": (cmd_models, "list the registered models"),
    "bench": (cmd_bench, "allreduce | synthetic | scaling | controllers: measure this cluster"),
    "plan": (cmd_plan, "cost model: predicted throughput and efficiency at 8..1024 workers"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: hvd-train {" + ",".join(COMMANDS) + "} ...\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<8} {text}")
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else outcome.EXIT_USAGE
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: quiet C++ logs
    try:
        return COMMANDS[argv[0]][0](argv[1:])
    except (UsageError, UserError) as err:
        _show(err)
        return outcome.EXIT_USAGE
    except faults.JobFailure as err:
        _show(err)
        return err.exit_code


def _show(err: Exception) -> None:
    """The error's one line; an error every rank raised alike (`errors.everywhere`) only on
    rank 0, so that the job shows it once, and no rank exits before rank 0 has shown it (the
    launcher would end rank 0 when the first rank leaves)."""
    everywhere = getattr(err, "everywhere", False)
    if not everywhere or environment.launcher_rank(os.environ) == 0:
        sys.stderr.write(f"hvd-train: error: {err}\n")  # one write: launchers tag whole writes
        sys.stderr.flush()
    if everywhere and "horovod" in sys.modules:
        from hvd_train import comm

        if comm.is_initialized() and comm.size() > 1:
            # Ordering only: a job whose collectives fail already ends by the launcher.
            with contextlib.suppress(Exception):
                comm.barrier()


if __name__ == "__main__":
    sys.exit(main())
