"""The cluster tier: real hosts on this machine (`mpi_scripts/cluster/cluster.sh`, docs/cluster.md).

Needs root and CAP_NET_ADMIN. With CI=true a cluster that cannot be brought up is a failure;
elsewhere the tier skips with one line saying why. One cluster serves the whole session and is
always taken down at its end, and the machine must then be as it was before.
"""

from __future__ import annotations

import os

import pytest
from hosts import HOSTS, STATE, Cluster, machine_state, script, unusable


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
    """The machine before any cluster of this session."""
    script("down")  # one left by a killed session
    return machine_state()


@pytest.fixture(scope="session")
def cluster(before: dict[str, object]) -> Cluster:
    """A 2-host cluster for the session, always taken down; the machine is then as before."""
    try:
        script("up")
        yield Cluster(STATE, [f"h{n}" for n in range(1, HOSTS + 1)])
    finally:
        script("down")
    assert machine_state() == before
