"""The fits of one launch (`training.fit.segments`): a mid-epoch resume first finishes its epoch."""

from hvd_train.training.fit import Segment, segments


def test_a_fresh_start_is_one_fit_of_every_epoch():
    assert segments(0, 0, 12, 22) == [Segment(0, 12, 22, 0)]


def test_a_resume_after_an_epoch_starts_at_the_next():
    assert segments(3, 0, 12, 22) == [Segment(3, 12, 22, 0)]


def test_a_mid_epoch_resume_finishes_that_epoch_then_trains_the_rest():
    assert segments(3, 7, 12, 22) == [Segment(3, 4, 15, 7), Segment(4, 12, 22, 0)]


def test_a_mid_epoch_resume_in_the_last_epoch_is_one_short_fit():
    assert segments(11, 20, 12, 22) == [Segment(11, 12, 2, 20)]


def test_nothing_to_train_once_the_last_epoch_is_done():
    assert segments(12, 0, 12, 22) == []
    assert segments(5, 0, 5, 22) == []  # --stop-after-epochs reached
