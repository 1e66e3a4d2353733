"""Out-of-band changes seen as they happen (issue #19): the kernel's uevents (here the fake kernel's, written by
a second FakeKernel over the same tree: another process, as an operator's shell or another tool would be) reach
the running agent, which tells its own changes apart and gives each other one the state an operator needs: the
GPU's attention mark or quarantine with the reason, the lease marked, a journal event, a /metrics count, and the
inventory's drivers as they are now; removals and hot-adds are followed without a restart."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from hostagent.host.fakekernel import FakeKernel
from tests.adapters.test_dashboard_auth import login
from tests.support.agent import AgentRig, make_rig, start_rig
from tests.support.metrics import scrape
from tests.support.waits import until

SOON = 5.0  # seconds: a bounded wait (the agent acts within a second; CI machines are slow and shared)


async def gpu(rig: AgentRig, gpu_id: str) -> dict[str, Any]:
    r = await rig.client.get(f"/v1/gpus/{gpu_id}", headers=rig.auth("operator"))
    assert r.status == 200
    return await r.json()


def events(rig: AgentRig, kind: str) -> list[Any]:
    return [e for e in rig.runtime.journal.events(limit=500) if e.kind == kind]


def free_gpu(rig: AgentRig) -> tuple[str, str]:
    m = rig.runtime.manager
    gid = next(g for g in sorted(m.gpus) if g not in m.claims)
    return gid, str(m.gpus[gid].address)


async def test_a_free_gpu_handed_to_vfio_by_hand_is_kept_out_of_placement_until_cleared(
        tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    gid, addr = free_gpu(rig)
    outside = FakeKernel(rig.tree.sys_root)
    outside.load_module("vfio_pci")  # modprobe vfio-pci, as the operator would
    outside.write("bus/pci/drivers/nvidia/unbind", addr)
    outside.write(f"bus/pci/devices/{addr}/driver_override", "vfio-pci")
    outside.write("bus/pci/drivers_probe", addr)
    m = rig.runtime.manager
    await until(lambda: gid in m.attention and "bound to vfio-pci outside the agent" in m.attention[gid], SOON,
                "the attention mark")
    body = await gpu(rig, gid)
    assert body["state"] == "unavailable" and "outside the agent" in body["attention"]
    await login(rig, rig.operator)  # the operator's overview says it too
    overview = await (await rig.client.get("/ui/")).text()
    assert "bound to vfio-pci outside the agent" in overview
    assert body["functions"][0]["driver"] == "vfio-pci"  # the view read sysfs again on the uevent
    kinds = {e.detail.split(":")[0] for e in events(rig, "out-of-band") if e.gpu_id == gid}
    assert "vfio-bound" in kinds
    s = await scrape(rig.client, rig.operator)
    assert s.value("hostagent_out_of_band_changes_total", change="vfio-bound") == 1
    assert s.value("hostagent_uevents_watching") == 1
    ready = await (await rig.client.get("/readyz")).json()
    check = ready["checks"]["uevents"]
    assert check["ok"] and check["watching"] and check["changes"] == {"vfio-bound": 1} and check["error"] is None
    assert check["uevents"] == 2 and check["own_uevents"] == 0 and check["missing"] == []  # unbind, probe's bind
    assert "fake kernel" in check["source"]
    # placement never gives it out: the seven others are granted, an eighth waits
    r = await rig.client.post("/v1/leases", json={"gpus": 7}, headers=rig.auth("vm-a"))
    lease = await r.json()
    assert r.status == 201 and gid not in [d["gpu_id"] for d in lease["devices"]], lease
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-b"))
    assert r.status == 409 and "free" in await r.text()
    await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    # the operator clears it: the agent gives it back to its host driver first (no lease holds it)
    r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", headers=rig.auth("operator"))
    assert r.status in (200, 204), await r.text()
    assert rig.sysfs_driver(addr) == "nvidia" and gid not in m.attention


async def test_the_inventory_follows_a_driver_change_at_its_uevent(tmp_path: Path, aiohttp_client: Any) -> None:
    """GET /v1/gpus reads the drivers again on a uevent, not only every DRIVERS_MAX_AGE_S: a change that is no
    finding (a GPU given back from vfio-pci by hand, which changes no mark, lease or quarantine) shows at once."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    gid, addr = free_gpu(rig)
    outside = FakeKernel(rig.tree.sys_root)
    outside.load_module("vfio_pci")
    outside.write(f"bus/pci/devices/{addr}/driver_override", "vfio-pci")
    outside.write("bus/pci/drivers/nvidia/unbind", addr)
    outside.write("bus/pci/drivers_probe", addr)
    m = rig.runtime.manager
    await until(lambda: gid in m.attention, SOON, "the attention mark")

    async def listed() -> str | None:
        gpus = (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]
        return next(g["functions"][0]["driver"] for g in gpus if g["id"] == gid)
    assert await listed() == "vfio-pci"  # the reading is now fresh, and cached
    before = rig.runtime.watcher.uevents
    outside.write("bus/pci/drivers/vfio-pci/unbind", addr)
    outside.write(f"bus/pci/devices/{addr}/driver_override", "\n")
    outside.write("bus/pci/drivers_probe", addr)
    await until(lambda: rig.runtime.watcher.uevents >= before + 2, SOON, "the uevents")
    assert await listed() == "nvidia"
    assert rig.runtime.watcher.counts == {"vfio-bound": 1}  # no finding for the hand give-back


async def test_the_agents_own_binds_and_give_backs_are_no_finding(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    for _ in range(3):
        r = await rig.client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))
        lease = await r.json()
        assert lease["state"] == "ACTIVE", lease
        await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    w = rig.runtime.watcher
    # each grant unbinds, overrides and probes two functions; each give-back unbinds and probes them
    await until(lambda: w.own_uevents >= 3 * 2 * 4, SOON, "the agent's own uevents")
    await asyncio.sleep(0.3)
    assert w.counts == {} and not rig.runtime.manager.attention and not rig.runtime.manager.quarantined
    assert events(rig, "out-of-band") == []


async def test_a_leased_function_unbound_by_hand_marks_the_gpu_and_the_lease(tmp_path: Path,
                                                                            aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lease = await r.json()
    gid, addr = lease["devices"][0]["gpu_id"], lease["devices"][0]["functions"][0]
    # the unbind waits, as Linux's does, until the guest's QEMU has let go of the device (the simulator's guest
    # acknowledges the unplug the kernel asks for): run it beside the agent
    writer = threading.Thread(target=FakeKernel(rig.tree.sys_root).write,
                              args=("bus/pci/drivers/vfio-pci/unbind", addr))
    writer.start()
    m = rig.runtime.manager
    w = rig.runtime.watcher
    await until(lambda: w.counts["unbound"] == 1, 3 * SOON, "the finding")
    await asyncio.to_thread(writer.join, 10)
    # the GPU is out of placement with a reason: the watcher's attention mark, or, when the lease's give-back met
    # the unbind first (ENODEV: someone else had taken it off vfio-pci), the give-back's quarantine
    await until(lambda: m.gpu_state(gid).value in ("unavailable", "quarantined") and lease["id"] not in m.leases,
                SOON, "the GPU out of placement, the lease ended")
    why = m.attention.get(gid) or m.quarantined.get(gid) or ""
    assert "outside the agent" in why or "did not return to its host driver" in why, why
    [finding] = list(w.findings)
    assert finding["reason"].startswith(f"{addr} was unbound from vfio-pci outside the agent while lease "
                                        f"{lease['id']} held it"), finding
    oob = [e for e in events(rig, "out-of-band") if e.gpu_id == gid]
    assert oob and oob[0].lease_id == lease["id"] and oob[0].detail.startswith("unbound:"), oob

    # QEMU let go of the device before the unbind completed, and DEVICE_REMOVED ended the lease: its history (the
    # operator's events of that lease) says why; a lease still live when the agent looks carries the mark itself
    r = await rig.client.get(f"/v1/events?lease_id={lease['id']}&kind=out-of-band", headers=rig.auth("operator"))
    listed = (await r.json())["events"]
    assert [e["detail"].split(":")[0] for e in listed] == ["unbound"]


async def test_a_gpu_removed_from_the_bus_is_quarantined_and_comes_back_with_a_rescan(
        tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    gid, addr = free_gpu(rig)
    outside = FakeKernel(rig.tree.sys_root)
    outside.write(f"bus/pci/devices/{addr}/remove", "1")
    m = rig.runtime.manager
    await until(lambda: gid in m.quarantined, SOON, "the quarantine")
    assert "gone from the PCI bus" in m.quarantined[gid]
    body = await gpu(rig, gid)
    assert body["state"] == "quarantined" and body["missing_functions"] == [addr]
    s = await scrape(rig.client, rig.operator)
    assert s.value("hostagent_out_of_band_changes_total", change="removed") == 1
    assert s.value("hostagent_gpu_functions_missing") == 1
    r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", headers=rig.auth("operator"))
    assert r.status == 409 and "not on the PCI bus" in (await r.json())["error"]["message"]
    assert gid in m.quarantined
    outside.write("bus/pci/rescan", "1")
    await until(lambda: addr not in m.missing and rig.runtime.watcher.counts["returned"] == 1, SOON, "the return")
    assert (await gpu(rig, gid))["functions"][0]["driver"] == "nvidia"
    assert gid in m.quarantined  # it fell off once: the operator decides when it serves again
    r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", headers=rig.auth("operator"))
    assert r.status in (200, 204), await r.text()
    assert (await gpu(rig, gid))["state"] == "free"


async def test_a_gpu_hot_added_joins_the_inventory_without_a_restart(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = make_rig(tmp_path)
    m = rig.runtime.manager
    gid = sorted(m.gpus)[-1]
    addr = str(m.gpus[gid].address)
    # off the bus before this agent starts: not in its inventory
    FakeKernel(rig.tree.sys_root).write(f"bus/pci/devices/{addr}/remove", "1")
    from hostagent.runtime import build_runtime

    rig.runtime = build_runtime(rig.settings, hypervisor=rig.hv)
    m = rig.runtime.manager
    assert gid not in m.gpus
    await start_rig(rig, aiohttp_client)
    FakeKernel(rig.tree.sys_root).write("bus/pci/rescan", "1")
    await until(lambda: gid in m.gpus, SOON, "the hot-added GPU")
    listed = (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]
    assert gid in [g["id"] for g in listed]
    added = [e for e in events(rig, "out-of-band") if e.gpu_id == gid]
    assert added and added[0].detail.startswith("added:") and addr in added[0].detail
    assert [f["address"] for f in rig.runtime.watcher.findings if f["change"] == "added"] == [addr]
    # the watcher knows the new GPU's drivers from the discovery: an unbind by hand says which it lost
    FakeKernel(rig.tree.sys_root).write("bus/pci/drivers/nvidia/unbind", addr)
    await until(lambda: gid in m.attention, SOON, "the attention mark")
    assert "unbound from nvidia" in m.attention[gid]
    r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", headers=rig.auth("operator"))
    assert r.status in (200, 204), await r.text()
    r = await rig.client.post("/v1/leases", json={"gpus": 8}, headers=rig.auth("vm-a"))
    lease = await r.json()
    assert r.status == 201, lease
    assert lease["state"] == "ACTIVE" and gid in [d["gpu_id"] for d in lease["devices"]]


async def test_an_injected_unbind_of_a_live_leases_function_marks_the_lease_itself(tmp_path: Path,
                                                                                   aiohttp_client: Any) -> None:
    """An event injected as the netlink reader delivers one: the lease is still ACTIVE when the agent looks, so
    the lease carries the mark (its error, in the guest's own view) besides the GPU's attention and the event."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lease = await r.json()
    gid, addr = lease["devices"][0]["gpu_id"], lease["devices"][0]["functions"][0]
    await until(lambda: rig.runtime.watcher.own_uevents >= 2, SOON, "the grant's own uevents")  # unbind, probe
    rig.runtime.watcher.deliver("unbind", addr, None, None)
    await until(lambda: "out of band" in (rig.runtime.manager.leases[lease["id"]].error or ""), SOON, "the mark")
    body = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))).json()
    assert body["state"] == "ACTIVE"
    assert f"{addr} was unbound from vfio-pci outside the agent while lease {lease['id']} held it" in body["error"]
    assert rig.runtime.manager.gpu_state(gid).value == "leased" and gid in rig.runtime.manager.attention
    # the mark is journaled: it outlives a restart, and the lease's history says what happened, by whom
    assert "out of band" in (rig.runtime.journal.get(lease["id"]).error or "")
    (mark,) = [e for e in rig.runtime.journal.events(lease_id=lease["id"])
               if (e.detail or "").startswith("out of band: ")]
    assert mark.detail == body["error"] and mark.actor == rig.runtime.watcher.ACTOR, mark
    # the GPU stays out of placement once the lease ends, until an operator clears it
    await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    assert rig.runtime.manager.gpu_state(gid).value == "unavailable"


class _Refused:
    description = "a netlink socket this host refuses"

    def start(self, deliver: Any) -> None:
        from hostagent.host.uevents import UeventsUnavailable

        raise UeventsUnavailable("cannot watch the kernel's uevents: [Errno 1] Operation not permitted")

    def stop(self) -> None:
        raise AssertionError("never started")


async def test_an_agent_that_cannot_watch_runs_on_and_says_so(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = make_rig(tmp_path)
    rig.runtime.watcher.source = _Refused()
    await start_rig(rig, aiohttp_client)
    r = await rig.client.get("/readyz")
    body = await r.json()
    assert r.status == 200 and body["ready"] and body["degraded"]
    check = body["checks"]["uevents"]
    assert check["ok"] is False and check["required"] is False and "Operation not permitted" in check["error"]
    assert check["source"] == "a netlink socket this host refuses"
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    assert r.status == 201  # leasing goes on


async def test_a_uevent_taken_for_the_agents_own_failed_write_is_judged_after_all(tmp_path: Path,
                                                                                 aiohttp_client: Any) -> None:
    """Injected in the order a race gives: the agent expects its own unbind, someone else's unbind arrives and is
    taken for it, then the agent's write fails (nothing left to unbind): the uevent is judged as someone else's,
    as things stood when it arrived (the lease that held the GPU then)."""
    import time

    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lease = await r.json()
    gid, addr = lease["devices"][0]["gpu_id"], lease["devices"][0]["functions"][0]
    w, own = rig.runtime.watcher, rig.runtime.host.own
    await until(lambda: w.own_uevents >= 2, SOON, "the grant's own uevents")
    expected = own.expect(addr, "unbind")
    at = time.monotonic()
    w.deliver("unbind", addr, None, at)
    assert w.own_uevents == 3 and not w.counts  # taken for the agent's own
    await asyncio.to_thread(own.done, expected, False)  # from a worker thread, as the binder says it
    await until(lambda: w.counts["unbound"] == 1, SOON, "the finding")
    assert w.own_uevents == 2 and w.uevents == 3
    [finding] = list(w.findings)
    assert finding["lease_id"] == lease["id"] and "from vfio-pci" in finding["reason"], finding
    assert gid in rig.runtime.manager.attention


async def test_a_uevent_sent_before_its_lease_ended_is_still_that_leases(tmp_path: Path, aiohttp_client: Any) -> None:
    import time

    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lease = await r.json()
    gid, addr = lease["devices"][0]["gpu_id"], lease["devices"][0]["functions"][0]
    w = rig.runtime.watcher
    sent = time.monotonic()
    await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    assert gid not in rig.runtime.manager.claims
    await until(lambda: w.own_uevents >= 4, SOON, "the give-back's own uevents")
    w.deliver("unbind", addr, None, sent)  # read only now
    await until(lambda: w.counts["unbound"] == 1, SOON, "the finding")
    assert list(w.findings)[0]["lease_id"] == lease["id"]
    # one sent after the lease ended is judged as the free GPU's it then was
    w.deliver("bind", addr, "nouveau", time.monotonic())
    await asyncio.sleep(0.3)
    assert w.counts == {"unbound": 1}


async def test_the_agent_looks_only_once_a_step_on_the_gpus_group_is_done(tmp_path: Path,
                                                                          aiohttp_client: Any) -> None:
    """The look takes the GPU's IOMMU group lock: while one of the agent's own steps holds it (here the test
    does), nothing is judged; once it is released, the change is."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    gid, addr = free_gpu(rig)
    m, w = rig.runtime.manager, rig.runtime.watcher
    lock = m._group_lock(m.gpus[gid].iommu_group)
    await lock.acquire()
    try:
        FakeKernel(rig.tree.sys_root).write("bus/pci/drivers/nvidia/unbind", addr)
        await until(lambda: w.uevents >= 1, SOON, "the uevent")
        await asyncio.sleep(0.3)
        assert not w.counts and gid not in m.attention
    finally:
        lock.release()
    await until(lambda: w.counts["unbound"] == 1, SOON, "the finding once the step is done")
    assert "unbound from nvidia" in m.attention[gid]


async def test_a_leased_gpu_fallen_off_the_bus_quarantines_it_and_marks_the_lease(tmp_path: Path,
                                                                                   aiohttp_client: Any) -> None:
    """A `remove` (injected: a surprise removal, nothing asked) of a function a live lease holds: the GPU is
    quarantined, the finding and the lease name each other."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lease = await r.json()
    gid, addr = lease["devices"][0]["gpu_id"], lease["devices"][0]["functions"][0]
    w, m = rig.runtime.watcher, rig.runtime.manager
    await until(lambda: w.own_uevents >= 2, SOON, "the grant's own uevents")
    w.deliver("remove", addr, None, None)
    assert addr in m.missing  # at once, before the look
    await until(lambda: w.counts["removed"] == 1, SOON, "the finding, acted on")  # counted once acted on
    assert gid in m.quarantined
    [finding] = list(w.findings)
    assert finding["change"] == "removed" and finding["lease_id"] == lease["id"] and finding["address"] == addr
    assert f"while lease {lease['id']} held it" in m.quarantined[gid]
    await until(lambda: "gone from the PCI bus" in (m.leases[lease["id"]].error or ""), SOON, "the lease's mark")


async def test_a_bind_taken_for_the_agents_own_failed_probe_names_its_driver(tmp_path: Path,
                                                                            aiohttp_client: Any) -> None:
    """A misclaimed bind keeps the driver its uevent named."""
    import time

    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lease = await r.json()
    addr = lease["devices"][0]["functions"][0]
    w, own = rig.runtime.watcher, rig.runtime.host.own
    await until(lambda: w.own_uevents >= 2, SOON, "the grant's own uevents")
    expected = own.expect(addr, "bind")
    w.deliver("bind", addr, "nouveau", time.monotonic())
    await asyncio.to_thread(own.done, expected, False)
    await until(lambda: w.counts["rebound"] == 1, SOON, "the finding")
    assert "bound to nouveau outside the agent" in list(w.findings)[0]["reason"]
