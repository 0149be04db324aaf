"""A reference ring allreduce with mpi4py and numpy: reduce-scatter, then allgather.

The data is cut into `size` segments. In the reduce-scatter, at step s each rank sends one segment
to its right neighbour and adds the segment it receives from its left one; after size-1 steps each
rank holds one fully summed segment. The allgather then passes the summed segments round the ring
in size-1 more steps. Every rank sends 2(size-1)/size of the data, the minimum for an allreduce
(Patarasuk and Yuan 2009), which is why Horovod and NCCL use rings for large messages. Segments are
sent in pieces of at most `chunk_bytes`, so that a piece's addition overlaps the next transfer.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def segment_bounds(length: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `size` nearly equal segments of `length` elements."""
    edges = np.linspace(0, length, size + 1).round().astype(int)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(size)]


def ring_allreduce(comm: Any, send: np.ndarray, chunk_bytes: int = 4 << 20) -> np.ndarray:
    """Sum `send` over all ranks of the mpi4py communicator; every rank gets the sum."""
    size, rank = comm.Get_size(), comm.Get_rank()
    data = np.array(send, copy=True).ravel()
    if size == 1:
        return data.reshape(send.shape)
    bounds = segment_bounds(data.size, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    piece = max(1, chunk_bytes // data.itemsize)
    longest = max(b - a for a, b in bounds)
    # The same number of pieces on every rank, so that every Sendrecv has its partner.
    offsets = range(0, longest, piece)
    scratch = np.empty(min(piece, longest), data.dtype)

    for step in range(size - 1):  # reduce-scatter
        out_lo, out_hi = bounds[(rank - step) % size]
        in_lo, in_hi = bounds[(rank - step - 1) % size]
        for offset in offsets:
            out = data[min(out_hi, out_lo + offset) : min(out_hi, out_lo + offset + piece)]
            n_in = max(0, min(in_hi, in_lo + offset + piece) - (in_lo + offset))
            comm.Sendrecv(out, dest=right, recvbuf=scratch[:n_in], source=left)
            data[in_lo + offset : in_lo + offset + n_in] += scratch[:n_in]

    for step in range(size - 1):  # allgather of the summed segments
        out_lo, out_hi = bounds[(rank - step + 1) % size]
        in_lo, in_hi = bounds[(rank - step) % size]
        for offset in offsets:
            out = data[min(out_hi, out_lo + offset) : min(out_hi, out_lo + offset + piece)]
            n_in = max(0, min(in_hi, in_lo + offset + piece) - (in_lo + offset))
            received = data[in_lo + offset : in_lo + offset + n_in]
            comm.Sendrecv(out, dest=right, recvbuf=received, source=left)
    return data.reshape(send.shape)


def check_ring(comm: Any) -> None:
    """Compare the ring with the MPI library's Allreduce on rank-built, uneven data (odd lengths,
    small chunks), bit for bit in float64; raises AssertionError on any difference."""
    rank = comm.Get_rank()
    for length in (1, 7, 1001, 65537):
        x = np.arange(length, dtype=np.float64) * (rank + 1) + rank
        for chunk_bytes in (64, 1 << 20):
            want = np.empty_like(x)
            comm.Allreduce(x, want)
            got = ring_allreduce(comm, x, chunk_bytes)
            if not np.array_equal(got, want):
                raise AssertionError(f"ring allreduce differs at length {length}")
