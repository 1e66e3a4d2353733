"""Bounded waits for a condition that another task, thread or process makes true: a wait with a deadline that fails
the test when it passes, never a timed assertion about how fast something happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def until(cond: Callable[[], Any], timeout: float, what: str = "condition", *, interval: float = 0.02) -> None:
    """Poll `cond()` from the event loop until it is true; fail the test when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout:g} s"
        await asyncio.sleep(interval)


def wait_until(cond: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll `cond()` from a thread without an event loop until true or `timeout` seconds pass; return the last
    answer (the caller asserts, or handles False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())
