"""Per-rank random streams through the CLI: `hvd-train launch` with every rank seeded alike
(`train.seed`), a model that records a dropout mask, Gaussian noise and a random flip on each rank;
rank r's are what a single process draws from each layer's generator seeded rank_seed(seed, r)."""

import subprocess

import numpy as np
import pytest
from jobs import FULL_ONLY, PYTHON, REPO, run

CONFIG = str(REPO / "configs" / "digits.yaml")
SEED = 7

# The model records its dropout mask of the last training step, and each rank saves it at exit.
PROBE_MODEL = '''
import atexit
import os

import numpy as np

import models

SEEN = {}  # what each random layer drew in the last training step, outside the model


@models.register("random_probe")
def build(input_shape, num_classes):
    """Flatten and logits; on the side, a dropout mask, Gaussian noise and a flip are recorded."""
    import keras
    import tensorflow as tf

    class Probe(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dropout = keras.layers.Dropout(0.5)
            self.noise = keras.layers.GaussianNoise(1.0)
            self.flip = keras.layers.RandomFlip("horizontal")

        def build(self, shape):
            for key, drawn in draws(self, training=False).items():
                SEEN.setdefault(key, tf.Variable(tf.zeros_like(drawn), trainable=False))

        def call(self, x, training=None):
            if training:
                for key, drawn in draws(self, training=True).items():
                    SEEN[key].assign(drawn)
            return x

    inputs = keras.Input(input_shape)
    x = Probe(name="probe")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def draws(probe, training):
    """One draw of each random layer, from fixed inputs: what differs is the randomness alone."""
    import tensorflow as tf

    image = tf.reshape(tf.range(64, dtype="float32"), (4, 4, 4, 1)) / 64.0
    return {
        "mask": probe.dropout(tf.ones((64,)), training=training),
        "noise": probe.noise(tf.zeros((64,)), training=training),
        "flip": probe.flip(image, training=training),
    }


def _save():
    out = os.environ.get("HVD_TRAIN_PROBE_DIR")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK"))
    if out and SEEN and rank is not None:
        np.savez(os.path.join(out, f"rank{rank}.npz"), **{k: v.numpy() for k, v in SEEN.items()})


atexit.register(_save)
'''

# One process: the same model built after the same seeding; each random layer's generator set
# to rank r's seed, rank_seed(seed, r), then one draw.
REFERENCE = """
import sys
import keras
import numpy as np
import tensorflow as tf
import models
from hvd_train.keras.randomness import rank_seed

models.load_file(sys.argv[1])
user = next(m for n, m in sys.modules.items() if n.startswith("hvd_train_user_models_"))
for rank in range(int(sys.argv[2])):
    keras.utils.set_random_seed(int(sys.argv[3]))
    probe = models.build("random_probe", (8, 8, 1), 10).get_layer("probe")
    for layer in (probe.dropout, probe.noise, probe.flip):
        generator = layer._seed_generators[0]
        seed = int(generator.state.numpy()[0])
        generator.state.assign(tf.constant([rank_seed(seed, rank), 0], generator.state.dtype))
    drawn = user.draws(probe, training=True)
    np.savez(f"{sys.argv[4]}/reference-rank{rank}.npz", **{k: v.numpy() for k, v in drawn.items()})
"""


# horovodrun (Gloo) in `make test-full`: CI's 90 minutes.
@pytest.mark.parametrize("launcher", ["mpirun", pytest.param("horovodrun", marks=FULL_ONLY)])
def test_ranks_seeded_alike_draw_their_own_masks_through_the_cli(tmp_path, launcher):
    model_file = tmp_path / "probe_model.py"
    model_file.write_text(PROBE_MODEL)
    np_ = 2
    argv = [PYTHON, "-m", "hvd_train.cli", "launch", "--np", str(np_), "--launcher", launcher]
    argv += ["--", "train", "--config", CONFIG, "--set", f"run_dir={tmp_path / 'run'}"]
    for key in (
        f"model.file={model_file}",
        "model.name=random_probe",
        f"train.seed={SEED}",  # alike on every rank
        "train.epochs=1",
        "optimizer.warmup_epochs=0",
        "train.steps_per_epoch=1",  # one draw: the mask of step 1
        "logging.tensorboard=false",
    ):
        argv += ["--set", key]
    job = run(argv, timeout=300, env={"HVD_TRAIN_PROBE_DIR": str(tmp_path)})
    assert job.returncode == 0, job.tail()
    reference = subprocess.run(
        [PYTHON, "-c", REFERENCE, str(model_file), str(np_), str(SEED), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]

    drawn = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(np_)]
    expected = [dict(np.load(tmp_path / f"reference-rank{r}.npz")) for r in range(np_)]
    assert sorted(drawn[0]) == ["flip", "mask", "noise"]
    assert 0 < np.count_nonzero(drawn[0]["mask"]) < 64
    for key in drawn[0]:
        assert not np.array_equal(drawn[0][key], drawn[1][key]), key  # each rank its own
        for rank in range(np_):
            assert np.array_equal(drawn[rank][key], expected[rank][key]), (key, rank)
        assert not np.array_equal(drawn[1][key], expected[0][key])  # the comparison can fail
