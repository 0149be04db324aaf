"""Data sources on disk, in one process: every rank's shard computed here, as each rank does.

Each test sample carries its id (TFRecord: the label; images: a constant pixel value), so shards
can be checked to be disjoint and to cover the data.
"""

import os
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from hvd_train import data
from hvd_train.core.config import DataConfig
from hvd_train.data import sources

REPO = Path(__file__).resolve().parents[2]


def encoded_png(value: int, height: int = 4, width: int = 4) -> bytes:
    return tf.io.encode_png(np.full((height, width, 1), value, np.uint8)).numpy()


def write_tfrecords(directory, counts, prefix="train", first=0):
    """Files of records whose label is their id (from `first` on), and whose pixels all equal it."""
    directory.mkdir(exist_ok=True)
    sample = first
    for i, count in enumerate(counts):
        with tf.io.TFRecordWriter(str(directory / f"{prefix}-{i:02d}.tfrecord")) as writer:
            for _ in range(count):
                feature = {
                    "image": tf.train.Feature(
                        bytes_list=tf.train.BytesList(value=[encoded_png(sample)])
                    ),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[sample])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
                sample += 1
    return str(directory / f"{prefix}-*.tfrecord")


def record_source(tmp_path, counts, val_counts=(3, 3)):
    total = sum(counts) + sum(val_counts)
    cfg = DataConfig(
        source="tfrecord",
        path=write_tfrecords(tmp_path / "train", counts),
        val_path=write_tfrecords(tmp_path / "val", val_counts, prefix="val", first=sum(counts)),
        shape=[4, 4, 1],
        num_classes=total,
    )
    return data.load(cfg)


def epochs_of_ids(source, batch, rank, size, epochs=2, seed=5):
    """Sample ids of this rank's batches, one array per epoch; checks image and id agree."""
    dataset, steps = data.train_dataset(source, batch, rank, size, seed=seed)
    batches = list(dataset.take(epochs * steps).as_numpy_iterator())
    for x, y in batches:
        assert x.shape == (batch, 4, 4, 1) and x.dtype == np.float32
        assert np.allclose(x.reshape(batch, -1) * 255, y[:, None], atol=1e-3)
    ids = [
        np.concatenate([y for _, y in batches[e * steps : (e + 1) * steps]]) for e in range(epochs)
    ]
    return ids, steps


def check_epochs_disjoint_and_cover(source, batch, size, num_samples):
    per_rank = [epochs_of_ids(source, batch, r, size) for r in range(size)]
    assert len({steps for _, steps in per_rank}) == 1  # the same steps on every rank
    for epoch in range(2):
        shards = [ids[epoch] for ids, _ in per_rank]
        union = np.concatenate(shards)
        assert sorted(union.tolist()) == list(range(num_samples))  # disjoint, covering
    return [ids for ids, _ in per_rank]


def test_tfrecord_by_file_when_files_reach_the_ranks(tmp_path):
    source = record_source(tmp_path, [4] * 6)
    assert source.train_counts == [4] * 6 and data.records_per_rank([4] * 6, 3) == ("file", 8)
    shards = check_epochs_disjoint_and_cover(source, batch=4, size=3, num_samples=24)
    for rank, (epoch0, epoch1) in enumerate(shards):
        assert not np.array_equal(epoch0, epoch1)  # another order each epoch
        # Rank r reads files r, r+3 of that epoch's permutation of the file list.
        for epoch, ids in enumerate((epoch0, epoch1)):
            files = data.shard_indices(6, rank, 3, epoch, seed=5)
            assert sorted(set(ids // 4)) == sorted(files)


def test_tfrecord_by_record_with_fewer_files_than_ranks(tmp_path):
    source = record_source(tmp_path, [6, 6])
    assert data.records_per_rank([6, 6], 3) == ("record", 4)
    shards = check_epochs_disjoint_and_cover(source, batch=2, size=3, num_samples=12)
    assert any(set(e0) != set(e1) for e0, e1 in shards)  # a new split each epoch
    assert all(not np.array_equal(e0, e1) for e0, e1 in shards)


def test_tfrecord_steps_are_what_the_poorest_rank_gets_in_any_epoch(tmp_path):
    counts = [1, 2, 3, 4, 5]
    # By file: a rank gets 2 of the 5 files, at worst the two smallest (1 + 2 records).
    assert data.records_per_rank(counts, 2) == ("file", 3)
    assert data.records_per_rank(counts, 6) == ("record", 15 // 6)
    source = record_source(tmp_path, counts)
    for rank in range(2):
        _, steps = data.train_dataset(source, 1, rank, 2, seed=0)
        assert steps == 3
    with pytest.raises(data.DataError, match="not one batch of 4"):
        data.train_dataset(source, 4, 0, 2)


def test_tfrecord_validation_is_split_once_over_the_ranks(tmp_path):
    source = record_source(tmp_path, [4] * 3, val_counts=(2, 3, 1, 2))
    first_val = sum(source.train_counts)
    for size in (2, 4, 5):  # by file (2, 4); by record (5 ranks, 4 files)
        parts = [
            np.concatenate([y for _, y in data.validation_dataset(source, 2, r, size)])
            for r in range(size)
        ]
        assert all(len(p) for p in parts)
        union = sorted(np.concatenate(parts).tolist())
        assert union == list(range(first_val, first_val + 8))
    with pytest.raises(data.DataError, match="8 validation records are fewer than the 9 ranks"):
        data.validation_dataset(source, 2, 0, 9)


def test_tfrecord_holds_out_whole_files_without_val_path(tmp_path):
    pattern = write_tfrecords(tmp_path / "train", [2] * 5)
    cfg = DataConfig(source="tfrecord", path=pattern, shape=[4, 4, 1], num_classes=10)
    source = data.load(cfg)
    assert len(source.val_files) == 1 and len(source.train_files) == 4
    assert sorted(source.train_files + source.val_files) == sorted(tf.io.gfile.glob(pattern))
    assert data.load(cfg).val_files == source.val_files  # seeded
    single = DataConfig(source="tfrecord", path=str(tmp_path / "train" / "train-00.tfrecord"))
    with pytest.raises(data.DataError, match=r"matches one file; .* or set data\.val_path"):
        data.load(single)


def test_tfrecord_cached_in_memory_is_the_same_data(tmp_path):
    source = record_source(tmp_path, [4] * 3)
    assert data.fits_in_memory(source, local_size=2, available=10**9)
    assert not data.fits_in_memory(source, local_size=2, available=data.decoded_bytes(source))
    arrays = data.decode_into_memory(source)
    assert arrays.x_train.dtype == np.uint8 and arrays.x_train.shape == (12, 4, 4, 1)
    assert sorted(arrays.y_train.tolist()) == list(range(12))
    assert np.array_equal(arrays.x_train[:, 0, 0, 0], arrays.y_train)
    assert sorted(arrays.y_val.tolist()) == list(range(12, 18))
    check_epochs_disjoint_and_cover(arrays, batch=2, size=3, num_samples=12)


def test_tfrecord_problems_are_one_line_errors(tmp_path):
    cfg = DataConfig(source="tfrecord", path=str(tmp_path / "*.tfrecord"), shape=[4, 4, 1])
    with pytest.raises(data.DataError, match=r"data.path: no files match '.*\*\.tfrecord'"):
        data.load(cfg)
    write_tfrecords(tmp_path, [3, 3])
    truncated = tmp_path / "train-01.tfrecord"
    truncated.write_bytes(truncated.read_bytes()[:-5])
    with pytest.raises(data.DataError, match="not an uncompressed TFRecord file, or truncated"):
        data.load(DataConfig(source="tfrecord", path=str(tmp_path / "train-*.tfrecord")))
    with tf.io.TFRecordWriter(str(tmp_path / "text.tfrecord")) as writer:
        writer.write(b"not an Example")
    with pytest.raises(
        data.DataError, match=r"records need a feature 'image'|not a tf\.train\.Example"
    ):
        data.load(
            DataConfig(
                source="tfrecord",
                path=str(tmp_path / "text.tfrecord"),
                val_path=str(tmp_path / "train-00.tfrecord"),
            )
        )


def write_image_dir(root, per_class, sizes=((5, 7), (4, 4))):
    """Class folders of constant-valued PNGs (value = sample id), of several sizes."""
    sample = 0
    for name, count in per_class.items():
        (root / name / "sub").mkdir(parents=True)
        for i in range(count):
            height, width = sizes[i % len(sizes)]
            folder = root / name / ("sub" if i % 2 else "")
            (folder / f"{i}.png").write_bytes(encoded_png(10 + sample, height, width))
            sample += 1
    (root / "notes.txt").write_text("not a class")
    return sample


def test_image_dir_lists_classes_splits_and_shards(tmp_path):
    total = write_image_dir(tmp_path, {"emu": 6, "cat": 8, "dog": 6})
    cfg = DataConfig(source="image_dir", path=str(tmp_path), shape=[4, 4, 3], seed=3)
    source = data.load(cfg)
    assert source.class_names == ["cat", "dog", "emu"] and source.num_classes == 3
    assert (len(source.train_paths), len(source.val_paths)) == (16, 4)
    assert not set(source.train_paths) & set(source.val_paths)
    for path, label in zip(source.train_paths, source.train_labels, strict=True):
        assert path.split("/")[len(str(tmp_path).split("/"))] == source.class_names[label]
    assert data.load(cfg).val_paths == source.val_paths  # a seeded split

    per_rank = []
    for rank in range(2):
        dataset, steps = data.train_dataset(source, 4, rank, 2, seed=1)
        assert steps == 2
        batches = list(dataset.take(2 * steps).as_numpy_iterator())
        assert all(
            x.shape == (4, 4, 4, 3) and np.ptp(x, axis=(1, 2, 3)).max() == 0 for x, _ in batches
        )
        values = [np.rint(x[:, 0, 0, 0] * 255).astype(int) for x, _ in batches]
        per_rank.append([np.concatenate(values[:steps]), np.concatenate(values[steps:])])
    for epoch in range(2):
        union = np.concatenate([ids[epoch] for ids in per_rank])
        assert len(set(union.tolist())) == 16  # disjoint, all training images
    assert not np.array_equal(per_rank[0][0], per_rank[0][1])

    val = [
        np.concatenate([y for _, y in data.validation_dataset(source, 3, r, 3)]) for r in range(3)
    ]
    assert sorted(np.concatenate(val).tolist()) == sorted(source.val_labels.tolist())
    cached = data.decode_into_memory(source)
    assert cached.x_train.shape == (16, 4, 4, 3) and cached.num_classes == 3
    assert sorted(cached.x_train[:, 0, 0, 0].tolist() + cached.x_val[:, 0, 0, 0].tolist()) == list(
        range(10, 10 + total)
    )


def test_image_dir_val_path_and_problems(tmp_path):
    write_image_dir(tmp_path / "train", {"a": 2, "b": 2})
    write_image_dir(tmp_path / "val", {"b": 1})
    cfg = DataConfig(
        source="image_dir",
        path=str(tmp_path / "train"),
        val_path=str(tmp_path / "val"),
        shape=[4, 4, 1],
    )
    source = data.load(cfg)
    assert len(source.train_paths) == 4 and source.val_labels.tolist() == [1]
    write_image_dir(tmp_path / "odd", {"zebra": 1})
    cfg.val_path = str(tmp_path / "odd")
    with pytest.raises(data.DataError, match=r"class folder\(s\) zebra are not in data\.path"):
        data.load(cfg)
    cfg.path = str(tmp_path / "nowhere")
    with pytest.raises(data.DataError, match=r"data\.path: '.*/nowhere' does not exist"):
        data.load(cfg)


def test_mnist_from_keras_cache_and_the_missing_file_message(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    cfg = DataConfig(source="mnist")
    with pytest.raises(data.DataError) as info:
        data.load(cfg)
    assert str(info.value) == (
        f"mnist: {tmp_path}/datasets/mnist.npz not found; download "
        "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz there "
        "(no network here)"
    )
    rng = np.random.default_rng(0)
    (tmp_path / "datasets").mkdir()
    np.savez(
        tmp_path / "datasets" / "mnist.npz",
        x_train=rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
        y_train=np.arange(12, dtype=np.uint8) % 10,
        x_test=rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        y_test=np.arange(5, dtype=np.uint8),
    )
    arrays = data.load(cfg)
    assert arrays.input_shape == (28, 28, 1) and arrays.num_classes == 10
    assert (len(arrays.x_train), len(arrays.x_val)) == (12, 5)
    x, y = next(data.validation_dataset(arrays, 5, 0, 1).as_numpy_iterator())
    assert x.dtype == np.float32 and x.min() >= 0 and x.max() <= 1 and y.tolist() == [0, 1, 2, 3, 4]
    assert np.allclose(x * 255, arrays.x_val)


def cifar_batch(images, labels):
    rows = images.transpose(0, 3, 1, 2).reshape(len(images), -1)  # CIFAR's channel-major rows
    return {b"batch_label": b"fake", b"labels": list(labels), b"data": rows, b"filenames": []}


@pytest.mark.parametrize("layout", ["folder", "archive"])
def test_cifar10_from_keras_cache(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    with pytest.raises(
        data.DataError, match=r"cifar10: .*/cifar-10-batches-py\.tar\.gz not found \(nor"
    ):
        data.load(DataConfig(source="cifar10"))
    rng = np.random.default_rng(1)
    folder = tmp_path / "datasets" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    images = rng.integers(0, 256, (6, 3, 32, 32, 3), dtype=np.uint8)
    for i, name in enumerate([*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"]):
        with (folder / name).open("wb") as f:
            pickle.dump(cifar_batch(images[i], [i, 9 - i, i]), f, protocol=2)
    if layout == "archive":
        with tarfile.open(tmp_path / "datasets" / "cifar-10-python.tar.gz", "w:gz") as tar:
            tar.add(folder, arcname="cifar-10-batches-py")
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    arrays = data.load(DataConfig(source="cifar10"))
    assert arrays.x_train.shape == (15, 32, 32, 3) and arrays.x_val.shape == (3, 32, 32, 3)
    assert np.array_equal(arrays.x_train, images[:5].reshape(15, 32, 32, 3))
    assert np.array_equal(arrays.x_val, images[5])
    assert arrays.y_train.tolist()[:6] == [0, 9, 0, 1, 8, 1] and arrays.y_val.tolist() == [5, 4, 5]


def test_cifar10_refuses_pickles_that_run_code(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    folder = tmp_path / "datasets" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    with (folder / "data_batch_1").open("wb") as f:
        pickle.dump({b"data": print}, f, protocol=2)
    with pytest.raises(
        data.DataError, match=r"not a CIFAR-10 python batch \(refusing to load __builtin__\.print\)"
    ):
        data.load(DataConfig(source="cifar10"))


def test_tfrecord_labels_outside_num_classes_are_caught(tmp_path):
    source = record_source(tmp_path, [4, 4])  # training labels 0..7
    source.num_classes = 5
    with pytest.raises(data.DataError, match=r"a label outside \[0, 5\) \(data.num_classes\)"):
        data.decode_into_memory(source)
    dataset, steps = data.train_dataset(source, 4, 0, 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"a label outside \[0, 5\)"):
        list(dataset.take(2 * steps))


def check_error(cfg) -> str:
    """`sources.check`'s one-line message for `cfg`; `load` must fail with the same one."""
    with pytest.raises(data.DataError) as info:
        sources.check(cfg)
    message = str(info.value)
    assert "\n" not in message
    with pytest.raises(data.DataError) as loaded:
        data.load(cfg)
    assert str(loaded.value) == message
    return message


def test_check_npz_reads_the_zip_directory_only(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, x_train=np.zeros((4, 2)), y_train=np.arange(4), x_val=np.zeros((2, 2)))
    np.savez(tmp_path / "arrays.npz", x=np.zeros(3))
    np.save(tmp_path / "plain.npy", np.zeros(3))
    (tmp_path / "folder.npz").mkdir()
    npz = {
        name: DataConfig(source="npz", path=str(tmp_path / name))
        for name in ("missing.npz", "folder.npz", "plain.npy", "arrays.npz", "good.npz")
    }
    assert check_error(npz["missing.npz"]) == (
        f"data.path: data file {tmp_path}/missing.npz does not exist"
    )
    assert check_error(npz["folder.npz"]) == (
        f"data.path: data file {tmp_path}/folder.npz is a directory, not an .npz file"
    )
    assert check_error(npz["plain.npy"]) == (
        f"data.path: data file {tmp_path}/plain.npy is not a readable .npz archive "
        "(File is not a zip file)"
    )
    assert check_error(npz["arrays.npz"]) == (
        f"data.path: data file {tmp_path}/arrays.npz is missing array(s) x_train, y_train "
        "(has ['x'])"
    )
    assert check_error(npz["good.npz"]).endswith("has x_val without y_val (they come together)")
    np.savez(good, x_train=np.zeros((4, 2)), y_train=np.arange(4))
    assert sources.check(npz["good.npz"]) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_check_npz_unreadable(tmp_path):
    path = tmp_path / "locked.npz"
    np.savez(path, x_train=np.zeros((4, 2)), y_train=np.arange(4))
    path.chmod(0)
    assert check_error(DataConfig(source="npz", path=str(path))) == (
        f"data.path: data file {path} cannot be read (Permission denied)"
    )


def test_check_tfrecord_globs(tmp_path):
    pattern = str(tmp_path / "train-*.tfrecord")
    cfg = DataConfig(source="tfrecord", path=pattern, shape=[4, 4, 1])
    assert check_error(cfg) == f"data.path: no files match {pattern!r}"
    write_tfrecords(tmp_path, [3])
    assert "matches one file; holding out validation files needs two or more" in check_error(cfg)
    cfg.val_path = str(tmp_path / "val-*.tfrecord")
    assert check_error(cfg) == f"data.val_path: no files match {cfg.val_path!r}"
    write_tfrecords(tmp_path, [2], prefix="val")
    assert sources.check(cfg) is None


def test_check_image_dir(tmp_path):
    cfg = DataConfig(source="image_dir", path=str(tmp_path / "train"), shape=[4, 4, 1])
    assert check_error(cfg) == f"data.path: '{tmp_path}/train' does not exist"
    (tmp_path / "train").write_text("a file")
    assert check_error(cfg) == f"data.path: '{tmp_path}/train' is not a directory"
    (tmp_path / "train").unlink()
    write_image_dir(tmp_path / "train", {"a": 2})
    assert check_error(cfg).endswith("needs one folder per class, two or more")
    write_image_dir(tmp_path / "train", {"b": 2})  # a second class
    (tmp_path / "val" / "zebra").mkdir(parents=True)
    cfg.val_path = str(tmp_path / "val")
    assert "class folder(s) zebra are not in data.path" in check_error(cfg)
    (tmp_path / "val" / "zebra").rmdir()
    (tmp_path / "val" / "b").mkdir()
    assert sources.check(cfg) is None


@pytest.mark.parametrize("source", ["digits", "mnist_5k", "synthetic", "mnist", "cifar10"])
def test_check_has_nothing_to_check_for_sources_without_files(source, tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))  # mnist, cifar10: missing, found by load
    assert sources.check(DataConfig(source=source)) is None


def test_check_needs_no_tensorflow(tmp_path):
    np.savez(tmp_path / "good.npz", x_train=np.zeros((4, 2)), y_train=np.arange(4))
    code = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
        "from hvd_train.core.config import DataConfig\n"
        "from hvd_train.data import sources\n"
        f"sources.check(DataConfig(source='npz', path={str(tmp_path / 'good.npz')!r}))\n"
        "try:\n"
        "    sources.check(DataConfig(source='tfrecord', path='/nowhere/*'))\n"
        "except sources.DataError as err:\n"
        "    print(err)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout == "data.path: no files match '/nowhere/*'\n"
