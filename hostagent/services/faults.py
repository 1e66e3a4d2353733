"""Crash points for the kill -9 tests: HOSTAGENT_CRASH_AT=<name> makes the agent SIGKILL itself at that point."""

from __future__ import annotations

import os
import signal
import sys

CRASH_ENV = "HOSTAGENT_CRASH_AT"


def crash_point(name: str) -> None:
    """Die like `kill -9` when this named point is the one the test chose (no cleanup runs)."""
    if os.environ.get(CRASH_ENV) == name:
        sys.stderr.write(f"hostagent: crash point {name} reached, killing self\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
