"""Horovod's Keras examples, unchanged but for the import, the offline data and Keras 3's
migrations (each diff in `diffs/`, listed in docs/horovod.md), run at 2 workers on the modern
stack against `hvd_train.horovod`.

Tier 1 (`tensorflow2/`): the import line, the data source and `experimental_run_tf_function`.
Tier 2 (`keras/`, `elastic/`): also the Keras 2 APIs Keras 3 removed. Each test checks what the
example leaves on disk or prints against a closed form or a bound with a negative control: the
final checkpoint classifies the held-out digits far better than the same network untrained, a
resumed run starts at the epoch after its checkpoint, the warmup ends at the scaled rate.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from jobs import PYTHON, REPO, run, tagged_pids

from hvd_train.core import launch

HOROVOD_COMMIT = "2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a"
HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": f"{HERE}{os.pathsep}{REPO}", "CUDA_VISIBLE_DEVICES": "-1"}
MNIST_EPOCHS = 24  # the examples' own
MNIST_ACCURACY = 0.95  # trained: about 0.98 on the held-out 1,000; untrained: about 0.1
UNTRAINED_AT_MOST = 0.3


def example(src: Path, name: str, path: str, workdir: Path) -> Path:
    """Horovod's `examples/<path>` at HOROVOD_COMMIT, `diffs/<name>.diff` applied, in workdir."""
    if (src / "examples").is_dir():
        text = (src / "examples" / path).read_text()
    else:
        text = subprocess.run(
            ["git", "--git-dir", str(src), "show", f"{HOROVOD_COMMIT}:examples/{path}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    target = workdir / "examples" / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    patched = subprocess.run(
        [
            "patch",
            "-p1",
            "-d",
            str(workdir),
            "--no-backup-if-mismatch",
            "-i",
            str(HERE / "diffs" / f"{name}.diff"),
        ],
        capture_output=True,
        text=True,
    )
    assert patched.returncode == 0, f"{name}.diff does not apply:\n{patched.stdout}{patched.stderr}"
    return target


def mpirun(script: Path, *args: str) -> list[str]:
    return launch.mpirun_argv(
        2,
        [PYTHON, str(script), *args],
        env_names=list(ENV),
        as_root=os.geteuid() == 0,
        oversubscribe=True,
        ompi_major=launch.ompi_major_version(),
    )


def accuracies(checkpoint: Path) -> tuple[float, float]:
    """(accuracy of `checkpoint` on the held-out digits, accuracy of its network re-initialised)."""
    code = f"""
import json, keras, offline_data
_, (x, y) = offline_data.mnist_load_data()
x = x[..., None].astype("float32") / 255.0
model = keras.models.load_model({str(checkpoint)!r}, compile=False)
fresh = keras.models.clone_model(model)
def accuracy(m):
    return float((m.predict(x, verbose=0).argmax(-1) == y).mean())
print(json.dumps([accuracy(model), accuracy(fresh)]))
"""
    done = subprocess.run(
        [PYTHON, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **ENV}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def checks_out(checkpoint: Path) -> None:
    trained, untrained = accuracies(checkpoint)
    assert trained >= MNIST_ACCURACY, (trained, untrained)
    # Negative control: the bound separates a trained network from the same one untrained.
    assert untrained <= UNTRAINED_AT_MOST, (trained, untrained)


def learning_rate(checkpoint: Path) -> float:
    """The learning rate in a checkpoint's optimizer (read from the HDF5 file's training config)."""
    code = f"""
import json, h5py
with h5py.File({str(checkpoint)!r}) as f:
    config = json.loads(f.attrs["training_config"])
print(config["optimizer_config"]["config"]["learning_rate"])
"""
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.strip())


def test_tier1_tensorflow2_keras_mnist_trains_under_horovodrun(horovod_src, tmp_path):
    script = example(
        horovod_src, "tensorflow2_keras_mnist", "tensorflow2/tensorflow2_keras_mnist.py", tmp_path
    )
    job = run(launch.horovodrun_argv(2, [PYTHON, str(script)]), timeout=3600, env=ENV, cwd=tmp_path)
    assert job.returncode == 0, job.tail()
    last = tmp_path / f"checkpoint-{MNIST_EPOCHS}.h5"
    assert last.is_file(), sorted(p.name for p in tmp_path.iterdir())
    checks_out(last)
    # The warmup ends at the rate scaled to 2 workers (0.001 x 2), which the last epochs keep.
    assert learning_rate(last) == pytest.approx(0.002, rel=1e-6)
    assert learning_rate(tmp_path / "checkpoint-1.h5") < 0.002


@pytest.mark.parametrize("compression", [[], ["--fp16-allreduce"]], ids=["none", "fp16"])
def test_tier1_synthetic_benchmark_reports_its_throughput(horovod_src, tmp_path, compression):
    script = example(
        horovod_src,
        "tensorflow2_keras_synthetic_benchmark",
        "tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
        tmp_path,
    )
    args = ["--no-cuda", "--batch-size", "2", "--num-batches-per-iter", "2", "--num-iters", "3"]
    job = run(mpirun(script, *args, *compression), timeout=1200, env=ENV, cwd=tmp_path)
    assert job.returncode == 0, job.tail()
    total = re.findall(r"Total img/sec on 2 CPU\(s\): ([0-9.]+)", job.output)
    assert len(total) == 1 and float(total[0]) > 0, job.tail()


def test_tier2_keras_mnist_advanced_trains(horovod_src, tmp_path):
    script = example(horovod_src, "keras_mnist_advanced", "keras/keras_mnist_advanced.py", tmp_path)
    job = run(mpirun(script), timeout=2400, env=ENV, cwd=tmp_path)
    assert job.returncode == 0, job.tail()
    # Every rank evaluates the whole held-out set at the end and prints it.
    printed = [float(a) for a in re.findall(r"Test accuracy: ([0-9.]+)", job.output)]
    assert len(printed) == 2 and min(printed) >= MNIST_ACCURACY, job.tail()
    checks_out(tmp_path / f"checkpoint-{MNIST_EPOCHS}.h5")


def test_tier2_keras_imagenet_resnet50_resumes_from_its_checkpoint(horovod_src, tmp_path):
    import offline_data

    script = example(
        horovod_src, "keras_imagenet_resnet50", "keras/keras_imagenet_resnet50.py", tmp_path
    )
    train_dir, val_dir = offline_data.image_folders(tmp_path / "imagenet", images=64)
    args = [
        "--train-dir",
        train_dir,
        "--val-dir",
        val_dir,
        "--batch-size",
        "8",
        "--val-batch-size",
        "8",
    ]
    first = run(mpirun(script, *args, "--epochs", "1"), timeout=1800, env=ENV, cwd=tmp_path)
    assert first.returncode == 0, first.tail()
    assert (tmp_path / "checkpoint-1.h5").is_file()
    # A second run finds checkpoint-1, rank 0 loads it with hvd.load_model, and the broadcast
    # start epoch makes every rank train epoch 2 only.
    second = run(mpirun(script, *args, "--epochs", "2"), timeout=1800, env=ENV, cwd=tmp_path)
    assert second.returncode == 0, second.tail()
    assert "Epoch 2/2" in second.output and "Epoch 1/2" not in second.output, second.tail()
    assert (tmp_path / "checkpoint-2.h5").is_file()
    assert len(re.findall(r"Test accuracy: ", second.output)) == 1, second.tail()


def worker(tag: str, script: Path, rank: int) -> tuple[int, str] | None:
    """(PID, host) of the example's worker started as `rank` in the job tagged `tag`."""
    for pid in tagged_pids(tag):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if str(script).encode() in cmdline and f"HOROVOD_RANK={rank}".encode() in environ:
            host = next(e for e in environ if e.startswith(b"HOROVOD_HOSTNAME="))
            return pid, host.split(b"=", 1)[1].decode()
    return None


def test_tier2_elastic_mnist_survives_a_lost_worker(horovod_src, tmp_path):
    script = example(
        horovod_src,
        "tensorflow2_keras_mnist_elastic",
        "elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py",
        tmp_path,
    )
    # Two host names for this machine: Horovod blacklists the whole host of a failed worker.
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    argv = launch.horovodrun_elastic_argv(
        2,
        [PYTHON, str(script)],
        min_np=1,
        max_np=2,
        discovery=[str(REPO / "mpi_scripts" / "discover_hosts.sh"), str(hosts)],
    )

    def kill_rank_1_after_two_epochs(proc: subprocess.Popen, tag: str) -> int:
        # Rank 1: the example gives ModelCheckpoint to the worker that starts as rank 0 only.
        deadline = time.monotonic() + 1800
        while not (tmp_path / "checkpoint-2.h5").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "no second epoch"
            time.sleep(1)
        found = worker(tag, script, 1)
        assert found is not None, "rank 1's worker not found"
        pid, host = found
        hosts.write_text("".join(f"{h}:1\n" for h in ("localhost", "127.0.0.1") if h != host))
        os.kill(pid, signal.SIGKILL)
        return pid

    job = run(argv, timeout=5400, env=ENV, cwd=tmp_path, during=kill_rank_1_after_two_epochs)
    assert isinstance(job.during, int), job.during
    assert job.returncode == 0, job.tail()
    # The survivor restored the last commit and finished the epochs alone. Its fit after the
    # reset counts epochs from 1 again (`epochs=24 - state.epoch`), so ModelCheckpoint's last file
    # is the newest, not checkpoint-24.
    written = sorted(tmp_path.glob("checkpoint-*.h5"), key=lambda p: p.stat().st_mtime)
    assert len(written) >= 3, sorted(p.name for p in tmp_path.iterdir())
    last = written[-1]
    checks_out(last)
    # on_state_reset set the rate for the one worker left: 0.001 x 1.
    assert learning_rate(last) == pytest.approx(0.001, rel=1e-6)
