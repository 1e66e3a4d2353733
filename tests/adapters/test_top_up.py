"""Partial grants that complete (issue #22): an ACTIVE lease granted fewer GPUs than it asked is topped up as GPUs
free, hot-attached to the same VM, after the queued requests and without delaying the head; the guest agent learns
it from its heartbeat reply; a failed top-up leaves the lease as it was; a crash mid-top-up is settled by reconcile.
dgx8 over the fake kernel and the simulated hypervisor."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from hostagent.domain.lease import LeaseState
from hostagent.host.fakekernel import FakeKernel
from hostagent.runtime import build_runtime
from hostagent.store.journal import Journal
from tests.support.agent import AgentRig, make_rig, start_rig

S = LeaseState


async def post(rig: AgentRig, who: str, status: int, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(who))
    data = await r.json()
    assert r.status == status, data
    return data


async def get(rig: AgentRig, lease_id: str) -> dict[str, Any]:
    return await (await rig.client.get(f"/v1/leases/{lease_id}", headers=rig.auth("operator"))).json()


async def release(rig: AgentRig, who: str, lease_id: str) -> None:
    r = await rig.client.delete(f"/v1/leases/{lease_id}", headers=rig.auth(who))
    assert r.status == 200, await r.text()


async def attached(rig: AgentRig, vm: str) -> set[str]:
    """PCI addresses of the hostdevs attached to the VM (the simulated hypervisor's live XML)."""
    return {str(h.source) for h in await rig.hv.attached_hostdevs(rig.uuids[vm])}


async def settle(rig: AgentRig, timeout: float = 30.0) -> None:
    """Drain until no grant is under way (the queue's own background task drains too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await rig.runtime.manager.drain_queue()
        if not any(x.state in (S.BINDING, S.ATTACHING) or x.adding for x in rig.runtime.manager.leases.values()):
            return
        await asyncio.sleep(0.01)


async def partial(rig: AgentRig, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """vm-b holds 6 GPUs for an hour; vm-a asks 4 and takes the 2 left."""
    big = await post(rig, "vm-b", 201, gpus=6, duration_s=3600)
    part = await post(rig, "vm-a", 201, gpus=4, accept_partial=True, **extra)
    assert len(part["devices"]) == 2
    return big, part


async def test_a_partial_grant_says_when_the_rest_comes_and_is_topped_up_as_gpus_free(
        tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    big, part = await partial(rig)
    assert part["partial"]["asked"] == 4 and part["partial"]["granted"] == 2 and part["partial"]["top_up"]
    assert part["partial"]["rest_expected_at"] == big["expires_at"]  # vm-b's GPUs free at its expiry
    first = {d["gpu_id"] for d in part["devices"]}
    await release(rig, "vm-b", big["id"])
    await settle(rig)
    now = await get(rig, part["id"])
    assert now["state"] == "ACTIVE" and len(now["devices"]) == 4 and "partial" not in now
    assert first <= {d["gpu_id"] for d in now["devices"]}  # it keeps what it had
    assert any("topped up with" in r for r in now["reasons"])
    functions = {f for d in now["devices"] for f in d["functions"]}
    assert await attached(rig, "vm-a") == functions  # hot-attached to the same VM, every one
    for f in functions:
        assert rig.sysfs_driver(f) == "vfio-pci"
    assert all(d["guest_addresses"] and all(d["guest_addresses"]) for d in now["devices"])
    # the guest hears of it in its heartbeat reply
    r = await rig.client.post(f"/v1/leases/{part['id']}/heartbeat", json={"samples": []}, headers=rig.auth("vm-a"))
    assert (await r.json())["granted_gpus"] == 4
    # and it all goes back with the lease
    await release(rig, "vm-a", part["id"])
    assert await attached(rig, "vm-a") == set()
    assert all(rig.sysfs_driver(f) == "nvidia" for f in functions)


async def test_top_up_false_keeps_what_was_granted(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    big, part = await partial(rig, top_up=False)
    assert part["partial"]["top_up"] is False and part["partial"]["rest_expected_at"] is None
    await release(rig, "vm-b", big["id"])
    await settle(rig)
    assert len((await get(rig, part["id"]))["devices"]) == 2


async def test_queued_requests_go_first_and_the_head_is_not_delayed(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    big, part = await partial(rig)
    queued = await post(rig, "vm-c", 202, gpus=5, accept_deferred=True)  # waits for vm-b's six
    await release(rig, "vm-b", big["id"])
    await settle(rig)
    assert (await get(rig, queued["id"]))["state"] == "ACTIVE"
    # one GPU was left over: the top-up took it, no more
    assert len((await get(rig, part["id"]))["devices"]) == 3


async def test_a_failed_top_up_leaves_the_lease_as_it_was(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    big, part = await partial(rig)
    kernel = FakeKernel(rig.tree.sys_root)
    for d in big["devices"]:
        kernel.set_fault("fail_bind", d["functions"][0])
    await release(rig, "vm-b", big["id"])
    await settle(rig)
    now = await get(rig, part["id"])
    assert now["state"] == "ACTIVE" and len(now["devices"]) == 2 and now["partial"]["adding"] == []
    for d in big["devices"]:  # nothing stranded on vfio-pci
        assert rig.sysfs_driver(d["functions"][0]) == "nvidia"
    events = [e.detail or "" for e in rig.runtime.journal.events(lease_id=part["id"])]
    assert any("top-up of" in e and "failed" in e for e in events)


async def test_a_crash_mid_top_up_is_finished_or_undone_by_reconcile(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.runtime.use_store = False
    await rig.runtime.start()
    m = rig.runtime.manager
    from hostagent.domain.lease import LeaseRequest

    hold = await m.request(rig.uuids["vm-b"], LeaseRequest(gpus=6), actor="test")
    # top_up=False: the running agent leaves it alone, so the test decides where the top-up stopped
    lease = await m.request(rig.uuids["vm-a"], LeaseRequest(gpus=3, accept_partial=True, top_up=False), actor="test")
    assert len(lease.devices) == 2
    await m.release(hold.id, actor="test")
    spare = m.gpus[hold.gpu_ids[0]]
    await rig.runtime.stop()
    # as if the agent died right after journaling the top-up's first step (the device in the lease, not bound)
    journal = Journal(rig.settings.state_dir / "journal.sqlite3")
    try:
        current = journal.get(lease.id)
        assert current is not None
        dev = dataclasses.replace(current.devices[0], gpu_id=spare.id,
                                  functions=tuple(str(f.address) for f in spare.functions),
                                  original_drivers=tuple("nvidia" for _ in spare.functions), guest_addresses=())
        journal.record(current.with_changes(devices=(*current.devices, dev), adding=(spare.id,)),
                       from_state=S.ACTIVE, actor="test")
    finally:
        journal.close()
    rig.runtime = build_runtime(rig.settings, hypervisor=rig.hv)
    rig.runtime.use_store = False
    await rig.runtime.start()
    try:
        after = rig.runtime.manager.leases[lease.id]
        assert after.state is S.ACTIVE and after.adding == () and len(after.devices) == 2
        assert spare.id not in after.gpu_ids
        assert all(rig.sysfs_driver(str(f.address)) == "nvidia" for f in spare.functions)
        repairs = [e.detail or "" for e in rig.runtime.journal.events(lease_id=lease.id, kinds=["repair"])]
        assert any("undid the top-up" in r for r in repairs), repairs
    finally:
        await rig.runtime.stop()


async def test_a_crash_after_the_attach_keeps_the_topped_up_device(tmp_path: Path) -> None:
    from hostagent.domain.lease import LeaseRequest

    rig = make_rig(tmp_path)
    rig.runtime.use_store = False
    await rig.runtime.start()
    m = rig.runtime.manager
    hold = await m.request(rig.uuids["vm-b"], LeaseRequest(gpus=6), actor="test")
    lease = await m.request(rig.uuids["vm-a"], LeaseRequest(gpus=3, accept_partial=True), actor="test")
    await m.release(hold.id, actor="test")
    deadline = time.monotonic() + 30
    while len(m.leases[lease.id].devices) < 3 or m.leases[lease.id].adding:
        assert time.monotonic() < deadline, "the top-up did not happen"
        await m.drain_queue()
        await asyncio.sleep(0.01)
    topped = m.leases[lease.id]
    added = next(d.gpu_id for d in topped.devices if d.gpu_id not in lease.gpu_ids)
    await rig.runtime.stop()
    # as if the agent died after the attach, before the step that clears `adding`
    journal = Journal(rig.settings.state_dir / "journal.sqlite3")
    try:
        current = journal.get(lease.id)
        assert current is not None
        journal.record(current.with_changes(adding=(added,), granted_gpus=2), from_state=S.ACTIVE, actor="test")
    finally:
        journal.close()
    rig.runtime = build_runtime(rig.settings, hypervisor=rig.hv)
    rig.runtime.use_store = False
    await rig.runtime.start()
    try:
        after = rig.runtime.manager.leases[lease.id]
        assert after.adding == () and added in after.gpu_ids and after.granted_gpus == 3
        assert all(rig.sysfs_driver(f) == "vfio-pci" for d in after.devices for f in d.functions)
        repairs = [e.detail or "" for e in rig.runtime.journal.events(lease_id=lease.id, kinds=["repair"])]
        assert any(f"finished the top-up with {added}" in r for r in repairs), repairs
    finally:
        await rig.runtime.stop()


async def test_a_failed_attach_gives_the_device_back(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    big, part = await partial(rig)
    rig.hv.fail_attach_after = 0  # the next attach fails (and undoes what it attached)
    await release(rig, "vm-b", big["id"])
    await settle(rig)
    now = await get(rig, part["id"])
    assert now["state"] == "ACTIVE" and len(now["devices"]) == 2 and now["partial"]["adding"] == []
    for d in big["devices"]:  # given back, nothing stranded on vfio-pci
        assert all(rig.sysfs_driver(f) == "nvidia" for f in d["functions"])
    events = [e.detail or "" for e in rig.runtime.journal.events(lease_id=part["id"])]
    assert any("top-up of" in e and "failed" in e for e in events), events


async def test_a_top_up_that_fails_before_its_journal_write_lets_go_of_its_claim(
        tmp_path: Path, aiohttp_client: Any) -> None:
    """The top-up claims a freed GPU, then fails before anything is journaled (reading the drivers raised): the
    claim goes with it, so the GPU is free for the next decision, and the lease is topped up with others."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    big, part = await partial(rig)
    m = rig.runtime.manager
    real = m.host.current_drivers
    failed: list[str] = []

    def once(gpu: Any) -> Any:
        if not failed and gpu.id not in {d["gpu_id"] for d in part["devices"]}:
            failed.append(gpu.id)
            raise OSError("sysfs read failed")
        return real(gpu)

    m.host.current_drivers = once  # type: ignore[method-assign]
    await release(rig, "vm-b", big["id"])
    await settle(rig)
    now = await get(rig, part["id"])
    assert failed and len(now["devices"]) == 4 and now["state"] == "ACTIVE", now
    held = {d["gpu_id"] for d in now["devices"]}
    assert set(m.claims) == held, m.claims  # no claim outlives its top-up: only the lease's own GPUs are claimed
    assert failed[0] in held or m.gpu_state(failed[0]).value == "free"
    assert sum(m.gpu_state(g).value == "free" for g in m.gpus) == len(m.gpus) - len(held)
