"""`hvd_train.horovod.tensorflow`: the package of `hvd_train.horovod.tensorflow.keras`, the Keras 3
twin of `horovod.tensorflow.keras`. Horovod's own `horovod.tensorflow` (tensors, GradientTape)
works on TensorFlow 2.21 and is not mirrored here."""
