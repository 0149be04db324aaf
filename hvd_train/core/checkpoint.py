"""Checkpoints that survive crashes: written by rank 0 only, atomically, verifiable, pruned.

Layout of a run directory's checkpoints:
    checkpoints/epoch-0003/state.npz      every model variable (weights, BatchNorm statistics, RNG
                                          seed states) and every optimizer variable, by index
    checkpoints/epoch-0003/meta.json      epoch, optimizer step, metrics, data-order seed, config,
                                          variable names and shapes
    checkpoints/epoch-0003/manifest.json  size and sha256 of the two files above
    checkpoints/epoch-0004-step-000120/   inside epoch 4 (0-based) after its first 120 steps:
                                          written on a preemption stop or every
                                          `checkpoint.every_steps`; meta "epoch" is 3 (the last
                                          finished epoch) and "epoch_step" 120
    checkpoints/best/                     a copy of the epoch whose monitored metric was best
A checkpoint is written into a temporary sibling directory, every file fsynced, then renamed into
place (and the parent fsynced): a crash leaves either the old set or the new one, never a half
checkpoint under a final name. Only complete checkpoints count, and loading verifies the manifest,
so a truncated or corrupt newest checkpoint is reported by name and the previous one is used.

This module does file work only (numpy, json); who writes (rank 0) and how state travels to the
other ranks (a broadcast) is decided by the trainer.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hvd_train.errors import UserError

STATE = "state.npz"
META = "meta.json"
MANIFEST = "manifest.json"
_EPOCH_DIR = re.compile(r"^epoch-(\d{4,})(?:-step-(\d{6,}))?$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used, with the reason (names the directory)."""


@dataclass
class Checkpoint:
    path: Path
    meta: dict[str, Any]
    model: list[np.ndarray]
    optimizer: list[np.ndarray]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def epoch_dir_name(epoch: int, step_in_epoch: int = 0) -> str:
    if step_in_epoch:
        return f"epoch-{epoch:04d}-step-{step_in_epoch:06d}"
    return f"epoch-{epoch:04d}"


def position(path: Path) -> tuple[int, int]:
    """(epochs finished, steps into the next epoch) of a checkpoint directory, from its name."""
    match = _EPOCH_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory name")
    epoch, step = int(match.group(1)), int(match.group(2) or 0)
    return (epoch, step) if step else (epoch + 1, 0)


def write(
    directory: Path,
    epoch: int,
    model_values: Iterable[np.ndarray],
    optimizer_values: Iterable[np.ndarray],
    meta: dict[str, Any],
    step_in_epoch: int = 0,
) -> Path:
    """Write a checkpoint atomically; returns its directory.

    Args:
      directory: the run's checkpoint directory.
      epoch: 0-based; the epoch just finished, or with `step_in_epoch` the epoch in progress.
      model_values, optimizer_values: the variables' values, in the model's and optimizer's order;
        each is written as it comes (an iterator is read one array at a time).
      meta: saved as meta.json, with "epoch" (the last finished epoch, -1 for none) and
        "epoch_step" (steps done of the next one) set here.
      step_in_epoch: steps of `epoch` done (0: the epoch is finished).

    Raises:
      CheckpointError: a checkpoint of that position already exists (never overwritten).
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / epoch_dir_name(epoch, step_in_epoch)
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    named = itertools.chain(
        ((f"model/{i:05d}", v) for i, v in enumerate(model_values)),
        ((f"optimizer/{i:05d}", v) for i, v in enumerate(optimizer_values)),
    )
    with (tmp / STATE).open("wb") as f:
        _save_arrays(f, named)
        f.flush()
        os.fsync(f.fileno())
    _write_file(
        tmp / META,
        json.dumps(
            {**meta, "epoch": epoch - 1 if step_in_epoch else epoch, "epoch_step": step_in_epoch},
            indent=1,
            sort_keys=True,
        ).encode(),
    )
    manifest = {
        name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        for name in (STATE, META)
    }
    _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    _fsync_dir(tmp)
    tmp.rename(final)
    _fsync_dir(directory)
    return final


def _save_arrays(file: Any, named: Iterable[tuple[str, Any]]) -> None:
    """`np.savez`'s layout (one .npy entry per name, stored), one array at a time: an iterator's
    next array is read only after the previous one is written."""
    with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in named:
            with zf.open(f"{name}.npy", mode="w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asanyarray(value), allow_pickle=False)


def verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint directory against its manifest; returns its meta.

    Raises:
      CheckpointError: a missing, truncated or altered file (named), or unreadable metadata.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({err})") from err
    for name in (STATE, META):
        entry = manifest.get(name)
        file = path / name
        if not isinstance(entry, dict) or not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        if file.stat().st_size != entry.get("bytes"):
            raise CheckpointError(
                f"checkpoint {path}: {name} is truncated ({file.stat().st_size} of "
                f"{entry.get('bytes')} bytes)"
            )
        if _sha256(file) != entry.get("sha256"):
            raise CheckpointError(f"checkpoint {path}: {name} checksum mismatch")
    try:
        return json.loads((path / META).read_text())
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {META} ({err})") from err


def load(path: Path) -> Checkpoint:
    """Verify and read one checkpoint.

    Raises:
      CheckpointError: see `verify`.
    """
    meta = verify(path)
    with np.load(path / STATE) as arrays:
        model = [arrays[k] for k in sorted(k for k in arrays.files if k.startswith("model/"))]
        optimizer = [
            arrays[k] for k in sorted(k for k in arrays.files if k.startswith("optimizer/"))
        ]
    return Checkpoint(path, meta, model, optimizer)


def epochs_on_disk(directory: Path) -> list[Path]:
    """Complete checkpoints (final names only), oldest first (by training position)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and _EPOCH_DIR.match(p.name)]
    return sorted(found, key=position)


def newest_valid(directory: Path) -> tuple[Checkpoint | None, list[CheckpointError]]:
    """The newest checkpoint that verifies, and the errors of the newer ones that did not."""
    problems = []
    for path in reversed(epochs_on_disk(directory)):
        try:
            return load(path), problems
        except CheckpointError as err:
            err.path = path
            problems.append(err)
    return None, problems


def set_aside(path: Path) -> Path:
    """Rename an unusable checkpoint out of the way (kept for inspection, never deleted)."""
    n = 0
    while (target := path.with_name(f"{path.name}.corrupt-{n}")).exists():
        n += 1
    path.rename(target)
    return target


def prune(directory: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints; returns what was deleted."""
    old = epochs_on_disk(directory)[:-keep_last]
    for path in old:
        shutil.rmtree(path)
    return old


def copy_as_best(directory: Path, source: Path) -> Path:
    """Make `directory/best` a copy of checkpoint `source`; the old best is replaced atomically."""
    best = directory / "best"
    tmp = directory / f".best.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    for file in tmp.iterdir():
        with file.open("rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if best.exists():
        old = directory / f".best.old-{os.getpid()}"
        best.rename(old)
        tmp.rename(best)
        shutil.rmtree(old)
    else:
        tmp.rename(best)
    _fsync_dir(directory)
    return best
