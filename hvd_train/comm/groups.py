"""Model groups: the ranks split into groups of G consecutive ranks, model parallel inside a group
(a `ShardedEmbedding`'s table split by rows over its G ranks) and data parallel across groups.

Group k holds ranks kG .. kG + G - 1. Launchers place consecutive ranks on one host (mpirun's and
srun's block placement, horovodrun's host order), so groups of G = slots per host, or a divisor of
it, look up rows over the host's own memory, and only the data-parallel reductions cross hosts.
The ranks at one place of every group (j, j + G, j + 2G, ...) hold the same rows: their replica
set, over which those rows' gradients are summed.

G = N (the default) is one group of all ranks: the table split over every rank, no replicas.
G = 1 splits nothing: every rank holds the whole table, data parallel like any other layer.

The process sets of the groups and of the replicas are registered with Horovod at start
(`comm.init(model_group_size=G)`), or added after it where dynamic process sets are on
(`model_groups(G)`, then a collective over all ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hvd_train.comm import collectives
from hvd_train.comm import horovod as backend

_job_group_size: int | None = None


@dataclass(frozen=True)
class ModelGroups:
    """This rank's model group.

    Attributes:
      size: ranks per group (G).
      rank: this rank's place in its group (0 .. G - 1).
      count: how many groups (N / G), hence replicas of each row.
      group: the process set of this rank's group; None where G is N (all ranks) or 1 (no
        lookup collective).
      replicas: the process set of the ranks at this place of every group; None where G is N
        (no other) or 1 (the table is not split: all ranks, as any other variable).
    """

    size: int
    rank: int
    count: int
    group: Any
    replicas: Any


def layout(size: int, group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of each group and of each replica set for `size` ranks in groups of
    `group_size`: ([[0 .. G-1], [G .. 2G-1], ...], [[0, G, ...], [1, G + 1, ...], ...]).

    Raises:
      ValueError: `group_size` is not a positive divisor of `size`.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"model_group_size must be a positive integer, got {group_size!r}")
    if size % group_size:
        raise ValueError(
            f"model_group_size {group_size} does not divide the {size} ranks of this job "
            "(every group holds as many ranks)"
        )
    groups = [list(range(k, k + group_size)) for k in range(0, size, group_size)]
    replicas = [list(range(j, size, group_size)) for j in range(group_size)]
    return groups, replicas


def sets_to_register(size: int, group_size: int) -> list[list[int]]:
    """The rank lists that need process sets of their own: those of more than one rank and fewer
    than all (every group, then every replica set); none where G is 1 or N."""
    groups, replicas = layout(size, group_size)
    return [ranks for ranks in groups + replicas if 1 < len(ranks) < size]


def set_job_group_size(group_size: int | None) -> None:
    """The job's G, given to `comm.init` (None: all ranks)."""
    global _job_group_size
    _job_group_size = group_size


def model_groups(group_size: int | None = None) -> ModelGroups:
    """This rank's model group for groups of `group_size` ranks (None: the job's, given to
    `comm.init`, else all ranks). A collective over all ranks the first time its process sets are
    added after the start (dynamic process sets).

    Raises:
      ValueError: `group_size` does not divide the ranks, or its process sets are neither
        registered at start nor addable (dynamic process sets off).
    """
    size, rank = backend.size(), backend.rank()
    group_size = group_size or _job_group_size or size
    groups, replicas = layout(size, group_size)
    group = replica = None
    if 1 < group_size < size:
        try:
            # Every rank asks for every set, in one order: adding one is a collective of all.
            sets = [collectives.process_set_of(ranks) for ranks in groups + replicas]
            group, replica = sets[rank // group_size], sets[len(groups) + rank % group_size]
        except collectives.ProcessSetUnavailable as err:
            raise ValueError(
                f"model groups of {group_size} ranks need their process sets: pass "
                f"model_group_size={group_size} to hvd_train.init ({err})"
            ) from err
    return ModelGroups(group_size, rank % group_size, size // group_size, group, replica)
