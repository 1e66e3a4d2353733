"""Crash points for the kill -9 tests: HOSTAGENT_CRASH_AT=<name> makes the agent SIGKILL itself at that point."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import Counter

CRASH_ENV = "HOSTAGENT_CRASH_AT"
_reached: Counter[str] = Counter()  # how often each chosen point was reached in this process
_reached_lock = threading.Lock()  # host steps reach their points from worker threads


def crash_point(name: str) -> None:
    """Die like `kill -9` when this named point is the one the test chose (no cleanup runs).

    `name@N` chooses the Nth time the point is reached in this process: `bind:probe@2` is the probe of the second
    function bound, so a kill can land between two functions of one IOMMU group, which the first occurrence never
    shows."""
    chosen = os.environ.get(CRASH_ENV)
    if not chosen:
        return
    point, _, nth = chosen.partition("@")
    if point != name:
        return
    if nth:
        with _reached_lock:
            _reached[name] += 1
            if _reached[name] != int(nth):
                return
    sys.stderr.write(f"hostagent: crash point {chosen} reached, killing self\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
