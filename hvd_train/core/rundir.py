"""The run directory: checked before TensorFlow starts, so bad paths cost a second, not a minute.

Only rank 0 writes there; the other ranks never touch it (no shared filesystem is assumed). The
rule that protects results: an existing, non-empty run directory is used only with --resume
(continue it) or --overwrite (replace it, and only if it is an hvd_train run directory).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hvd_train.errors import UserError

MARKER = "run.json"


class RunDirError(UserError):
    """A run directory that cannot be used (one line, names the path)."""


def prepare(run_dir: str | os.PathLike, resume: bool, overwrite: bool) -> Path:
    """Check (and with --overwrite, empty) the run directory on rank 0; returns its path.

    Raises:
      RunDirError: --resume with --overwrite; the path is a file; it cannot be created or
        written; it holds files but neither flag was given; --overwrite on a directory hvd_train
        did not make.
    """
    path = Path(run_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run_dir {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if overwrite:
            if not (path / MARKER).is_file():
                raise RunDirError(
                    f"run_dir {path} is not an hvd_train run directory (no {MARKER}); "
                    "refusing to delete it with --overwrite"
                )
            shutil.rmtree(path)
        elif not resume:
            raise RunDirError(
                f"run_dir {path} is not empty: pass --resume to continue it or --overwrite to "
                "replace it"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"run_dir {path} cannot be created: {err.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunDirError(f"run_dir {path} is not writable")
    return path
