"""Horovod's timeline, read back: where the time of each collective goes (negotiation, waiting for
data, copies into and out of the fusion buffer, the transfer itself).

Recording needs HOROVOD_TIMELINE=DYNAMIC in the environment at init; `record` then writes a Chrome
trace of just the enclosed collectives, and `activity_totals` sums it by activity.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from hvd_train.comm import horovod as backend


@contextlib.contextmanager
def record(path: Path) -> Iterator[None]:
    """Record Horovod's timeline to `path` while the block runs (rank 0 writes it)."""
    backend.start_timeline(str(path))
    try:
        yield
    finally:
        backend.stop_timeline()


def activity_totals(path: Path) -> dict[str, float]:
    """Total milliseconds per activity name in a timeline file (nested spans counted each)."""
    text = Path(path).read_text().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    open_spans: dict[tuple, list[tuple[str, float]]] = defaultdict(list)
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        key = (event.get("pid"), event.get("tid"))
        if event.get("ph") == "B":
            open_spans[key].append((event.get("name", "?"), float(event["ts"])))
        elif event.get("ph") == "E" and open_spans[key]:
            name, start = open_spans[key].pop()
            totals[name] += (float(event["ts"]) - start) / 1e3
        elif event.get("ph") == "X":
            totals[event.get("name", "?")] += float(event.get("dur", 0)) / 1e3
    return dict(totals)
