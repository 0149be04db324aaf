"""The public API: every name the facade lists resolves, `import hvd_train` stays light, and the
deprecated `hvd_train.dist` alias serves the same objects as the new modules."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hvd_train

REPO = Path(__file__).resolve().parents[2]

# The names the README's API block and docs/api.md show users.
DOCUMENTED = [
    "init",
    "rank",
    "size",
    "is_chief",
    "shard_dataset",
    "scaled_warmup_schedule",
    "DistributedOptimizer",
    "BroadcastInitialState",
    "distributed_callbacks",
    "evaluate",
    "SyncBatchNormalization",
    "StopRequest",
    "StopAtAgreedStep",
    "CheckWeights",
    "Preempted",
]


def test_import_hvd_train_loads_neither_tensorflow_nor_horovod():
    code = (
        "import sys, hvd_train; dir(hvd_train); "
        "print(sorted(m for m in ('tensorflow', 'keras', 'horovod') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_listed_name_resolves_and_dir_shows_it():
    assert set(DOCUMENTED) <= set(hvd_train.__all__)
    for name in hvd_train.__all__:
        assert getattr(hvd_train, name) is not None, name
    assert set(hvd_train.__all__) <= set(dir(hvd_train))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'DistributedOptimiser'"):
        _ = hvd_train.DistributedOptimiser


def test_the_dist_alias_warns_and_serves_the_new_objects():
    sys.modules.pop("hvd_train.dist", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from hvd_train import dist
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    from hvd_train import comm
    from hvd_train.keras import layers, optimizer, state

    assert dist.DistributedOptimizer is optimizer.DistributedOptimizer
    assert dist.SyncBatchNormalization is layers.SyncBatchNormalization
    assert dist.broadcast_model_state is state.broadcast_model_state
    assert dist.allreduce is comm.allreduce and dist.init is comm.init
    assert dist.SyncBatchNormalization is hvd_train.SyncBatchNormalization
