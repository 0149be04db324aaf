"""Keras on Horovod: the distributed optimizer (Keras 3: the toolkit's own; Keras 2: Horovod's), the
stop flag it carries, SyncBatchNormalization, metric and BatchNorm-statistics reduction, the
learning-rate schedule, and `compat` (the facts that differ between Keras 2 and Keras 3).

Collectives come from `hvd_train.comm`; nothing here imports horovod.
"""
