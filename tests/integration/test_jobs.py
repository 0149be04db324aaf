"""Whole jobs under real launchers: the README's main job, and a hung rank that must not hang us."""

import re
import textwrap

import pytest
from jobs import PYTHON, run

from hvd_train.core import launch


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_example_trains_digits_on_two_workers(launcher):
    job = run(launch.build(launcher, 2, [PYTHON, "examples/keras_digits.py"]), timeout=600)
    match = re.search(r"workers=2 global_batch=64 val_loss=\S+ val_accuracy=([\d.]+)", job.output)

    assert job.returncode == 0, job.tail()
    assert match, job.tail()
    assert float(match.group(1)) >= 0.95, job.tail()


def test_a_hung_rank_fails_the_test_within_its_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            from hvd_train import comm
            comm.init()
            if comm.rank() == 1:
                time.sleep(3600)  # never reaches the collective
            comm.barrier()
            """
        )
    )
    argv = launch.build("mpirun", 2, [PYTHON, str(script)])
    with pytest.raises(AssertionError, match="timed out after 45s"):
        run(argv, timeout=45)
