"""The Horovod Keras module a script of this tier runs against: `HVD_API=hvd_train` (this
toolkit's, the default on Keras 3) or `HVD_API=horovod` (Horovod's own, the default on Keras 2).
`hvd_ops` holds the collectives Horovod's Keras module lacks (`horovod.tensorflow`'s there)."""

import importlib
import importlib.metadata
import os

KERAS_2 = importlib.metadata.version("keras").startswith("2.")
API = os.environ.get("HVD_API") or ("horovod" if KERAS_2 else "hvd_train")
MODULES = {"hvd_train": "hvd_train.horovod.tensorflow.keras", "horovod": "horovod.tensorflow.keras"}
hvd = importlib.import_module(MODULES[API])
hvd_ops = hvd if API == "hvd_train" else importlib.import_module("horovod.tensorflow")
