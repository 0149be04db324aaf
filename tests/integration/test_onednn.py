"""TensorFlow's oneDNN CPU kernels: on wherever hvd_train loads before TensorFlow or launches the
job, the user's TF_ENABLE_ONEDNN_OPTS kept, and a warning where TensorFlow loaded first without
them. TensorFlow turns them on by itself only on some x86 CPUs (AVX-512 VNNI or BF16, AVX-VNNI,
AMX); each test reads what TensorFlow itself reports."""

import platform
import subprocess
import sys

import pytest
from jobs import PYTHON, run

from hvd_train.core import placement

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in placement.ONEDNN_MACHINES,
    reason="the toolkit leaves TensorFlow's own choice off x86",
)
ENV = placement.ONEDNN_ENV
REPORT = (
    "from tensorflow.python.util import _pywrap_util_port as port; "
    "print('onednn', port.IsMklEnabled(), flush=True)"
)
WARNING = "TensorFlow was imported before hvd_train, and its oneDNN CPU kernels are off"


def python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python of this venv, this process's environment."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_importing_hvd_train_first_turns_the_kernels_on(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert "onednn True" in python(f"import hvd_train, tensorflow; {REPORT}").stdout


def test_the_users_setting_wins(monkeypatch):
    # The negative control of the test above: the same program, the kernels off.
    monkeypatch.setenv(ENV, "0")
    assert "onednn False" in python(f"import hvd_train, tensorflow; {REPORT}").stdout


def test_tensorflow_loaded_first_without_the_kernels_is_named(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    done = python(f"import tensorflow; {REPORT}; import hvd_train; hvd_train.init(threads=1)")
    tensorflows_default = "onednn True" in done.stdout
    # Where TensorFlow turns them on by itself there is nothing to say.
    assert (WARNING in done.stderr) is not tensorflows_default, done.stderr[-2000:]


def test_a_launched_script_that_loads_tensorflow_first_has_them(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    script = tmp_path / "report.py"
    script.write_text(f"import os\nimport tensorflow\n{REPORT.replace('; ', chr(10))}\n")
    launch = [PYTHON, "-m", "hvd_train.core.launch", "--np", "2", "--", PYTHON, str(script)]
    job = run(launch, timeout=120)
    assert job.returncode == 0, job.tail()
    assert job.output.count("onednn True") == 2, job.tail()
