"""`import hvd_train.horovod.keras as hvd`: Horovod's `horovod.keras` (standalone Keras) on Keras 3.

On Keras 3 `tf.keras` is `keras`, so this is the API of `hvd_train.horovod.tensorflow.keras`,
re-exported under the standalone name, `hvd.callbacks` and `hvd.elastic` included (the same
modules; `hvd_train.horovod.keras.callbacks` and `.elastic` re-export them for `from` imports).
"""

from hvd_train.horovod.tensorflow.keras import *  # noqa: F403 -- the same API, by design
from hvd_train.horovod.tensorflow.keras import __all__ as __all__
