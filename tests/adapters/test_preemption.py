"""Priority preemption through the API: `leases.preempt_min_priority` set in the configuration, requests and
releases over HTTP, the reaper scheduling itself (as the running agent does) to act on the notice's deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.agent import AgentRig, make_rig, start_rig

NOTICE_S = 0.6


async def preempting_rig(tmp_path: Path, aiohttp_client: Any, threshold: int) -> AgentRig:
    """dgx8 with guests allowed priorities up to 10 (the operator's policy), a short notice window, idle reclaim
    off (preemption works without it), preemption at `threshold`."""
    return await start_rig(make_rig(tmp_path, leases={"guest_max_priority": 10, "preempt_min_priority": threshold},
                                    reclaim={"notice_window_s": NOTICE_S}), aiohttp_client)


async def lease(rig: AgentRig, who: str, status: int = 201, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(who))
    data = await r.json()
    assert r.status == status, data
    return data


async def get(rig: AgentRig, who: str, lease_id: str) -> dict[str, Any]:
    return await (await rig.client.get(f"/v1/leases/{lease_id}", headers=rig.auth(who))).json()


async def noticed(rig: AgentRig, who: str, lease_id: str, timeout: float = 5.0) -> dict[str, Any]:
    """The lease's reclaim fields once the queue's drain (a background task) has given it a notice, or at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        reclaim = (await get(rig, who, lease_id))["reclaim"]
        if reclaim["preempted_by"] or time.monotonic() > deadline:
            return reclaim
        await asyncio.sleep(0.02)


async def until(rig: AgentRig, who: str, lease_id: str, state: str, timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = await get(rig, who, lease_id)
        if body["state"] == state or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.02)


async def metric(rig: AgentRig, name: str, **labels: str) -> float:
    text = await (await rig.client.get("/metrics", headers=rig.auth("operator"))).text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def busy_host(rig: AgentRig) -> tuple[dict[str, Any], dict[str, Any]]:
    """vm-a (priority 1, older) and vm-b (priority 0, younger) hold four GPUs each."""
    a = await lease(rig, "vm-a", gpus=4, priority=1)
    b = await lease(rig, "vm-b", gpus=4, priority=0)
    return a, b


@pytest.mark.parametrize(("threshold", "preempts"), [(0, False), (7, False), (5, True), (6, True)])
async def test_preempt_min_priority_from_config(tmp_path: Path, aiohttp_client: Any, threshold: int,
                                                preempts: bool) -> None:
    """A priority-6 request on a full host: with the key off (0) or above 6 it waits and nobody is told anything;
    at or below 6 the lowest-priority lease gets a reclaim notice naming the request, is reclaimed at the notice's
    deadline, and the request is granted on its GPUs."""
    rig = await preempting_rig(tmp_path, aiohttp_client, threshold)
    a, b = await busy_host(rig)
    c = await lease(rig, "vm-c", status=202, gpus=2, priority=6, accept_deferred=True)
    notice_b = await noticed(rig, "vm-b", b["id"], timeout=5.0 if preempts else 0.05)
    assert (await get(rig, "vm-a", a["id"]))["reclaim"]["notice"] is None
    if not preempts:
        assert notice_b["notice"] is None and notice_b["preempted_by"] is None
        await asyncio.sleep(NOTICE_S + 0.5)
        assert (await get(rig, "vm-b", b["id"]))["state"] == "ACTIVE"
        assert (await get(rig, "vm-c", c["id"]))["state"] == "QUEUED"
        return
    assert notice_b["notice"] == "reclaim" and notice_b["preempted_by"] == c["id"]
    warning = next(w for w in (await get(rig, "vm-b", b["id"]))["warnings"] if w["code"] == "reclaim_notice")
    assert warning["reason"] == "preempted" and c["id"] in warning["message"]
    assert (await get(rig, "vm-c", c["id"]))["queue"]["eta"] <= notice_b["notice_deadline"] + 0.01
    granted = await until(rig, "vm-c", c["id"], "ACTIVE")
    assert granted["state"] == "ACTIVE" and granted["granted_gpus"] == 2
    ended = await get(rig, "vm-b", b["id"])
    assert ended["state"] == "RELEASED" and ended["end_reason"] == "reclaimed: preempted"
    assert set(d["gpu_id"] for d in granted["devices"]) <= set(d["gpu_id"] for d in b["devices"])
    assert (await get(rig, "vm-a", a["id"]))["state"] == "ACTIVE"
    kinds = [e.kind for e in rig.runtime.journal.events(lease_id=b["id"])]
    assert "preempt" in kinds and "reclaim" in kinds
    assert await metric(rig, "hostagent_preemptions_total", outcome="released") == 1
    assert await metric(rig, "hostagent_reclaims_total", outcome="released") == 0  # not counted as idle


async def test_equal_or_higher_priority_is_never_preempted(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await preempting_rig(tmp_path, aiohttp_client, 5)
    held = await lease(rig, "vm-a", gpus=8, priority=6)
    c = await lease(rig, "vm-c", status=202, gpus=1, priority=6, accept_deferred=True)
    await asyncio.sleep(NOTICE_S + 0.5)
    assert (await get(rig, "vm-a", held["id"]))["reclaim"]["notice"] is None
    assert (await get(rig, "vm-c", c["id"]))["state"] == "QUEUED"


async def test_only_what_is_needed_and_never_twice(tmp_path: Path, aiohttp_client: Any) -> None:
    """Eight one-GPU leases of priority 0..7 in age order; a 2-GPU request of priority 9 takes the two lowest, and
    draining the queue again (as every release does) adds no victim while their notices run."""
    rig = await preempting_rig(tmp_path, aiohttp_client, 5)
    leases = [await lease(rig, ("vm-a", "vm-b", "vm-c", "vm-d")[i % 4], gpus=1, priority=i) for i in range(8)]
    c = await lease(rig, "vm-d", status=202, gpus=2, priority=9, accept_deferred=True)
    for _ in range(3):
        await rig.runtime.manager.drain_queue()
    noticed = [x["id"] for x in leases if rig.runtime.manager.leases[x["id"]].preempted_by == c["id"]]
    assert noticed == [leases[0]["id"], leases[1]["id"]]


async def test_a_cooperative_release_starts_the_request_before_the_deadline(tmp_path: Path,
                                                                            aiohttp_client: Any) -> None:
    rig = await preempting_rig(tmp_path, aiohttp_client, 5)
    m = rig.runtime.manager
    m.policy = dataclasses.replace(m.policy, preempt_notice_s=30.0)  # the release, not the deadline, frees it
    _, b = await busy_host(rig)
    c = await lease(rig, "vm-c", status=202, gpus=1, priority=6, accept_deferred=True)
    assert (await noticed(rig, "vm-b", b["id"]))["preempted_by"] == c["id"]
    r = await rig.client.delete(f"/v1/leases/{b['id']}", headers=rig.auth("vm-b"))
    assert r.status == 200
    assert (await until(rig, "vm-c", c["id"], "ACTIVE", timeout=3.0))["state"] == "ACTIVE"


async def test_the_notice_is_withdrawn_when_the_request_no_longer_waits(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await preempting_rig(tmp_path, aiohttp_client, 5)
    _, b = await busy_host(rig)
    c = await lease(rig, "vm-c", status=202, gpus=1, priority=6, accept_deferred=True)
    assert (await noticed(rig, "vm-b", b["id"]))["preempted_by"] == c["id"]
    await rig.client.delete(f"/v1/leases/{c['id']}", headers=rig.auth("vm-c"))  # it gives up waiting
    await asyncio.sleep(NOTICE_S + 0.6)
    kept = await get(rig, "vm-b", b["id"])
    assert kept["state"] == "ACTIVE" and kept["reclaim"]["notice"] is None and kept["reclaim"]["preempted_by"] is None
    (withdrawn,) = [e for e in rig.runtime.journal.events(lease_id=b["id"]) if e.kind == "preempt-withdrawn"]
    assert withdrawn.detail == f"{c['id']} no longer waits" and withdrawn.actor == "reaper", withdrawn


async def test_no_preemption_that_cannot_start_the_request(tmp_path: Path, aiohttp_client: Any) -> None:
    """Only one GPU is held at a lower priority; a 2-GPU request cannot start by taking it, so nobody is told."""
    rig = await preempting_rig(tmp_path, aiohttp_client, 5)
    high = await lease(rig, "vm-a", gpus=7, priority=8)
    low = await lease(rig, "vm-b", gpus=1, priority=0)
    c = await lease(rig, "vm-c", status=202, gpus=2, priority=6, accept_deferred=True)
    await asyncio.sleep(NOTICE_S + 0.5)
    assert (await get(rig, "vm-b", low["id"]))["reclaim"]["notice"] is None
    assert (await get(rig, "vm-a", high["id"]))["state"] == "ACTIVE"
    assert (await get(rig, "vm-c", c["id"]))["state"] == "QUEUED"
