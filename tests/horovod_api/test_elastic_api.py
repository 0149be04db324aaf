"""Horovod Elastic's Keras API under horovodrun's elastic mode on one machine (2 workers,
--min-np 1): on the modern stack this toolkit's `hvd.elastic`, on the classic stack Horovod's own,
running the same script (elastic_check.py). A worker exits mid-epoch; the survivor goes back to
the last commit, goes on alone, and finishes.

Each worker has its own name for this machine ("localhost", "127.0.0.1"): horovodrun blacklists
the host of a failed worker, every slot of it (tests/integration/test_elastic.py says more).
"""

import json
import os

import pytest
from stacks import REPO, STACKS, run, stack_env

from hvd_train.core import launch

DISCOVER = str(REPO / "mpi_scripts" / "discover_hosts.sh")
# elastic_check.py: 64 samples, 8 per worker and step, 4 epochs, the worker lost in epoch 3.
STEPS_AT_2, STEPS_AT_1, EPOCHS, EPOCHS_AT_2 = 4, 8, 4, 2


@pytest.mark.parametrize("stack", ["modern", "classic"])
def test_a_lost_worker_and_the_survivor_finishes(stack, tmp_path):
    if not os.path.exists(STACKS[stack][0]):
        pytest.skip(f"no {stack} environment")
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    out = tmp_path / "facts.json"
    command = [STACKS[stack][0], "tests/horovod_api/elastic_check.py", "--out", str(out)]
    argv = launch.horovodrun_elastic_argv(
        2, command, min_np=1, max_np=2, discovery=[DISCOVER, str(hosts)]
    )
    job = run(argv, timeout=240, env=stack_env(stack))
    assert job.returncode == 0, job.tail()
    facts = json.loads(out.read_text())

    assert facts["api"] == {"modern": "hvd_train", "classic": "horovod"}[stack]
    assert facts["sizes"] == [2, 1] and facts["resets"] == [1], facts
    assert facts["epoch"] == EPOCHS
    # Back to the commit at the end of epoch 2: its updates, then the rest at one worker.
    expected = EPOCHS_AT_2 * STEPS_AT_2 + (EPOCHS - EPOCHS_AT_2) * STEPS_AT_1
    assert facts["iterations"] == expected, facts
    print(f"elastic {stack}: {facts} in {job.seconds:.0f}s")
