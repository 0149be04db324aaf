"""Horovod's `horovod.keras.elastic` on Keras 3: that of `hvd_train.horovod.tensorflow.keras`."""

from hvd_train.horovod.tensorflow.keras.elastic import *  # noqa: F403 -- the same API
from hvd_train.horovod.tensorflow.keras.elastic import __all__  # noqa: F401
