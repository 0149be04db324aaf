"""Horovod's Keras API on Keras 3, on the toolkit's seams: existing Horovod scripts run with one
changed import.

    import horovod.tensorflow.keras as hvd  ->  import hvd_train.horovod.tensorflow.keras as hvd
    import horovod.keras as hvd             ->  import hvd_train.horovod.keras as hvd

Horovod 0.28's own Keras layer is built on Keras 2's optimizer internals (`get_gradients`,
`_compute_gradients`, `var.ref()`) and fails on Keras 3. These modules give its names, signatures
and semantics on `hvd_train.comm` (topology, process sets, collectives), `hvd_train.keras` (the
distributed optimizer, model state) and `hvd_train.callbacks`; nothing here imports horovod. Where
Horovod's behaviour was a known defect the name stays and the behaviour is the correct one
(docs/horovod.md lists each difference): the initial broadcast runs before the first step, not
after it, and metrics are reduced exactly over ranks, not as a mean of per-rank means.

The implementation is in `_api` (basics, collectives, optimizers, load_model), `_callbacks` and
`_elastic`; the public modules re-export it. Modern stack only: on Keras 2 Horovod's own module
works and is the one to use.
"""

import importlib.metadata

if int(importlib.metadata.version("keras").split(".")[0]) < 3:
    raise ImportError(
        "hvd_train.horovod is Horovod's Keras API for Keras 3; on Keras 2 use Horovod's own "
        "`import horovod.tensorflow.keras as hvd`, which works there"
    )
