"""A step whose grouped allreduces hold more tensors than Horovod's default response cache (1024
entries): 4 buckets of 300 tensors, STEPS steps (the argument; 100 by default), with the knobs
`hvd_train.init()` sets. For test_response_cache.py:

    python -m hvd_train.core.launch --np 2 -- .venv/bin/python \
        tests/integration/cache_groups.py [STEPS]

Every rank checks the sums against their closed form; rank 0 prints "groups ok" and Horovod's
cache capacity as the ranks ran with it.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from hvd_train import comm

GROUPS, PER_GROUP = 4, 300
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 100

comm.init(threads=1)
rank, size = comm.rank(), comm.size()
# Tensor j of group g holds (g * PER_GROUP + j) + rank: each sum is size * index + size(size-1)/2.
groups = [
    [tf.fill([3], float(g * PER_GROUP + j + rank)) for j in range(PER_GROUP)] for g in range(GROUPS)
]


@tf.function
def step():
    return [comm.grouped_allreduce([tf.identity(t) for t in g], op=comm.Sum) for g in groups]


for _ in range(STEPS):
    reduced = step()
for g, group in enumerate(reduced):
    for j, tensor in enumerate(group):
        expected = size * (g * PER_GROUP + j) + size * (size - 1) / 2
        np.testing.assert_array_equal(tensor.numpy(), np.full([3], expected, "float32"))
if rank == 0:
    print(f"groups ok, HOROVOD_CACHE_CAPACITY={os.environ.get('HOROVOD_CACHE_CAPACITY')}")
