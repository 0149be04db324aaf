"""Horovod's `horovod.keras.callbacks` on Keras 3: those of `hvd_train.horovod.tensorflow.keras`."""

from hvd_train.horovod.tensorflow.keras.callbacks import *  # noqa: F403 -- the same callbacks
from hvd_train.horovod.tensorflow.keras.callbacks import __all__  # noqa: F401
