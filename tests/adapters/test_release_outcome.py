"""A release's journal says how the detach ended: the guest's DEVICE_REMOVED, the domain stopping or crashing, the
domain gone; not "confirmed by DEVICE_REMOVED" for a detach no guest acknowledged (#24)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import AgentRig, make_rig, start_rig


async def granted(rig: AgentRig) -> str:
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    assert r.status == 201, await r.text()
    return str((await r.json())["id"])


async def rebind_detail(rig: AgentRig, lease_id: str) -> str:
    """The detail of the lease's REBINDING step, once it is journaled."""
    deadline = time.monotonic() + 5
    while True:
        events = (await (await rig.client.get(f"/v1/events?lease_id={lease_id}",
                                              headers=rig.auth("operator"))).json())["events"]
        steps = [e for e in events if e.get("to_state") == "REBINDING"]
        if steps or time.monotonic() > deadline:
            assert steps, events
            return str(steps[-1]["detail"])
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(("end", "expected"), [
    ("release", "detach ended: confirmed by DEVICE_REMOVED"),
    ("shutdown", "detach ended: domain stopped"),
    ("crash", "detach ended: domain crashed"),
    ("undefine", "detach ended: the domain is gone"),
])
async def test_the_journal_says_how_the_detach_ended(tmp_path: Path, aiohttp_client: Any, end: str,
                                                     expected: str) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease_id = await granted(rig)
    if end == "release":
        assert (await rig.client.delete(f"/v1/leases/{lease_id}", headers=rig.auth("vm-a"))).status == 200
    else:
        getattr(rig.hv, end)("vm-a")
    detail = await rebind_detail(rig, lease_id)
    assert detail.startswith(expected), detail
    if end != "release":
        assert "DEVICE_REMOVED" not in detail, detail
