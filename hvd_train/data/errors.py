"""The data package's error, kept apart so that every module (sharding.py, free of TensorFlow,
among them) can raise it without importing the others."""

from hvd_train.errors import UserError


class DataError(UserError):
    """Input data that cannot be used (one line, names the file or the array)."""
