"""The model registry: parameter counts pinned, one training step runs, listing needs no
TensorFlow, and users' model files load or fail in one line naming the file."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import models
from hvd_train.errors import UserError

REPO = Path(__file__).resolve().parents[2]
ZOO = {"mlp", "cnn", "resnet20", "resnet56", "transformer", "resnet50", "mobilenetv2"}
ZOO.update({"efficientnetb0", "dlrm"})


def test_registry_lists_and_rejects_unknown_names():
    assert set(models.names()) >= ZOO
    with pytest.raises(KeyError, match="unknown model 'resnet9000'; known: "):
        models.build("resnet9000", (8, 8, 1), 10)
    with pytest.raises(ValueError, match="already registered"):
        models.register("mlp")(lambda *a: None)


# CIFAR ResNets (option A shortcuts add no parameters). Convolutions have no bias; a BatchNorm of
# c channels holds 4c numbers, 2c of them trainable (gamma, beta); logits: 64*10+10 = 650.
#   ResNet-20 (n=3): convs 3*9*16 + 6*9*16*16 + 9*16*32 + 5*9*32*32 + 9*32*64 + 5*9*64*64
#     = 432 + 13824 + 4608 + 46080 + 18432 + 184320 = 267696;
#     BatchNorm 4*(16 + 6*16 + 6*32 + 6*64) = 2752; total 271098, trainable 269722 (paper: 0.27M).
#   ResNet-56 (n=9): convs 432 + 18*2304 + 4608 + 17*9216 + 18432 + 17*36864 = 848304;
#     BatchNorm 4*(16 + 18*16 + 18*32 + 18*64) = 8128; total 857082, trainable 853018 (0.85M).
# Transformer on (64,), vocab 1000, defaults otherwise: token embedding 1000*64 = 64000, positions
#   64*64 = 4096; per block: attention 4*(64*64+64) = 16640, feed-forward 64*128+128 + 128*64+64
#   = 16576, two LayerNorms 2*128; 2 blocks = 66944; logits 650; total 135690.
# Keras Applications with 10 classes (trainable = the published ImageNet trunk + the new logits):
#   ResNet-50: 23534592 + 2048*10+10 = 23555082; MobileNetV2: 2223872 + 1280*10+10 = 2236682;
#   EfficientNet-B0: 4007548 + 12810 = 4020358. Totals add BatchNorm moving statistics (and
#   EfficientNet's input Normalization: mean, variance, count = 7).
DLRM = {"rows": 100, "fields": 3, "dim": 4, "bottom": (8,), "top": (16, 8)}
CASES = [
    # (name, input shape, hp, total parameters, trainable), 10 classes.
    # mlp: 64*64+64 + 64*32+32 + 32*10+10
    ("mlp", (64,), {}, 6570, 6570),
    # cnn: conv 1->32: 320; conv 32->64: 18496; dense 4*4*64->128: 131200; logits: 1290
    ("cnn", (8, 8, 1), {}, 151306, 151306),
    ("resnet20", (32, 32, 3), {}, 271098, 269722),
    ("resnet56", (32, 32, 3), {}, 857082, 853018),
    ("transformer", (64,), {"vocab_size": 1000}, 135690, 135690),
    ("resnet50", (32, 32, 3), {}, 23608202, 23555082),
    ("mobilenetv2", (32, 32, 3), {}, 2270794, 2236682),
    ("efficientnetb0", (32, 32, 3), {}, 4062381, 4020358),
    # dlrm on 3 ids + 2 dense features: table 100*4 = 400; bottom 2*8+8 = 24, 8*4+4 = 36; the
    #   dots of 4 vectors (16) and the dense vector (4): top 20*16+16 = 336, 16*8+8 = 136; logits
    #   8*10+10 = 90; total 1022, the same split (one worker: one shard) or Keras's Embedding.
    ("dlrm", (5,), {**DLRM, "sharded": True}, 1022, 1022),
    ("dlrm", (5,), {**DLRM, "sharded": False}, 1022, 1022),
]


# Tracing a graph for these costs 4-10 s each on 2 CPU cores: they step eagerly. The layers of
# the zoo's own making (ZeroPadShortcut, PositionEmbedding) step in a graph, as in fit(), in
# resnet20 and transformer.
EAGER = {"resnet56", "resnet50", "mobilenetv2", "efficientnetb0"}


@pytest.mark.parametrize(
    ("name", "input_shape", "hp", "params", "trainable"), CASES, ids=[c[0] for c in CASES]
)
def test_parameter_count_and_one_step(name, input_shape, hp, params, trainable):
    import keras

    model = models.build(name, input_shape, 10, **hp)
    assert model.count_params() == params
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == trainable
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=name in EAGER,
    )
    rng = np.random.default_rng(0)
    batch = 2
    if name == "transformer":
        x = rng.integers(0, hp["vocab_size"], (batch, *input_shape))
    elif name == "dlrm":  # ids as floats, then the dense features
        ids = rng.integers(0, hp["rows"], (batch, hp["fields"])).astype(np.float32)
        x = np.concatenate([ids, rng.random((batch, 2), dtype=np.float32)], axis=1)
    else:
        x = rng.random((batch, *input_shape), dtype=np.float32)
    loss = model.train_on_batch(x, np.arange(batch))
    assert np.isfinite(loss)


@pytest.mark.parametrize(("name", "depth"), [("resnet20", 20), ("resnet56", 56)])
def test_cifar_resnet_has_depth_weighted_layers_and_weight_decay(name, depth):
    import keras

    model = models.build(name, (16, 16, 3), 10)
    layers = [
        layer
        for layer in model.layers
        if isinstance(layer, keras.layers.Conv2D | keras.layers.Dense)
    ]
    assert len(layers) == depth
    assert all(layer.kernel_regularizer.l2 == pytest.approx(0.5e-4) for layer in layers)
    assert model.output.shape == (None, 10)
    bare = models.build(name, (16, 16, 3), 10, weight_decay=0)
    assert not bare.losses and len(model.losses) == depth


def test_option_a_shortcut_subsamples_and_pads_channels_with_zeros():
    from models.layers import ZeroPadShortcut

    x = np.arange(2 * 4 * 4 * 3, dtype=np.float32).reshape(2, 4, 4, 3)
    y = np.asarray(ZeroPadShortcut(filters=5, stride=2)(x))
    assert y.shape == (2, 2, 2, 5)
    np.testing.assert_array_equal(y[..., :3], x[:, ::2, ::2, :])
    np.testing.assert_array_equal(y[..., 3:], 0)


@pytest.mark.parametrize(
    ("name", "input_shape", "hp", "message"),
    [
        ("resnet50", (31, 64, 3), {}, r"resnet50: needs images of at least 32x32 pixels"),
        (
            "mobilenetv2",
            (8, 8, 1),
            {},
            r"mobilenetv2: needs images of at least 32x32 .* \(8, 8, 1\)",
        ),
        ("efficientnetb0", (64,), {}, r"efficientnetb0: needs images of at least 32x32"),
        ("resnet20", (32, 32), {}, r"resnet: input_shape must be \(height, width, channels\)"),
        ("resnet20", (32, 32, 3), {"weight_decay": -1}, r"weight_decay must be >= 0, got -1"),
        ("transformer", (8, 8), {}, r"transformer: input_shape must be \(seq_len,\), got \(8, 8\)"),
        ("transformer", (8,), {"heads": 5}, r"d_model \(64\) must be divisible by heads \(5\)"),
        ("dlrm", (3,), {"fields": 3}, r"dlrm: input_shape must be \(fields \+ dense features,\)"),
    ],
)
def test_builders_reject_bad_shapes_and_params_in_one_line(name, input_shape, hp, message):
    with pytest.raises(UserError, match=message):
        models.build(name, input_shape, 10, **hp)


def test_cifar_resnet_depth_must_be_6n_plus_2():
    from models.resnet import build_cifar_resnet

    with pytest.raises(
        UserError, match=r"depth must be 6n \+ 2 with n >= 1 \(20, 56, ...\), got 21"
    ):
        build_cifar_resnet((32, 32, 3), 10, depth=21)


def run_without_tensorflow(code: str) -> str:
    """Run `code` in a fresh Python where importing TensorFlow or Keras fails; return stdout."""
    blocked = "import sys\nsys.modules['tensorflow'] = sys.modules['keras'] = None\n"
    result = subprocess.run(
        [sys.executable, "-c", blocked + textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_names_and_summaries_need_no_tensorflow():
    out = run_without_tensorflow(
        """
        import models
        for name in models.names():
            print(name, "|", models.summary(name))
        """
    )
    rows = dict(line.split(" | ") for line in out.splitlines())
    assert set(rows) >= ZOO
    assert (
        rows["resnet20"]
        == "ResNet-20 for CIFAR (He et al. 2016): option A shortcuts, 0.27M parameters."
    )
    assert all(rows[name] for name in ZOO)


def test_cli_models_lists_names_and_summaries_without_tensorflow(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(GOOD_FILE)
    out = run_without_tensorflow(
        f"""
        from hvd_train import cli
        sys.exit(cli.main(["models", "--file", {str(path)!r}]))
        """
    )
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == sorted([*ZOO, "tiny"])
    assert "resnet56        ResNet-56 for CIFAR (He et al. 2016): option A shortcuts" in out
    assert "tiny            A one-layer model from a user's file." in lines


GOOD_FILE = '''\
import models


@models.register("tiny")
def build_tiny(input_shape, num_classes):
    """A one-layer model from a user's file.

    More text that `hvd-train models` does not show.
    """
    import keras

    inputs = keras.Input(input_shape)
    outputs = keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, outputs)
'''


@pytest.fixture
def registry(monkeypatch):
    """Loads in a test stay in the test: the registry and the loaded files are restored."""
    monkeypatch.setattr(models, "_REGISTRY", dict(models._REGISTRY))
    monkeypatch.setattr(models, "_LOADED", {})


def test_load_file_registers_the_file_s_builders_once(tmp_path, registry):
    path = tmp_path / "mine.py"
    path.write_text(GOOD_FILE)
    assert models.load_file(path) == ["tiny"]
    assert models.load_file(str(path)) == ["tiny"]  # once per process: not an "already registered"
    assert "tiny" in models.names()
    assert models.summary("tiny") == "A one-layer model from a user's file."
    assert models.build("tiny", (4, 2), 3).count_params() == 8 * 3 + 3


FAILED = "importing the model file failed:"
# (a model file's text, the start of the error, after the file's path)
BAD_FILES = {
    "raises": (
        "import models\n\n@models.register('half')\ndef build(s, n):\n    pass\n\n"
        "raise RuntimeError('boom')\n",
        f":7: {FAILED} RuntimeError: boom",
    ),
    "bad-import": ("import modles\n", f":1: {FAILED} ModuleNotFoundError: No module named"),
    "syntax": ("def f(:\n", f":1: {FAILED} SyntaxError: "),
    "name-taken": (
        "import models\nmodels.register('mlp')(print)\n",
        f":2: {FAILED} ValueError: model 'mlp' is already registered",
    ),
    "registers-nothing": (
        "import keras  # nothing decorated\n",
        ': the model file registers no model (decorate a builder with @models.register("name"))',
    ),
}


@pytest.mark.parametrize(("text", "message"), BAD_FILES.values(), ids=BAD_FILES)
def test_load_file_failure_is_one_line_naming_the_file(tmp_path, registry, text, message):
    path = tmp_path / "mine.py"
    path.write_text(text)
    before = models.names()
    with pytest.raises(UserError) as info:
        models.load_file(path)
    assert str(info.value).startswith(f"{path}{message}")
    assert "\n" not in str(info.value)
    assert models.names() == before  # what a failed file registered is unregistered


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing.py", "{path}: the model file does not exist"),
        ("models.txt", "{path}: a model file must be a Python file (.py)"),
    ],
)
def test_load_file_rejects_a_missing_or_non_python_file(tmp_path, registry, name, message):
    path = tmp_path / name
    if name.endswith(".txt"):
        path.write_text(GOOD_FILE)
    with pytest.raises(UserError, match="^" + re.escape(message.format(path=path))):
        models.load_file(path)
