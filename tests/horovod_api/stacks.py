"""The integration tier's job runner (tests/integration/jobs.py: bounded, nothing left behind,
re-exported as `run`) and the two stacks' Pythons, for the launches of this tier."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from jobs import PYTHON, REPO, run

__all__ = ["PYTHON", "REPO", "STACKS", "run", "stack_env"]

CLASSIC_VENV = os.environ.get("HVD_TRAIN_CLASSIC_VENV", str(REPO / ".venv-classic"))
STACKS = {
    # The stack's Python, and its environment's commands (horovodrun) first on PATH.
    "modern": (PYTHON, os.path.dirname(PYTHON)),
    "classic": (os.path.join(CLASSIC_VENV, "bin", "python"), os.path.join(CLASSIC_VENV, "bin")),
}


def stack_env(stack: str) -> dict[str, str]:
    """The environment for a launch of `stack`'s Python."""
    return {"PATH": os.pathsep.join([STACKS[stack][1], os.environ["PATH"]])}
