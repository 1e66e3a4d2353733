"""agent.gc_freeze: once the agent has started and loaded its placement model, the heap is frozen out of the
collector's reach, so a full collection walks only what was made since; leasing works the same."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import make_rig, start_rig


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the next tests' agents run with gc_freeze off


@pytest.mark.parametrize("store", [True, False])
async def test_heap_frozen_after_start(tmp_path: Path, aiohttp_client: Any, thawed: None, store: bool) -> None:
    rig = make_rig(tmp_path, agent={"gc_freeze": True})
    rig.runtime.use_store = store
    assert gc.get_freeze_count() == 0
    rig = await start_rig(rig, aiohttp_client)
    for _ in range(200):  # with a store: after the model load, which runs in the background
        if gc.get_freeze_count():
            break
        await asyncio.sleep(0.05)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the agent, aiohttp, SQLAlchemy... (and numpy, scikit-learn with a store)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    assert r.status == 201
    gc.collect()  # a full collection leaves the frozen objects where they are
    assert gc.get_freeze_count() >= frozen - 100  # (a few may have been freed by their reference counts)


async def test_off_leaves_the_collector_alone(tmp_path: Path, aiohttp_client: Any, thawed: None) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    assert r.status == 201
    await asyncio.sleep(0.3)
    assert gc.get_freeze_count() == 0
