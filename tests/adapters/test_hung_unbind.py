"""A hung unbind from vfio-pci while a lease gives its GPU back: the release answers within the step timeout, the GPU is
quarantined in a known sysfs state (never free, never on the host while a guest could hold it), other GPUs keep
leasing meanwhile, and once the write returns an operator's `gpu clear` makes the GPU leasable again.

The workstation tree's RTX 2080 Ti has four functions in one IOMMU group; the hang is armed on its second function
(the HDMI audio) after the grant, so only the give-back's `vfio-pci/unbind` of that function blocks, after the first
function already left vfio-pci: the binder must put the first one back (the group stays whole on vfio-pci) and mark
the second. The step timeout is short and the hang a few seconds longer, so each test also sees the hung write return
and checks what it left behind. Overlaps are sequenced on the fake kernel's `hanging()` marker, not on sleeps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.cli.parser import main
from hostagent.host.binding import VfioBinder
from hostagent.host.fakekernel import FakeKernel
from tests.support.agent import AgentRig, make_rig, start_rig
from tests.support.host import drivers, fake_host
from tests.support.waits import until, wait_until

STEP_S = 1.0  # host.step_timeout_s for these agents
HANG_S = 5.0  # how long the armed unbind blocks in the fake kernel: well past the step timeout
MARGIN_S = 2.5  # what a release may take beyond its step timeout on a loaded test machine (still < HANG_S)
VFIO = "vfio-pci"


def sysfs_writes_in_flight(address: str) -> list[str]:
    """The binder's worker threads still inside a sysfs write to one device (it names them sysfs-STEP-ADDRESS)."""
    return [t.name for t in threading.enumerate()
            if t.name.startswith("sysfs-") and t.name.endswith(f"-{address}") and t.is_alive()]


def override(rig: AgentRig, address: str) -> str:
    """driver_override of a function as sysfs reads it back ('(null)' when cleared)."""
    return (rig.tree.sys_root / "bus/pci/devices" / address / "driver_override").read_text().strip()


def gpu_of(rig: AgentRig, model: str) -> str:
    (gid,) = [g.id for g in rig.runtime.manager.gpus.values() if model in g.model]
    return gid


async def gpu(rig: AgentRig, gid: str) -> dict[str, Any]:
    r = await rig.client.get(f"/v1/gpus/{gid}", headers=rig.auth("operator"))
    assert r.status == 200
    return dict(await r.json())


async def hung_give_back(rig: AgentRig, kernel: FakeKernel) -> tuple[str, list[str], dict[str, str | None]]:
    """Grant the 2080 Ti to vm-a, arm a hang on its audio function's unbind, release, and wait for the release.

    Returns the GPU id, its functions and their host drivers before the grant. The hang is still on when this
    returns (the release answered after its step timeout); callers wait for its end with `settled`."""
    gid = gpu_of(rig, "2080 Ti")
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "model": "2080 Ti"}, headers=rig.auth("vm-a"))
    lease = await r.json()
    assert r.status == 201, lease
    funcs = lease["devices"][0]["functions"]
    assert len(funcs) == 4 and {rig.sysfs_driver(a) for a in funcs} == {VFIO}
    kernel.set_fault("hang_unbind", funcs[1], str(HANG_S))
    t0 = time.monotonic()
    r = await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    assert r.status == 200 and (await r.json())["state"] == "RELEASED"
    assert time.monotonic() - t0 < STEP_S + MARGIN_S
    assert funcs[1] in kernel.hanging()
    return gid, funcs, {str(f.address): f.driver for f in rig.runtime.manager.gpus[gid].functions}


async def settled(kernel: FakeKernel, address: str) -> None:
    """Wait until the hung write has returned (and had its effect) and its worker thread has ended."""
    await until(lambda: address not in kernel.hanging() and not sysfs_writes_in_flight(address), HANG_S + 5,
                "the hung unbind returned", interval=0.01)


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    return await start_rig(make_rig(tmp_path, scenario="workstation-vfio", host={"step_timeout_s": STEP_S}),
                           aiohttp_client)


async def test_hung_give_back_answers_in_time_quarantines_and_other_gpus_still_lease(rig: AgentRig) -> None:
    kernel = FakeKernel(rig.tree.sys_root)
    gid = gpu_of(rig, "2080 Ti")
    other = gpu_of(rig, "4090")
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "model": "2080 Ti"}, headers=rig.auth("vm-a"))
    lease = await r.json()
    assert r.status == 201, lease
    funcs = lease["devices"][0]["functions"]
    kernel.set_fault("hang_unbind", funcs[1], str(HANG_S))
    t0 = time.monotonic()
    release = asyncio.create_task(rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a")))
    await until(lambda: funcs[1] in kernel.hanging(), 10, "the give-back's unbind is blocked in the kernel",
                interval=0.01)

    # While that write is blocked, another GPU leases and releases, and the read endpoints answer.
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "model": "4090"}, headers=rig.auth("vm-b"))
    mine = await r.json()
    assert r.status == 201 and mine["devices"][0]["gpu_id"] == other, mine
    assert {rig.sysfs_driver(a) for a in mine["devices"][0]["functions"]} == {VFIO}
    r = await rig.client.delete(f"/v1/leases/{mine['id']}", headers=rig.auth("vm-b"))
    assert r.status == 200 and (await r.json())["state"] == "RELEASED"
    assert VFIO not in {rig.sysfs_driver(a) for a in mine["devices"][0]["functions"]}
    r = await rig.client.get("/readyz")
    assert r.status == 200 and (await r.json())["ready"] is True
    r = await rig.client.get("/v1/gpus", headers=rig.auth("operator"))
    assert r.status == 200 and {g["id"]: g["state"] for g in (await r.json())["gpus"]}[other] == "free"
    assert funcs[1] in kernel.hanging()  # all of the above ran inside the hang

    # The release answers after its step timeout, not after the hang: the lease ends (the guest let go: the detach
    # was confirmed), and the failure stays with the GPU as a quarantine.
    resp = await release
    elapsed = time.monotonic() - t0
    done = await resp.json()
    assert resp.status == 200 and done["state"] == "RELEASED", done
    assert STEP_S <= elapsed < STEP_S + MARGIN_S, elapsed
    events = (await (await rig.client.get(f"/v1/events?lease_id={lease['id']}",
                                          headers=rig.auth("operator"))).json())["events"]
    assert "did not return to its host driver" in events[-1]["detail"] and events[-1]["to_state"] == "RELEASED"
    body = await gpu(rig, gid)
    assert body["state"] == "quarantined"
    assert f"unbind-vfio of {funcs[1]} did not return within {STEP_S:g} s" in body["quarantine_reason"]
    events = (await (await rig.client.get(f"/v1/events?gpu_id={gid}", headers=rig.auth("operator"))).json())["events"]
    assert any(e["kind"] == "quarantine" for e in events)
    # A known state while the write is still blocked: the whole group on vfio-pci (the function that had already
    # left was put back), the GPU quarantined, so never offered to a guest or to the host.
    assert {a: rig.sysfs_driver(a) for a in funcs} == {a: VFIO for a in funcs}
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "model": "2080 Ti"}, headers=rig.auth("vm-c"))
    assert r.status == 409

    # The write returns: the hung function left vfio-pci (to no driver, its override still naming vfio-pci), the
    # others stay there, and the GPU is still quarantined, not silently returned to the free pool.
    await settled(kernel, funcs[1])
    assert {a: rig.sysfs_driver(a) for a in funcs} == {**{a: VFIO for a in funcs}, funcs[1]: None}
    assert override(rig, funcs[1]) == VFIO
    body = await gpu(rig, gid)
    assert body["state"] == "quarantined"
    assert {f["address"]: f["driver"] for f in body["functions"]} == {**{a: VFIO for a in funcs}, funcs[1]: None}
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "model": "2080 Ti"}, headers=rig.auth("vm-c"))
    assert r.status == 409
    assert gid not in rig.runtime.manager.claims


async def test_operator_clear_after_the_hung_write_returned_makes_the_gpu_leasable(rig: AgentRig,
                                                                                   capsys: pytest.CaptureFixture[str]
                                                                                   ) -> None:
    kernel = FakeKernel(rig.tree.sys_root)
    gid, funcs, native = await hung_give_back(rig, kernel)
    kernel.clear_fault("hang_unbind", funcs[1])  # the host process holding the function is gone
    await settled(kernel, funcs[1])
    assert (await gpu(rig, gid))["state"] == "quarantined"

    url = str(rig.client.make_url("")).rstrip("/")
    code = await asyncio.to_thread(main, ["gpu", "clear", gid, "--url", url, "--token", rig.operator])
    assert code == 0 and f"{gid}: free" in capsys.readouterr().out

    # Leasable again: the next grant binds the whole group (not refused as 'stuck after a hung unbind-vfio').
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "model": "2080 Ti"}, headers=rig.auth("vm-c"))
    lease = await r.json()
    assert r.status == 201 and lease["state"] == "ACTIVE", lease
    assert {rig.sysfs_driver(a) for a in funcs} == {VFIO}
    attached = {str(h.source) for h in await rig.hv.attached_hostdevs(rig.uuids["vm-c"])}
    assert set(funcs) <= attached
    r = await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-c"))
    assert r.status == 200 and (await r.json())["state"] == "RELEASED"
    assert (await gpu(rig, gid))["state"] == "free"
    # Nothing is left on vfio-pci and no override lingers: the clear gave the group back (the hung function
    # included), so this lease found every function on its host driver and returned each there.
    assert {a: rig.sysfs_driver(a) for a in funcs} == native
    assert {override(rig, a) for a in funcs} == {"(null)"}


async def test_operator_clear_gives_a_gpu_left_on_vfio_pci_back_to_its_host_drivers(rig: AgentRig) -> None:
    kernel = FakeKernel(rig.tree.sys_root)
    gid, funcs, native = await hung_give_back(rig, kernel)
    kernel.clear_fault("hang_unbind", funcs[1])
    await settled(kernel, funcs[1])
    r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", json={}, headers=rig.auth("operator"))
    assert r.status == 200 and (await r.json())["state"] == "free"
    # Product rule: a GPU without a lease is never left on vfio-pci; the hung function goes back to its driver too.
    assert {a: rig.sysfs_driver(a) for a in funcs} == native
    events = await rig.runtime.run(rig.runtime.journal.events, gpu_id=gid, kinds=["repair"])
    assert "gave back to the host drivers" in (events[-1].detail or "")


async def test_operator_clear_refuses_while_a_domain_holds_the_gpu_or_the_domains_cannot_be_listed(
        rig: AgentRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clear must not give a GPU to the host while some guest may use it: attached to a domain without a
    lease, or the hypervisor unable to say, it answers 409 and changes nothing (quarantine kept, still on vfio-pci)."""
    from hostagent.domain.errors import HypervisorUnavailable
    from hostagent.domain.hostdev import HostdevPci, alias_for
    from hostagent.domain.pci import PciAddress

    kernel = FakeKernel(rig.tree.sys_root)
    gid, funcs, _ = await hung_give_back(rig, kernel)
    kernel.clear_fault("hang_unbind", funcs[1])
    await settled(kernel, funcs[1])
    before = {a: rig.sysfs_driver(a) for a in funcs}
    assert before[funcs[0]] == VFIO

    async def unlistable() -> list[Any]:
        raise HypervisorUnavailable("libvirtd is not answering")

    with monkeypatch.context() as m:
        m.setattr(rig.hv, "list_domains", unlistable)
        r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", json={}, headers=rig.auth("operator"))
        body = await r.json()
    assert r.status == 409 and "cannot be listed" in body["error"]["message"], body
    assert (await gpu(rig, gid))["state"] == "quarantined"
    assert {a: rig.sysfs_driver(a) for a in funcs} == before

    vm_b = next(d for d in rig.hv.domains_sync() if d.name == "vm-b")
    addr = PciAddress.parse(funcs[0])
    await rig.hv.attach_hostdevs(vm_b.uuid, [HostdevPci(source=addr, guest=None, alias=alias_for(addr))])
    r = await rig.client.post(f"/v1/gpus/{gid}/clear-quarantine", json={}, headers=rig.auth("operator"))
    body = await r.json()
    assert r.status == 409 and "attached to vm-b without a lease" in body["error"]["message"], body
    assert (await gpu(rig, gid))["state"] == "quarantined"
    assert {a: rig.sysfs_driver(a) for a in funcs} == before


def test_binder_leaves_a_device_alone_while_its_hung_write_is_in_flight_and_only_then(tmp_path: Path) -> None:
    host, kernel, inv = fake_host(tmp_path, "workstation")
    group = next(g for g in inv.gpus if len(g.functions) == 4).group
    assert group is not None
    funcs = [str(a) for a in group.addresses]
    native = drivers(kernel, funcs)
    binder = VfioBinder(kernel, host.dev_root, step_timeout_s=0.1)
    assert binder.bind_group(group).ok
    kernel.set_fault("hang_unbind", funcs[1], "1.0")
    res = binder.release_group(group, native)
    assert not res.ok and res.needs_attention and res.stopped_at == f"unbind-vfio {funcs[1]}"
    assert binder.stuck == {funcs[1]: "unbind-vfio"}
    assert kernel.hanging() == {funcs[1]: "vfio-pci/unbind"}
    assert ("undo-unbind-vfio", funcs[0], True) in [(st.name, st.address, st.ok) for st in res.steps]
    assert drivers(kernel, funcs) == {a: VFIO for a in funcs}  # the function already taken off went back
    kernel.clear_fault("hang_unbind", funcs[1])
    # While the write may still land, nothing touches the group, in either direction.
    for again in (binder.release_group(group, native), binder.bind_group(group)):
        assert not again.ok and again.needs_attention and again.steps == ()
        assert f"{funcs[1]} is stuck after a hung unbind-vfio" in (again.error or "")
    returned = wait_until(lambda: not kernel.hanging() and not sysfs_writes_in_flight(funcs[1]), 10, interval=0.01)
    assert returned, "the hung unbind returned"
    assert drivers(kernel, funcs) == {**{a: VFIO for a in funcs}, funcs[1]: None}
    # Returned: the device reads back like after a restart, and the next operation may take it (keeping it out of
    # placement until an operator looks is the lease service's quarantine).
    res = binder.release_group(group, native)
    assert res.ok, res.error
    assert binder.stuck == {} and drivers(kernel, funcs) == native
