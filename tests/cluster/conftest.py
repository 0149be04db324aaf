"""The cluster tier: real hosts on this machine (`mpi_scripts/cluster/cluster.sh`, docs/cluster.md).

Needs root and CAP_NET_ADMIN. With CI=true a cluster that cannot be brought up is a failure;
elsewhere the tier skips with one line saying why. One cluster serves the whole session and is
always taken down at its end, and the machine must then be as it was before.
"""

from __future__ import annotations

import fcntl
import os

import pytest
from hosts import HOSTS, LOCK, STATE, Cluster, machine_state, script, unusable


@pytest.fixture(scope="session", autouse=True)
def usable() -> None:
    """Skip the tier (fail it under CI=true) where no cluster can be made."""
    reason = unusable()
    if reason and os.environ.get("CI") == "true":
        pytest.fail(reason)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def before() -> dict[str, object]:
    """The machine before any cluster of this session, which holds the machine's cluster lock
    throughout: the bridges and host names are the machine's, so one cluster runs at a time."""
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        script("down")  # one left by a killed session
        yield machine_state()


@pytest.fixture(scope="session")
def cluster(before: dict[str, object]) -> Cluster:
    """HOSTS hosts for the session, always taken down; the machine is then as before."""
    try:
        script("up")
        cluster = Cluster(STATE, [f"h{n}" for n in range(1, HOSTS + 1)])
        cluster.daemons = {host: cluster.pids(host) for host in cluster.hosts}
        yield cluster
    finally:
        script("down")
    assert machine_state() == before
