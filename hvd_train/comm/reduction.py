"""Two-level reduction across hosts, built from process sets (Horovod 0.28.1 switches its own
hierarchical allreduce off without NCCL: "Hierarchical allreduce is not supported without NCCL or
DDL", operations.cc).

Per group of tensors, for each dtype in the group (flattened into one buffer, zero-padded to a
multiple of the host's rank count): a reduce-scatter among the ranks of one host, an allreduce
across hosts among the ranks of equal local rank (each carries 1/local_size of the buffer), an
allgather among the ranks of one host. Across hosts each host then sends S (the group's bytes)
each way, where a flat ring of n ranks sends 2 (n - 1) / n x S per rank (1.5 x S per host at
2 hosts x 2 slots).

The process sets (one per host, one per local rank) are added after `init` with
`collectives.add_process_set` (Horovod's dynamic process sets), because the host grouping is
Horovod's topology, known only once it has started; `init` switches dynamic process sets on where
the launcher says the job spans hosts (`wants_dynamic_process_sets`), so that a job on one host
pays nothing for them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_train.comm import collectives
from hvd_train.core.config import REDUCTIONS

# Overrides optimizer.reduction (docs/knobs.md).
REDUCTION_ENV = "HVD_TRAIN_REDUCTION"
DYNAMIC_ENV = collectives.DYNAMIC_ENV
_SCALES = ("compression", "prescale_factor", "postscale_factor")


def reduction_rule(
    mode: str, local_sizes: Sequence[int] | None, elastic: bool, dynamic_process_sets: bool
) -> str:
    """Flat or two-level reduction for this job (a pure rule).

    "flat" is "flat". "two_level" is "two_level" where it can run: every host with as many ranks,
    the hosts told apart, fixed workers (not elastic), Horovod started with dynamic process sets;
    elsewhere a ValueError says why. "auto" is "flat": measured on the cluster at 2 hosts x 2
    slots (docs/cluster.md, "Two-level reduction"), two-level moves a third fewer bytes across
    hosts than Gloo's ring (Open MPI's own allreduce already moves as few), but its two stages
    within the host cost more CPU time than the bytes save at every link rate but 100 Mbit/s,
    and the link rate is not known when the optimizer is built.

    Args:
      mode: "auto", "flat" or "two_level".
      local_sizes: the number of ranks on each host, hosts in order; None where the ranks' hosts
        cannot be told apart (`host_groups`).
      elastic: the job runs under Horovod Elastic (its workers, hence its hosts, change).
      dynamic_process_sets: HOROVOD_DYNAMIC_PROCESS_SETS=1 was set when Horovod started.

    Returns:
      "flat" or "two_level".

    Raises:
      ValueError: an unknown mode, or "two_level" asked where it cannot run (one line, why).
    """
    if mode not in REDUCTIONS:
        raise ValueError(f"reduction {mode!r}: expected one of {', '.join(REDUCTIONS)}")
    if mode in ("flat", "auto"):
        return "flat"
    if elastic:
        problem = "it cannot run under elastic training (the hosts change)"
    elif local_sizes is None:
        problem = "the ranks' hosts cannot be told apart (host names repeat across hosts)"
    elif len(set(local_sizes)) > 1:
        problem = f"the hosts run unequal numbers of ranks ({', '.join(map(str, local_sizes))})"
    elif not dynamic_process_sets:
        problem = (
            f"Horovod started without {DYNAMIC_ENV}=1 (comm.init sets it across hosts; "
            f"on one host set it, or {REDUCTION_ENV}=two_level, in the launcher's environment)"
        )
    else:
        problem = None
    if problem is not None:
        raise ValueError(f"reduction 'two_level' is not possible here: {problem}")
    return "two_level"


def wants_dynamic_process_sets(
    environ: Mapping[str, str], size: int | None, local_size: int | None
) -> bool:
    """Whether `init` switches Horovod's dynamic process sets on, before Horovod starts: the job
    spans hosts (the launcher's local size below its size) or HVD_TRAIN_REDUCTION=two_level; not
    where it is elastic, HVD_TRAIN_REDUCTION=flat, or the user set HOROVOD_DYNAMIC_PROCESS_SETS.

    Every rank must decide alike (a job whose ranks differ in it hangs), so the rule reads only
    what is the same on every rank: the variables (the launchers forward them) and whether the
    job spans hosts (a rank's local size is below the size on every host or on none), not the
    ranks per host, which may differ. Dynamic mode adds an exchange of two integers among all
    ranks to every Horovod cycle, so a job on one host gets it only when asked.
    """
    if DYNAMIC_ENV in environ or environ.get("HOROVOD_ELASTIC") == "1":
        return False
    asked = environ.get(REDUCTION_ENV)
    if asked in ("flat", "two_level"):
        return asked == "two_level"
    return size is not None and local_size is not None and local_size < size


def override(mode: str, environ: Mapping[str, str] | None = None) -> str:
    """`mode`, unless HVD_TRAIN_REDUCTION is set: then its value.

    Raises:
      ValueError: HVD_TRAIN_REDUCTION is not one of `REDUCTIONS`.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(REDUCTION_ENV)
    if value is None or value == "":
        return mode
    if value not in REDUCTIONS:
        raise ValueError(f"{REDUCTION_ENV}={value!r}: expected one of {', '.join(REDUCTIONS)}")
    return value


def group_hosts(places: Sequence[tuple[int, str, int, int]]) -> list[list[int]] | None:
    """The ranks of each host from every rank's (rank, host name, local rank, local size), hosts
    in order of their lowest rank; None where the names do not match Horovod's local ranks (two
    hosts of one name)."""
    by_name: dict[str, list[int]] = {}
    for rank, name, _, _ in sorted(places):
        by_name.setdefault(name, []).append(rank)
    for rank, name, local_rank, local_size in places:
        host = by_name[name]
        if len(host) != local_size or host.index(rank) != local_rank:
            return None
    return list(by_name.values())


_hosts: list[list[int]] | None = None
_hosts_known = False


def host_groups() -> list[list[int]] | None:
    """The ranks of each host (`group_hosts` of every rank's place). A collective over all ranks
    the first time after `init`; then remembered until `forget`."""
    global _hosts, _hosts_known
    if not _hosts_known:
        from hvd_train.comm import runtime  # which imports this module

        here = runtime.topology()
        place = (here.rank, socket.gethostname(), here.local_rank, here.local_size)
        _hosts = group_hosts(collectives.allgather_object(place, name="hvd_train.hosts"))
        _hosts_known = True
    return _hosts


def resolve_reduction(mode: str = "auto") -> str:
    """The reduction this job uses for `mode` (HVD_TRAIN_REDUCTION overrides it), by
    `reduction_rule` on the job's hosts; "two_level" also adds the hosts' process sets. Call it
    on every rank after `init` (for "two_level", a collective).

    Args:
      mode: "auto", "flat" or "two_level".

    Returns:
      "flat" or "two_level".

    Raises:
      ValueError: an unknown mode, or "two_level" where it cannot run (one line).
    """
    mode = override(mode)
    if mode != "two_level":
        return reduction_rule(mode, None, elastic=False, dynamic_process_sets=False)
    elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
    groups = None if elastic else host_groups()  # elastic: refused whatever the hosts
    chosen = reduction_rule(
        mode,
        None if groups is None else [len(g) for g in groups],
        elastic=elastic,
        dynamic_process_sets=os.environ.get(DYNAMIC_ENV) == "1",
    )
    if chosen == "two_level":
        _sets_for(groups)
    return chosen


def check_local_groups(local_groups: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """`local_groups` as sorted rank lists in order of their lowest rank, checked: a partition of
    the ranks 0 .. size-1 into groups of one size.

    Raises:
      ValueError: not such a partition.
    """
    groups = sorted(sorted(int(r) for r in g) for g in local_groups)
    flat = [r for g in groups for r in g]
    if sorted(flat) != list(range(size)) or not groups:
        raise ValueError(f"local_groups {groups} must split the ranks 0..{size - 1} among them")
    if len({len(g) for g in groups}) != 1:
        raise ValueError(f"local_groups {groups} must all hold as many ranks")
    return groups


def _set(ranks: Sequence[int], size: int) -> Any:
    """The process set of these ranks: None for all ranks (the global set), "self" for one rank
    (nothing to exchange), else the job's set of them (added now if new: a collective of all
    ranks)."""
    if len(ranks) == 1 and size > 1:
        return "self"
    return collectives.process_set_of(ranks)


def _sets_for(local_groups: Sequence[Sequence[int]]) -> tuple[Any, Any, int]:
    """This rank's (host set, cross set, ranks per host) for these host groups, the sets of every
    host then of every local rank added in that order on every rank."""
    from hvd_train.comm import runtime

    size, rank = runtime.size(), runtime.rank()
    groups = check_local_groups(local_groups, size)
    crosses = [list(ranks) for ranks in zip(*groups, strict=True)]
    hosts = [_set(g, size) for g in groups]
    cross_sets = [_set(c, size) for c in crosses]
    mine = next(i for i, g in enumerate(groups) if rank in g)
    return hosts[mine], cross_sets[groups[mine].index(rank)], len(groups[0])


def forget() -> None:
    """Drop the remembered hosts and process sets (Horovod restarted: elastic reset)."""
    global _hosts, _hosts_known
    _hosts, _hosts_known = None, False
    collectives.forget_process_sets()


def _scaled(x: tf.Tensor, factor: float) -> tf.Tensor:
    """`factor` * x rounded as Horovod's CPU scaling rounds it: float16 and float32 in float32,
    the other types in double."""
    if factor == 1.0:
        return x
    wide = tf.float32 if x.dtype in (tf.float16, tf.float32) else tf.float64
    return tf.cast(tf.cast(x, wide) * tf.constant(factor, wide), x.dtype)


@tf.autograph.experimental.do_not_convert  # plain Python over the group's structure
def two_level_allreduce(
    tensors: Sequence[tf.Tensor],
    op: Any,
    local_groups: Sequence[Sequence[int]] | None = None,
    **kwargs: Any,
) -> list[tf.Tensor]:
    """The allreduce of one group of tensors in two levels (see the module). The same results as
    `collectives.grouped_allreduce(tensors, op, **kwargs)` up to the order of the additions.

    Args:
      tensors: the group (any shapes and dtypes Horovod reduces), the same on every rank.
      op: `Average` or `Sum`.
      local_groups: the ranks of each "host"; None: the job's hosts (`host_groups`). Tests emulate
        hosts on one machine with it.
      **kwargs: compression, prescale_factor, postscale_factor (as Horovod's).

    Returns:
      The reduced tensors, in order, with the inputs' shapes and dtypes.

    Raises:
      ValueError: another op, unusable local groups, or hosts that cannot be told apart.
      TypeError: a keyword other than those above.
    """
    unknown = sorted(set(kwargs) - set(_SCALES))
    if unknown:
        raise TypeError(f"two-level reduction takes no {', '.join(unknown)}")
    if op not in (collectives.Average, collectives.Sum):
        raise ValueError("two-level reduction supports Average and Sum only")
    if local_groups is None:
        local_groups = host_groups()
        if local_groups is None:
            raise ValueError("two-level reduction: the ranks' hosts cannot be told apart")
    from hvd_train.comm import runtime

    host_set, cross_set, per_host = _sets_for(local_groups)
    compression = kwargs.get("compression", collectives.Compression.none)
    # Horovod's factors are float32 attributes; Average is a Sum scaled by postscale / size, in
    # double: the same numbers here give the flat allreduce's roundings.
    pre = float(np.float32(kwargs.get("prescale_factor", 1.0)))
    post = float(np.float32(kwargs.get("postscale_factor", 1.0)))
    if op == collectives.Average:
        post /= runtime.size()
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    by_dtype: dict[tf.DType, list[int]] = {}
    for i, (t, _) in enumerate(compressed):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[Any] = [None] * len(tensors)
    for indices in by_dtype.values():
        parts = [compressed[i][0] for i in indices]
        flat = tf.concat([tf.reshape(p, [-1]) for p in parts], axis=0)
        count = tf.size(flat)
        padded = tf.pad(flat, [[0, tf.math.floormod(-count, per_host)]])
        if host_set == "self":
            piece = _scaled(padded, pre)
        else:
            piece = collectives.grouped_reducescatter(
                [padded], op=collectives.Sum, process_set=host_set, prescale_factor=pre
            )[0]
        if cross_set != "self":
            piece = collectives.grouped_allreduce(
                [piece], op=collectives.Sum, process_set=cross_set
            )[0]
        piece = _scaled(piece, post)
        if host_set != "self":
            piece = collectives.allgather(piece, process_set=host_set)
        sizes = [tf.size(p) for p in parts]
        for i, p, chunk in zip(indices, parts, tf.split(piece[:count], sizes), strict=True):
            out[i] = compression.decompress(tf.reshape(chunk, tf.shape(p)), compressed[i][1])
    return out
