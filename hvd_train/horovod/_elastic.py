"""Horovod Elastic's Keras API (`horovod.tensorflow.keras.elastic`) on the toolkit's elastic state
(`hvd_train.training.elastic.TrainingState`) and run loop (`hvd_train.comm.elastic.run`).

Under `horovodrun --min-np ... --host-discovery-script ...`: `run(train)(state)` calls `train`
again after each reset (a worker lost: the state goes back to its last commit; hosts added or
removed: it stays), once Horovod has restarted with the workers now present and rank 0's state is
on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import keras

from hvd_train import comm as seam
from hvd_train.comm import elastic as comm_elastic
from hvd_train.training.elastic import TrainingState

run = comm_elastic.run


class KerasState(TrainingState):
    """A Keras model's and optimizer's variables, and the keyword attributes (e.g. epoch=0,
    batch=0), committed to host memory, restored after a failure, synced from rank 0 after every
    reset (Horovod's TensorFlowKerasState).

    Args:
      model: a compiled, built model.
      optimizer: accepted if it is the model's (Keras 3 trains with the compiled one).
      backend: accepted, unused (Horovod's Keras backend module).
      **kwargs: attributes to keep with the state, read and set as `state.name`.

    Raises:
      ValueError: an optimizer other than the model's, or a model without variables.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any):
        if optimizer is not None and optimizer is not model.optimizer:
            raise ValueError("KerasState: optimizer must be the model's compiled optimizer")
        if not model.variables:
            raise ValueError(f"KerasState: model {model.name!r} has no variables: build it first")
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # its slots are state too
        self._attributes = dict(kwargs)
        self._saved_attributes = copy.deepcopy(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        super().__init__(model)

    def save(self) -> None:
        """Copy the variables and the attributes to host memory."""
        super().save()
        self._saved_attributes = {n: copy.deepcopy(getattr(self, n)) for n in self._attributes}

    def restore(self) -> None:
        """Put the last commit back."""
        super().restore()
        for name, value in self._saved_attributes.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        """Rank 0's variables and attributes on every rank (collective); the train step is
        traced again, for the new number of workers."""
        with comm_elastic.collective_failures():
            attributes = seam.broadcast_object(
                {n: getattr(self, n) for n in self._attributes}, name="hvd_train.horovod.state"
            )
        for name, value in attributes.items():
            setattr(self, name, value)
        super().sync()  # then commits, attributes included
        self.model.train_function = None


TensorFlowKerasState = KerasState


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the state every `batches_per_commit` batches and at every epoch's end; each commit
    also checks (collective) for hosts added or removed.

    Args:
      state: the KerasState.
      batches_per_commit: batches between commits.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit  # alike on every rank after a reset

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep `state.batch` at the last finished batch of the epoch (0 at the epoch's end).

    Horovod also shortens the first epoch after a reset through fit's `params["steps"]`; Keras 3
    does not read it back, so pass `steps_per_epoch` to that fit yourself.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep `state.epoch` at the number of epochs done over all resets."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
