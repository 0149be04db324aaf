"""Parity of Horovod's Keras API: the same Horovod-style script (parity.py), the same initial
weights on every rank, no dropout, a fixed data order, at np=2 under mpirun: per-step losses of
the classic stack with Horovod's own module and of the modern stack with this toolkit's agree.

Two controls show the comparison can fail: a learning rate 1% off, and the warmup without
momentum correction (so the correction, done differently on Keras 3, is what is compared).
"""

import json
import os

import numpy as np
import pytest
from stacks import STACKS, run, stack_env

from hvd_train.core import launch

TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(python) for python, _ in STACKS.values()),
    reason="needs both the modern and the classic environment",
)


def losses(stack, weights, out, *options):
    command = [STACKS[stack][0], "tests/horovod_api/parity.py", "--weights", str(weights)]
    job = run(
        launch.build("mpirun", 2, [*command, "--out", str(out), *options]),
        timeout=300,
        env=stack_env(stack),
    )
    assert job.returncode == 0, job.tail()
    record = json.loads(out.read_text())
    assert record["api"] == {"modern": "hvd_train", "classic": "horovod"}[stack], record
    return np.array(record["losses"])


def test_per_step_losses_match_horovods_own_module(tmp_path):
    weights = tmp_path / "initial.npz"  # written by the first run, read by the others
    classic = losses("classic", weights, tmp_path / "classic.json")
    modern = losses("modern", weights, tmp_path / "modern.json")
    off_rate = losses("modern", weights, tmp_path / "rate.json", "--lr-scale", "1.01")
    uncorrected = losses("modern", weights, tmp_path / "mc.json", "--no-momentum-correction")
    gap = float(np.max(np.abs(modern - classic)))

    assert modern.shape == classic.shape == (2, 20)  # 2 ranks, 20 steps each
    assert gap < TOLERANCE, f"per-step losses differ by {gap}:\n{modern}\n{classic}"
    assert np.max(np.abs(off_rate - classic)) > 10 * TOLERANCE
    assert np.max(np.abs(uncorrected - classic)) > 10 * TOLERANCE
    assert modern[:, -5:].mean() < modern[:, :5].mean() - 0.1  # and it trains
    print(f"parity: 2 ranks x 20 steps, largest per-step loss difference {gap:.2g}")
