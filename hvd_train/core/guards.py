"""Consistency guards: ranks that were started differently fail at once, by name.

Ranks launched with different configs (a stale file on one host, an `--set` given to some
processes of an MPMD launch), different software, or models of different shapes would otherwise
train nonsense or hang in a collective of mismatched sizes. At start every rank sends a fingerprint
of each, in two phases (the config and the versions first, the model's shapes once it is built);
every rank compares them with rank 0's and raises the same error naming the ranks that differ.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from hvd_train.errors import UserError, everywhere


class InconsistentRanks(UserError):
    """Ranks whose config, software or model differ from rank 0's (one line)."""


def digest(value: Any) -> str:
    """A short sha256 of a JSON-serialisable value (keys sorted)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def job_fingerprint(config: dict[str, Any], versions: dict[str, Any]) -> dict:
    """What must be equal on every rank before any collective that depends on the config: the
    resolved config and the versions."""
    return {"config": digest(config), "versions": versions}


def model_fingerprint(shapes: list[Any]) -> dict:
    """What must be equal on every rank before any collective that depends on the model: the
    shapes of its variables (those all ranks agree on: not the per-rank random state)."""
    return {"model variable shapes": digest(shapes)}


HINTS = {
    "config": "start every rank with the same config file and --set options",
    "versions": "install the same TensorFlow, Keras, Horovod and hvd_train on every host",
    "model variable shapes": "every rank must build the same model from the same input shape",
}


def compare(prints: list[dict], hosts: Sequence[str] | None = None) -> None:
    """Check every rank's fingerprint against rank 0's.

    Args:
      prints: each rank's fingerprint, by rank.
      hosts: each rank's host name, by rank; named in the error when the job spans hosts.

    Raises:
      InconsistentRanks: the first item that differs (for the versions, each that differs), the
        ranks with it and their hosts, and what to do (raised alike on every rank).
    """
    for item in prints[0]:
        differ = [r for r, p in enumerate(prints) if p.get(item) != prints[0][item]]
        if differ:
            shown, chief = ", ".join(str(r) for r in differ), ""
            if hosts and len(set(hosts)) > 1:
                shown += " on " + ", ".join(dict.fromkeys(hosts[r] for r in differ))
                chief = f" on {hosts[0]}"
            theirs, ours = prints[differ[0]].get(item), prints[0][item]
            raise everywhere(
                InconsistentRanks(
                    f"rank(s) {shown} differ from rank 0{chief} in their {item} "
                    f"({_difference(theirs, ours)}): {HINTS[item]}"
                )
            )


def _difference(theirs: Any, ours: Any) -> str:
    """ "theirs vs ours"; for two mappings (the versions) only the keys that differ."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        keys = [k for k in {**ours, **theirs} if theirs.get(k) != ours.get(k)]
        return ", ".join(f"{k} {theirs.get(k)} vs {ours.get(k)}" for k in keys)
    return f"{theirs} vs {ours}"
