"""Shared test setup: asyncio debug on, so a blocking call on the event loop shows up."""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("PYTHONASYNCIODEBUG", "1")


@pytest.fixture(autouse=True)
def _asyncio_debug(request: pytest.FixtureRequest) -> None:
    """Turn on asyncio debug for every test that has a running loop policy."""
    asyncio.get_event_loop_policy()
