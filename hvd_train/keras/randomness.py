"""Per-rank random streams: what is global and what each rank draws for itself.

Data parallelism trains like one process with an N times larger batch only if each rank's dropout
masks, noise and random augmentations are drawn independently: N ranks with one mask would apply
the same mask to every shard. So weights and optimizer state are global (broadcast from rank 0),
and so are the seed and the position (number of draws) of every random stream; the stream itself
is per rank, a documented function of (seed, rank):

- Keras 3: every `keras.random.SeedGenerator` of the model (Dropout, GaussianNoise, RandomFlip, ...)
  holds a state [seed, draws]. On rank r it is [rank_seed(seed, r), draws], where seed is rank 0's:
  rank r draws exactly what one process would draw from a generator built as
  `SeedGenerator(rank_seed(seed, r))`. Keras's global generator (`keras.random.*(seed=None)`)
  and TensorFlow's global seed follow the same rule.
- Keras 2: layers whose random generator is a `tf.random.Generator` (RandomFlip and the other
  preprocessing layers) are seeded rank_seed(seed, r) on rank r, like Keras 3's; the others
  (Dropout, GaussianNoise: TensorFlow's legacy stateful ops) draw from TensorFlow's global seed
  when the train function is traced, rank_seed(seed, r) on rank r. Their state lives in the op
  kernels, outside variables: a resumed Keras 2 run starts their streams anew.

Rank 0 keeps its seed (rank_seed(seed, 0) == seed), so rank 0 draws what one process would. The
position is broadcast with the weights, so a resumed run's ranks continue their streams where the
checkpoint (rank 0's state) left them, bit-exact in deterministic mode.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from hvd_train.keras import compat

_SEED_RANGE = 2**31 - 1  # seeds stay positive int32: every TensorFlow random op takes them


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s random streams in a job seeded with `seed` (rank 0: `seed`).

    sha256 of (seed, rank), so that neighbouring seeds and ranks give unrelated streams.
    """
    if rank == 0:
        return int(seed)
    digest = hashlib.sha256(f"hvd_train.rank_seed:{int(seed)}:{int(rank)}".encode()).digest()
    return 1 + int.from_bytes(digest[:8], "big") % (_SEED_RANGE - 1)


def random_state_variables(model: Any) -> list[Any]:
    """The variables of `model` that hold random state (Keras 3's seed generators; none in
    Keras 2, whose random ops keep their state outside variables)."""
    return [generator.state for generator in _seed_generators(model)]


def without_random_state(model: Any, variables: Iterable[Any]) -> list[Any]:
    """`variables` less the model's random state: what must agree on every rank."""
    random_ids = {id(v) for v in random_state_variables(model)}
    return [v for v in variables if id(v) not in random_ids]


def derive_rank_streams(model: Any, rank: int) -> None:
    """Turn this rank's random state into rank `rank`'s stream; local, after the broadcast.

    Keras 3: the model's generators hold rank 0's [seed, draws] (broadcast), and become
    [rank_seed(seed, rank), draws]; idempotent, as the broadcast brings rank 0's seed each time.
    The global Keras generator and TensorFlow's global seed, which are not broadcast, are derived
    once per process.
    """
    if rank == 0:
        return
    for generator in _seed_generators(model):
        _derive(generator, rank)
    for generator in _classic_generators(model):
        _derive_classic(generator, rank)
    if not compat.CLASSIC:
        from keras.src.backend.common import global_state

        generator = global_state.get_global_attribute("global_seed_generator")
        if generator is not None and not getattr(generator, "_hvd_train_rank", None):
            _derive(generator, rank)
            generator._hvd_train_rank = rank
    _derive_tf_global_seed(rank)


def _derive(generator: Any, rank: int) -> None:
    seed, draws = (int(x) for x in generator.state.numpy())
    generator.state.assign(tf.constant([rank_seed(seed, rank), draws], dtype=generator.state.dtype))


def _derive_classic(generator: Any, rank: int) -> None:
    """A Keras 2 `RandomGenerator` backed by a tf.random.Generator, once per process."""
    if getattr(generator, "_hvd_train_rank", None) == rank:
        return
    generator._hvd_train_rank = rank
    seed, inner = generator._seed, getattr(generator, "_generator", None)
    if inner is None:  # made at its first draw, from _seed (or one drawn as Keras would)
        generator._seed = rank_seed(generator._create_seed(None) if seed is None else seed, rank)
    elif seed is not None:
        inner.reset_from_seed(rank_seed(seed, rank))
    else:  # seeded from a draw Keras kept nowhere: its key stands for it
        inner.reset_from_seed(rank_seed(int(inner.state.numpy()[-1]), rank))


def _classic_generators(model: Any) -> list[Any]:
    if not compat.CLASSIC:
        return []
    generators = (getattr(layer, "_random_generator", None) for layer in _layers(model))
    return [g for g in generators if getattr(g, "_rng_type", None) == "stateful"]


def _layers(model: Any) -> list[Any]:
    return list(model._flatten_layers(include_self=True, recursive=True))


_tf_seed_set: int | None = None  # the global seed this module set: derived once per process


def _derive_tf_global_seed(rank: int) -> None:
    global _tf_seed_set
    seed = compat.tf_global_seed()
    if seed is None or seed == _tf_seed_set:
        return  # unseeded ops already differ by process
    _tf_seed_set = rank_seed(seed, rank)
    tf.random.set_seed(_tf_seed_set)


def _seed_generators(model: Any) -> list[Any]:
    if compat.CLASSIC:
        return []
    seen: dict[int, Any] = {}
    for layer in _layers(model):
        for generator in getattr(layer, "_seed_generators", ()):
            seen.setdefault(id(generator), generator)
    return list(seen.values())
