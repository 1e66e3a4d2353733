"""A failed attach whose undo is never confirmed: the devices stay on vfio-pci, flagged for an operator.

When an attach fails part-way, the hypervisor undoes what it attached with a detach. If the guest never confirms
that detach (no DEVICE_REMOVED), QEMU may still hold the functions: giving them back to the host driver would
pull a device out from under a running guest. The agent keeps every device of the failed grant on vfio-pci, marks
its GPU for an operator's attention (GET /v1/gpus: "unavailable", with the reason) and never leases it again until
then (hostagent.services.grant_path.rollback). The simulated hypervisor reports such an undo as libvirt's adapter
does when the domain's guest refuses detaches (`refuse_detach`) and an attach fails (`fail_attach_after`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hostagent.runtime import build_runtime, make_app
from tests.support.agent import AgentRig, make_rig, start_rig

VFIO = "vfio-pci"


async def test_an_unconfirmed_undo_keeps_the_devices_on_vfio_for_an_operator(tmp_path: Path,
                                                                             aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    hv, op = rig.hv, rig.auth("operator")
    hv.set_refuse_detach("vm-a")  # vm-a's guest ignores detach requests, the undo's included
    hv.fail_attach_after = hv.attach_count + 1  # the first GPU attaches, the second fails

    r = await rig.client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 500 and body["error"]["code"] == "lease_failed", body
    failed = body["lease"]
    assert failed["state"] == "FAILED" and "simulated failure attaching" in failed["error"]
    gpus = [d["gpu_id"] for d in failed["devices"]]
    fns = {d["gpu_id"]: d["functions"] for d in failed["devices"]}
    first, second = gpus
    # the undo was not confirmed: the first GPU's functions are still in the guest
    attached = {str(h.source) for h in await hv.attached_hostdevs(rig.uuids["vm-a"])}
    assert set(fns[first]) <= attached and not set(fns[second]) & attached, attached

    # nothing went back to the host driver: every function of both GPUs is still on vfio-pci
    assert {a: rig.sysfs_driver(a) for g in gpus for a in fns[g]} == {a: VFIO for g in gpus for a in fns[g]}
    listed = {g["id"]: g for g in (await (await rig.client.get("/v1/gpus", headers=op)).json())["gpus"]}
    for g in gpus:
        assert listed[g]["state"] == "unavailable" and listed[g]["lease"] is None, listed[g]
        assert "undo was not confirmed" in listed[g]["attention"], listed[g]
    events = (await (await rig.client.get(f"/v1/events?lease_id={failed['id']}", headers=op)).json())["events"]
    assert sorted(e["gpu_id"] for e in events if e["kind"] == "attention") == sorted(gpus), events
    final = [e for e in events if e.get("to_state") == "FAILED"]
    assert final and all(f"kept {g} on vfio-pci" in final[-1]["detail"] for g in gpus), final
    # and no lease gets them: only the other six GPUs can be asked for
    r = await rig.client.post("/v1/leases", json={"gpus": 7}, headers=rig.auth("vm-b"))
    refused = await r.json()
    assert r.status == 409 and "only 6 GPU(s)" in refused["error"]["message"], refused

    # A restart forgets the in-memory marks; the reconcile finds the first GPU attached to vm-a without a lease
    # and leaves it bound for an operator. The second, attached nowhere, is an orphan and goes back to the host.
    await rig.client.close()
    runtime = build_runtime(rig.settings)
    rig.client = await aiohttp_client(make_app(runtime))
    assert runtime.manager.attention.get(first, "").startswith("attached to vm-a without a lease"), \
        runtime.manager.attention
    assert all(rig.sysfs_driver(a) == VFIO for a in fns[first])
    assert all(rig.sysfs_driver(a) == "nvidia" for a in fns[second])
    listed = {g["id"]: g["state"] for g in (await (await rig.client.get("/v1/gpus", headers=op)).json())["gpus"]}
    assert (listed[first], listed[second]) == ("unavailable", "free")


async def test_a_confirmed_undo_gives_every_device_back(tmp_path: Path, aiohttp_client: Any) -> None:
    """The same failure with a guest that lets go: the undo is confirmed and both GPUs go back at once."""
    rig: AgentRig = await start_rig(make_rig(tmp_path), aiohttp_client)
    rig.hv.fail_attach_after = rig.hv.attach_count + 1
    r = await rig.client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 500 and body["lease"]["state"] == "FAILED", body
    assert await rig.hv.attached_hostdevs(rig.uuids["vm-a"]) == ()
    for d in body["lease"]["devices"]:
        assert all(rig.sysfs_driver(a) == "nvidia" for a in d["functions"])
        assert rig.runtime.manager.gpu_state(d["gpu_id"]).value == "free"
    assert not rig.runtime.manager.attention


async def test_the_operator_clears_the_mark_once_the_guest_lets_go(tmp_path: Path, aiohttp_client: Any) -> None:
    """The way back without a restart: `hostagent gpu clear` (POST /v1/gpus/{id}/clear-quarantine) is refused while
    the guest still holds the device; once it lets go, the clear gives the functions back to the host driver, the
    GPU is placeable again, and the journal says who cleared what."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    hv, op = rig.hv, rig.auth("operator")
    hv.set_refuse_detach("vm-a")
    hv.fail_attach_after = hv.attach_count + 1
    failed = (await (await rig.client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))).json())["lease"]
    first, second = (d["gpu_id"] for d in failed["devices"])
    fns = {d["gpu_id"]: d["functions"] for d in failed["devices"]}

    r = await rig.client.post(f"/v1/gpus/{first}/clear-quarantine", headers=op)
    body = await r.json()
    assert r.status == 409 and "attached to vm-a" in body["error"]["message"], body
    assert rig.runtime.manager.gpu_state(first).value == "unavailable"
    assert all(rig.sysfs_driver(a) == VFIO for a in fns[first])
    r = await rig.client.post(f"/v1/gpus/{first}/clear-quarantine", headers=rig.auth("vm-a"))
    assert r.status == 403  # a guest cannot clear anything

    hv.acknowledge_detaches("vm-a")  # the guest finally lets go
    hv.fail_attach_after = None
    for gpu in (first, second):
        r = await rig.client.post(f"/v1/gpus/{gpu}/clear-quarantine", headers=op)
        assert r.status == 200, await r.text()
        assert all(rig.sysfs_driver(a) == "nvidia" for a in fns[gpu])
        assert rig.runtime.manager.gpu_state(gpu).value == "free"
    r = await rig.client.post(f"/v1/gpus/{first}/clear-quarantine", headers=op)
    assert r.status == 409  # nothing left to clear
    events = (await (await rig.client.get("/v1/events", headers=op)).json())["events"]
    assert sorted(e["gpu_id"] for e in events if e["kind"] == "attention-cleared") == sorted([first, second])
    r = await rig.client.post("/v1/leases", json={"gpus": 8}, headers=rig.auth("vm-b"))
    assert r.status == 201, await r.text()
