"""Gradient buckets: which gradients go out together in one grouped allreduce, and when.

The backward pass makes the gradients of the last layers first. Gradients are therefore taken in
reverse variable order (Keras orders a model's variables by layer) and cut into buckets of about
`bucket_bytes`: bucket 0 holds the last layers and can be sent while the backward pass is still
computing the earlier ones; only the last bucket waits for the whole pass. Membership is fixed by
the variables' sizes alone, so every rank and every step reduce the same tensors together in the
same order (the fused buffers, hence the sums' order and bit-exact resume, do not depend on
timing; Horovod keeps the groups apart under HOROVOD_DISABLE_GROUP_FUSION, which `comm.init`
sets).

The default size (`bucket_bytes`) follows from the topology and the link, as measured on the
cluster of docs/network.md:
- one bucket on one host, where the allreduce is a small part of the step and each further
  bucket only adds a negotiation;
- where the compute exactly fills every core of a CPU-only host (the transfer, driven by
  Horovod's thread, then shares the compute's core), it depends on the controller and the TCP
  rate between the hosts (`link_gbit`: `hvd-train launch --launcher auto` or the ranks measure it):
  under Gloo, which waits for its transfers in the kernel, buckets of `MIN_BUCKET_BYTES` hide
  part of a slow link's transfer behind the backward pass, and one bucket is faster from
  `GLOO_ONE_BUCKET_FROM_GBIT` up (each bucket's negotiation costs more than it hides); under
  Open MPI, which polls for them, one bucket is faster on a slow link (a bucket's polling takes
  the core for as long as its transfer lasts) and small buckets from
  `MPI_SMALL_BUCKETS_FROM_GBIT` up; an unknown rate keeps the slow link's choice;
- buckets of `MIN_BUCKET_BYTES` where a host's ranks share its cores (their backward passes, at
  a share of a core, last long enough for the link to carry most gradients while they run);
- otherwise about a quarter of the gradients per bucket, at least `MIN_BUCKET_BYTES` (each
  bucket pays a Horovod cycle and the ring's latency) and at most `MAX_BUCKET_BYTES` (PyTorch
  DDP's default cap).

A gradient of at least `alone_bytes` goes in a bucket of its own, where the small ones around it
keep filling theirs: Horovod copies every bucket of two or more tensors into its fusion buffer and
out again, on its one background thread, and reduces a bucket of one tensor in place. Under Open
MPI the copies cost more than the extra collectives, from `MIN_BUCKET_BYTES` up, on one host and
across hosts from `MPI_ALONE_FROM_GBIT`; below it each further collective costs more than the
copies (an unknown rate keeps that choice); under Gloo, whose every collective costs more than
Open MPI's, they never do (docs/performance.md, "Large gradients alone").
"""

from __future__ import annotations

from collections.abc import Sequence

MIB = 1 << 20
MIN_BUCKET_BYTES = 1 * MIB
MAX_BUCKET_BYTES = 25 * MIB
BUCKETS_ACROSS_HOSTS = 4
# Gbit/s of TCP between hosts whose cores the ranks' compute fills, from which the other bucket
# size steps faster (docs/network.md, "Bucket sizes by link rate").
GLOO_ONE_BUCKET_FROM_GBIT = 4.0
MPI_SMALL_BUCKETS_FROM_GBIT = 6.0
# Gbit/s of TCP between hosts from which Open MPI sends the large gradients alone (below it each
# further collective cost more than the copies it saves, on links with a 50 ms queue; with a
# 2 ms queue it did not: docs/network.md, "The cost of further collectives at 1 Gbit/s").
MPI_ALONE_FROM_GBIT = 2.0


def bucket_bytes(
    total_bytes: int,
    cross_size: int,
    bucket_mb: float | None,
    spare_cpu: bool = True,
    oversubscribed: bool = False,
    gloo: bool = False,
    link_gbit: float | None = None,
) -> int:
    """The bucket size in bytes; 0 means one bucket of everything.

    Args:
      total_bytes: bytes of all gradients of one step.
      cross_size: hosts in the job (Horovod's cross_size).
      bucket_mb: the user's choice in MiB (0: one bucket); None: derived from the topology.
      spare_cpu: every host keeps a core free of compute, or computes on GPUs (`comm.spare_cpu`).
      oversubscribed: some CPU-only host runs more compute threads than it has CPUs
        (`comm.oversubscribed`).
      gloo: the job's controller is Gloo, whose transfers overlap a busy core's compute where
        Open MPI's take the core from it (docs/network.md).
      link_gbit: the TCP rate between the hosts in Gbit/s (`comm.link_gbit`); None: unknown.
    """
    if bucket_mb is not None:
        return round(bucket_mb * MIB)
    if cross_size <= 1:
        return 0
    if spare_cpu:
        share = total_bytes // BUCKETS_ACROSS_HOSTS
        return min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, share))
    if oversubscribed:
        return MIN_BUCKET_BYTES
    fast = link_gbit is not None and link_gbit >= (
        GLOO_ONE_BUCKET_FROM_GBIT if gloo else MPI_SMALL_BUCKETS_FROM_GBIT
    )
    return MIN_BUCKET_BYTES if gloo != fast else 0


def alone_bytes(
    alone_mb: float | None,
    cross_size: int = 1,
    gloo: bool = False,
    link_gbit: float | None = None,
) -> int:
    """The size from which a gradient goes in a bucket of its own, in bytes; 0: none does.

    Args:
      alone_mb: the user's choice in MiB (0: none alone); None: derived.
      cross_size: hosts in the job (Horovod's cross_size).
      gloo: the job's controller is Gloo.
      link_gbit: the TCP rate between the hosts in Gbit/s (`comm.link_gbit`); None: unknown.
    """
    if alone_mb is not None:
        return round(alone_mb * MIB)
    if gloo:
        return 0
    if cross_size <= 1 or (link_gbit is not None and link_gbit >= MPI_ALONE_FROM_GBIT):
        return MIN_BUCKET_BYTES
    return 0


def layout(nbytes: Sequence[int], size: int, alone: int = 0) -> list[list[int]]:
    """Indices of the gradients in each bucket, in the order the buckets are sent.

    Walks the gradients from the last to the first and closes a bucket once it holds at least
    `size` bytes (so a bucket exceeds `size` by less than its last tensor); the rest forms the
    last bucket. `size <= 0` gives one bucket, also in reverse order. With `alone > 0`, a gradient
    of at least `alone` bytes is a bucket by itself, sent where the walk meets it; the smaller
    ones fill their buckets as before, across it.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(nbytes))):
        if 0 < alone <= nbytes[i]:
            buckets.append([i])
            continue
        current.append(i)
        filled += nbytes[i]
        if 0 < size <= filled:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets
