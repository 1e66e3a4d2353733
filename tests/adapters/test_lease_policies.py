"""Lease policies through the lease service, not only as pure functions: the queue's order (a new request never
jumps a queued one of equal or higher priority, unless it cannot delay it: EASY backfilling, as
hostagent.services.grant_path.backfill_room and lease_queue._next_grant implement it), the per-VM quotas
(`leases.max_gpus_per_vm`, `leases.max_gpu_hours_per_day_per_vm`) and the project quotas (`leases.projects`), which
span every VM of the project. Each test drives the HTTP API of a running agent over the simulated dgx8 host
(8 GPUs) with a controllable clock; refusals are checked as the API documents them: 409, code "conflict", field
"gpus", a message that names the quota (docs/security.md, docs/configuration.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hostagent.domain.lease import LeaseState
from tests.support.agent import AgentRig, Clock, make_rig, start_rig
from tests.support.waits import until

S = LeaseState


async def _rig(tmp_path: Path, aiohttp_client: Any, **leases: Any) -> tuple[AgentRig, Clock]:
    clock = Clock()
    return await start_rig(make_rig(tmp_path, clock=clock, leases=leases), aiohttp_client), clock


async def post(rig: AgentRig, who: str, **body: Any) -> tuple[int, dict[str, Any]]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(who))
    return r.status, await r.json()


async def lease(rig: AgentRig, who: str, status: int = 201, **body: Any) -> dict[str, Any]:
    code, data = await post(rig, who, **body)
    assert code == status, data
    return data


async def refused(rig: AgentRig, who: str, **body: Any) -> str:
    """A request the API refuses as documented (409 conflict on `gpus`); returns the message."""
    code, data = await post(rig, who, **body)
    assert code == 409, data
    assert data["error"]["code"] == "conflict" and data["error"]["field"] == "gpus", data
    return str(data["error"]["message"])


async def release(rig: AgentRig, who: str, lease_id: str) -> None:
    r = await rig.client.delete(f"/v1/leases/{lease_id}", headers=rig.auth(who))
    assert r.status == 200, await r.text()


async def state(rig: AgentRig, who: str, lease_id: str) -> dict[str, Any]:
    return await (await rig.client.get(f"/v1/leases/{lease_id}", headers=rig.auth(who))).json()


async def decided(rig: AgentRig) -> None:
    """Let the queue decide now (what its background task does when GPUs free), then let grants finish."""
    m = rig.runtime.manager
    await m.drain_queue()
    await until(lambda: not any(x.state in (S.BINDING, S.ATTACHING) for x in m.leases.values()), 10, "grants")


def free_gpus(rig: AgentRig) -> int:
    m = rig.runtime.manager
    return sum(1 for g in m.gpus if m.gpu_state(g).value == "free")


def held(rig: AgentRig, *vms: str) -> int:
    return sum(len(x.devices) for x in rig.runtime.manager.leases.values()
               if x.domain_name in vms and x.state.holds_devices)


# -- the queue: nothing jumps the head unless it cannot delay it ----------------------------------------------------
async def test_a_new_request_does_not_jump_the_queued_head_when_one_gpu_frees(tmp_path: Path,
                                                                              aiohttp_client: Any) -> None:
    """All requests of equal priority (the default policy keeps guests at 0). The host is full; the head of the
    queue needs 2 GPUs. When 1 GPU frees, a new 1-GPU request that would hold it past the head's predicted start
    is refused (or queued behind the head), one that ends before it starts now (backfilled), and a 1-GPU request
    queued behind the head stays queued when another GPU frees while the head still cannot start."""
    rig, clock = await _rig(tmp_path, aiohttp_client)
    m = rig.runtime.manager
    t0 = clock.now
    first = await lease(rig, "vm-a", gpus=1, duration_s=1000)
    second = await lease(rig, "vm-b", gpus=1, duration_s=3600)  # the head's second GPU frees at t0 + 3600
    await lease(rig, "vm-d", gpus=6, duration_s=7200)
    head = await lease(rig, "vm-c", 202, gpus=2, accept_deferred=True)
    assert head["queue"]["position"] == 1

    await release(rig, "vm-a", first["id"])
    await decided(rig)
    assert m.leases[head["id"]].state is S.QUEUED and free_gpus(rig) == 1  # 1 of 2: the head waits

    # a new request for the free GPU, as long as 8 hours: it would delay the head
    msg = await refused(rig, "vm-a", gpus=1, duration_s=8 * 3600)
    assert "1 request(s) of equal or higher priority are waiting" in msg, msg
    long = await lease(rig, "vm-a", 202, gpus=1, duration_s=8 * 3600, accept_deferred=True)
    assert long["queue"]["position"] == 2 and free_gpus(rig) == 1, "it queues behind the head, the GPU stays free"
    # a new request that ends before the head can start (t0 + 3600) takes the free GPU now
    short = await lease(rig, "vm-a", gpus=1, duration_s=600)
    assert any(f"backfilled: ends before the head of the queue ({head['id']})" in r for r in short["reasons"]), \
        short["reasons"]
    assert clock.now + 600 <= t0 + 3600

    # another GPU frees: the head still needs two; the long request queued behind it may not take this one
    await release(rig, "vm-b", second["id"])
    await decided(rig)
    assert m.leases[head["id"]].state is S.QUEUED and m.leases[long["id"]].state is S.QUEUED
    assert free_gpus(rig) == 1
    assert (await state(rig, "vm-a", long["id"]))["queue"]["position"] == 2

    # the backfilled job ends: the head starts on both GPUs, the long request still waits
    await release(rig, "vm-a", short["id"])
    await until(lambda: m.leases[head["id"]].state is S.ACTIVE, 10, "the head's grant")
    await decided(rig)
    assert len(m.leases[head["id"]].devices) == 2
    assert m.leases[long["id"]].state is S.QUEUED and free_gpus(rig) == 0
    assert (await state(rig, "vm-a", long["id"]))["queue"]["position"] == 1


# -- per-VM quotas -----------------------------------------------------------------------------------------------
async def test_the_vm_gpu_quota_refuses_and_caps_through_the_api(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, _ = await _rig(tmp_path, aiohttp_client, max_gpus_per_vm=2)
    m = rig.runtime.manager
    msg = await refused(rig, "vm-a", gpus=3, accept_deferred=True)
    assert msg == "quota: VM vm-a may hold at most 2 GPU(s); a request for 3 can never be granted", msg
    assert not m.leases, "a refused request leaves nothing queued or journaled"
    first = await lease(rig, "vm-a", gpus=1)
    capped = await lease(rig, "vm-a", gpus=3, accept_partial=True, top_up=False)
    assert capped["granted_gpus"] == 1 and held(rig, "vm-a") == 2
    assert any("the quota leaves 1" in r for r in capped["reasons"]), capped["reasons"]
    msg = await refused(rig, "vm-a", gpus=1, accept_deferred=True)
    assert msg == "quota: VM vm-a may hold at most 2 GPU(s) and holds 2", msg
    assert (await lease(rig, "vm-b", gpus=2))["granted_gpus"] == 2, "another VM has a quota of its own"
    await release(rig, "vm-a", first["id"])
    assert (await lease(rig, "vm-a", gpus=1))["state"] == "ACTIVE", "what the VM gave back counts no more"


async def test_the_vm_gpu_hours_quota_refuses_through_the_api(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, clock = await _rig(tmp_path, aiohttp_client, max_gpu_hours_per_day_per_vm=1.0)
    two = await lease(rig, "vm-a", gpus=2)
    clock.advance(1800)  # two GPUs for half an hour: the VM's one GPU-hour
    msg = await refused(rig, "vm-a", gpus=1)
    assert msg == "quota: VM vm-a used 1.0 of 1 GPU-hours in the last 24 h", msg
    await release(rig, "vm-a", two["id"])
    assert "used 1.0 of 1 GPU-hours" in await refused(rig, "vm-a", gpus=1, accept_deferred=True)
    await lease(rig, "vm-b", gpus=1)
    clock.advance(86400)
    await lease(rig, "vm-a", gpus=1)  # the day slid past it


# -- project quotas span the project's VMs --------------------------------------------------------------------------
async def test_a_project_gpu_quota_spans_its_vms(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, _ = await _rig(tmp_path, aiohttp_client, projects={"team": {"domains": ["vm-a", "vm-b"], "max_gpus": 3}})
    a = await lease(rig, "vm-a", gpus=2)
    # vm-b holds nothing itself: the project's GPUs held by vm-a count against it
    msg = await refused(rig, "vm-b", gpus=2)
    assert msg == "quota: project team may hold at most 3 GPU(s) and holds 2", msg
    capped = await lease(rig, "vm-b", gpus=2, accept_partial=True, top_up=False)
    assert capped["granted_gpus"] == 1 and any("the quota leaves 1" in r for r in capped["reasons"])
    assert "project team may hold at most 3 GPU(s) and holds 3" in await refused(rig, "vm-a", gpus=1)
    assert "can never be granted" in await refused(rig, "vm-b", gpus=4, accept_deferred=True)
    assert (await lease(rig, "vm-c", gpus=4))["granted_gpus"] == 4, "a VM outside the project is not held back"
    assert held(rig, "vm-a", "vm-b") == 3
    await release(rig, "vm-a", a["id"])
    assert (await lease(rig, "vm-b", gpus=2))["granted_gpus"] == 2


async def test_a_project_gpu_quota_counts_what_its_vms_have_queued(tmp_path: Path, aiohttp_client: Any) -> None:
    rig, _ = await _rig(tmp_path, aiohttp_client, projects={"team": {"domains": ["vm-a", "vm-b"], "max_gpus": 2}})
    m = rig.runtime.manager
    hog = await lease(rig, "vm-d", gpus=7)
    await lease(rig, "vm-a", gpus=1)
    queued = await lease(rig, "vm-b", 202, gpus=1, accept_deferred=True)
    msg = await refused(rig, "vm-a", gpus=1, accept_deferred=True)
    assert msg == "quota: project team may hold at most 2 GPU(s) and holds 1 with 1 more queued", msg
    await release(rig, "vm-d", hog["id"])
    await until(lambda: m.leases[queued["id"]].state is S.ACTIVE, 10, "the queued grant")
    assert held(rig, "vm-a", "vm-b") == 2


async def test_a_project_gpu_hours_quota_spans_its_vms_and_their_ended_leases(tmp_path: Path,
                                                                               aiohttp_client: Any) -> None:
    rig, clock = await _rig(tmp_path, aiohttp_client,
                            projects={"lab": {"domains": ["vm-a", "vm-b"], "max_gpu_hours_per_day": 2.0}})
    a = await lease(rig, "vm-a", gpus=1, duration_s=3600)
    b = await lease(rig, "vm-b", gpus=1, duration_s=3600)
    clock.advance(3600)  # one GPU-hour each: the project's two
    await release(rig, "vm-a", a["id"])
    await release(rig, "vm-b", b["id"])
    for vm in ("vm-a", "vm-b"):
        msg = await refused(rig, vm, gpus=1)
        assert msg == "quota: project lab used 2.0 of 2 GPU-hours in the last 24 h", msg
    await lease(rig, "vm-c", gpus=1)  # outside the project
    clock.advance(86400)
    await lease(rig, "vm-b", gpus=1)
