"""Keras callbacks that every distributed fit() needs: thin classes over `hvd_train.dist`."""

from __future__ import annotations

from typing import Any

import keras

from hvd_train import dist


class BroadcastInitialState(keras.callbacks.Callback):
    """Start every rank from rank 0's weights and optimizer state; checks the model is set up right.

    Put it in `callbacks` on every rank (it runs a collective: a callback added on rank 0 only hangs
    the job). Before the train function is built it turns XLA off (Horovod's ops have no XLA kernels
    in this build, and Keras turns jit_compile on by itself when a GPU is visible) and rejects a
    LossScaleOptimizer wrapped around the distributed optimizer, where one rank's overflow would
    skip the allreduce the others run. At train begin it broadcasts the state.
    """

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            return
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is not None and dist.is_distributed(inner) and not dist.is_distributed(optimizer):
            raise ValueError(
                "the model's LossScaleOptimizer wraps the distributed optimizer: create the "
                "DistributedOptimizer after setting the mixed_float16 policy (it then wraps the "
                "loss "
                "scaling itself, with the allreduce outside the finite check)"
            )
        if dist.size() > 1 and not dist.is_distributed(optimizer):
            raise ValueError(
                f"optimizer {optimizer.name!r} is not distributed: wrap it with "
                "hvd_train.DistributedOptimizer, or gradients are never averaged over ranks"
            )
        if dist.is_distributed(optimizer) and model.jit_compile:
            model.jit_compile = False
            model.train_function = None  # built with XLA by an earlier fit(): rebuild without

    def on_train_begin(self, logs: dict | None = None) -> None:
        dist.broadcast_model_state(self.model, self.root_rank)
