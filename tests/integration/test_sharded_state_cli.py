"""`optimizer.shard_state` from the command line: what is refused, in one line with exit code 2
(the sharded optimizer itself: tests/parallel/test_sharded_state.py)."""

from test_bad_input import assert_one_error, hvd_train


def test_elastic_with_shard_state_is_refused_before_tensorflow(tmp_path):
    args = ["train", "--elastic", "--set", "optimizer.shard_state=true"]
    result = hvd_train([*args, "--set", f"run_dir={tmp_path / 'run'}"])
    assert_one_error(result, "optimizer.shard_state: must be false with --elastic")


def test_train_refuses_shard_state_until_its_checkpoints_gather_the_shards(tmp_path):
    args = ["train", "--set", "optimizer.shard_state=true", "--set", f"run_dir={tmp_path / 'run'}"]
    result = hvd_train(args, tf_allowed=True)
    assert_one_error(result, "optimizer.shard_state: not yet with hvd-train train")
