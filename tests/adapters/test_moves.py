"""Make-before-break moves (issue #22): the target GPU is bound and attached beside the old one, the guest is told,
the old one is detached and given back when the guest confirms or at the deadline; bad input is a clear 4xx that
changes nothing, a failed make leaves the guest with its GPU, a crash at each journaled step is settled by
reconcile. dgx8 over the fake kernel and the simulated hypervisor, on a controlled clock."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.lease import LeaseRequest, LeaseState
from hostagent.host.fakekernel import FakeKernel
from hostagent.runtime import build_runtime
from hostagent.services import moves
from hostagent.services.quarantine import clear_quarantine, quarantine_gpu
from hostagent.store.journal import Journal
from tests.support.agent import AgentRig, Clock, make_rig, start_rig

S = LeaseState


async def call(rig: AgentRig, who: str, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    r = await rig.client.request(method, path, json=body, headers=rig.auth(who))
    return r.status, await r.json()


async def attached(rig: AgentRig, vm: str) -> set[str]:
    return {str(h.source) for h in await rig.hv.attached_hostdevs(rig.uuids[vm])}


async def one_gpu(rig: AgentRig) -> tuple[dict[str, Any], str, str]:
    status, lease = await call(rig, "vm-a", "POST", "/v1/leases", {"gpus": 1, "task_type": "training"})
    assert status == 201, lease
    old = lease["devices"][0]["gpu_id"]
    free = next(g["id"] for g in (await call(rig, "operator", "GET", "/v1/gpus"))[1]["gpus"] if g["state"] == "free")
    return lease, old, free


async def test_a_move_makes_the_new_gpu_tells_the_guest_then_breaks_the_old(tmp_path: Path,
                                                                           aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease, old, new = await one_gpu(rig)
    old_fns = set(lease["devices"][0]["functions"])
    status, body = await call(rig, "operator", "POST", f"/v1/leases/{lease['id']}/move", {"to": new})
    assert status == 202, body
    assert body["move"]["phase"] == "waiting" and {d["gpu_id"] for d in body["devices"]} == {old, new}
    new_fns = {f for d in body["devices"] if d["gpu_id"] == new for f in d["functions"]}
    made = next(d for d in body["devices"] if d["gpu_id"] == new)  # where libvirt put it in the guest
    assert len(made["guest_addresses"]) == len(made["functions"]) and all(made["guest_addresses"]), made
    assert await attached(rig, "vm-a") == old_fns | new_fns  # made before anything is broken
    assert all(rig.sysfs_driver(f) == "vfio-pci" for f in old_fns | new_fns)
    # the guest is told in its heartbeat reply, with both GPUs and the deadline
    status, reply = await call(rig, "vm-a", "POST", f"/v1/leases/{lease['id']}/heartbeat", {"samples": []})
    warning = next(w for w in reply["warnings"] if w["code"] == "move")
    assert warning["from"] == old and warning["to"] == new and warning["deadline"] > 0
    # it confirms: the old GPU is detached and goes back to its host driver; the lease goes on with the new one
    status, done = await call(rig, "vm-a", "POST", f"/v1/leases/{lease['id']}/move/done")
    assert status == 200 and [d["gpu_id"] for d in done["devices"]] == [new] and "move" not in done, done
    assert await attached(rig, "vm-a") == new_fns
    assert all(rig.sysfs_driver(f) == "nvidia" for f in old_fns)
    assert any(f"moved from {old} to {new}" in r for r in done["reasons"])
    gpus = {g["id"]: g for g in (await call(rig, "operator", "GET", "/v1/gpus"))[1]["gpus"]}
    assert gpus[old]["state"] == "free" and gpus[new]["state"] == "leased"
    events = [e.detail or "" for e in rig.runtime.journal.events(lease_id=lease["id"])]
    steps = [e for e in rig.runtime.journal.events(lease_id=lease["id"]) if (e.detail or "").startswith("move:")]
    assert {(e.kind, e.from_state, e.to_state) for e in steps} == {("update", "ACTIVE", "ACTIVE")}, steps
    assert steps[0].actor != steps[-1].actor  # made by the operator, broken by the guest
    assert [e for e in events if e.startswith("move:")][:3] == [
        f"move: {old} -> {new}, making", *[e for e in events if "attached beside" in e][:1],
        *[e for e in events if e.startswith("move: breaking")][:1]]


async def test_without_the_guest_the_deadline_breaks_it(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock()
    rig = await start_rig(make_rig(tmp_path, clock=clock), aiohttp_client)
    lease, old, new = await one_gpu(rig)
    status, body = await call(rig, "operator", "POST", f"/v1/leases/{lease['id']}/move", {"to": new, "deadline_s": 60})
    assert status == 202 and body["move"]["deadline"] == clock.now + 60
    await rig.runtime.manager.expire_due()
    assert (await call(rig, "operator", "GET", f"/v1/leases/{lease['id']}"))[1]["move"]["phase"] == "waiting"
    clock.advance(60)  # at the deadline, not after it
    await rig.runtime.manager.expire_due()
    after = (await call(rig, "operator", "GET", f"/v1/leases/{lease['id']}"))[1]
    assert [d["gpu_id"] for d in after["devices"]] == [new] and "move" not in after
    assert any(f"moved from {old} to {new} (the deadline passed;" in r for r in after["reasons"]), after["reasons"]
    broke = [e for e in rig.runtime.journal.events(lease_id=lease["id"])
             if (e.detail or "").startswith("move: breaking")]
    assert [e.actor for e in broke] == ["agent"], broke  # the agent's own step, not the guest's
    assert any("the deadline passed" in r for r in after["reasons"])


async def test_bad_moves_get_a_clear_4xx_and_change_nothing(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease, old, new = await one_gpu(rig)
    status, other = await call(rig, "vm-b", "POST", "/v1/leases", {"gpus": 1})
    busy = other["devices"][0]["gpu_id"]
    new = next(g["id"] for g in (await call(rig, "operator", "GET", "/v1/gpus"))[1]["gpus"] if g["state"] == "free")
    before = rig.runtime.manager.leases[lease["id"]]
    path = f"/v1/leases/{lease['id']}/move"
    for who, body, code, field in [
        ("vm-a", {"to": new}, 403, None),  # the operator's
        ("operator", {"to": old}, 400, "to"),  # where it already is
        ("operator", {"to": "gpu-nope"}, 404, "to"),
        ("operator", {"to": busy}, 409, "to"),  # another lease's
        ("operator", {"to": new, "from": busy}, 400, "from"),  # not a GPU of this lease
        ("operator", {"to": new, "deadline_s": 0}, 400, "deadline_s"),
        ("operator", {"to": new, "deadline_s": "soon"}, 400, "deadline_s"),
        ("operator", {"to": new, "colour": "red"}, 400, "colour"),
        ("operator", {}, 400, "to"),
    ]:
        status, err = await call(rig, who, "POST", path, body)
        assert status == code, (body, err)
        assert field is None or err["error"]["field"] == field, (body, err)
    status, err = await call(rig, "vm-a", "POST", f"/v1/leases/{lease['id']}/move/done")
    assert status == 409 and err["error"]["field"] == "id" and "has no move waiting" in err["error"]["message"], err
    status, err = await call(rig, "vm-b", "POST", f"/v1/leases/{lease['id']}/move/done")
    assert status == 404, err  # another VM's lease does not exist for it
    assert rig.runtime.manager.leases[lease["id"]] == before
    assert rig.sysfs_driver(str(rig.runtime.manager.gpus[new].functions[0].address)) == "nvidia"


async def test_a_failed_make_leaves_the_guest_with_its_gpu(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease, old, new = await one_gpu(rig)
    target = rig.runtime.manager.gpus[new]
    FakeKernel(rig.tree.sys_root).set_fault("fail_bind", str(target.functions[0].address))
    status, err = await call(rig, "operator", "POST", f"/v1/leases/{lease['id']}/move", {"to": new})
    assert status == 409 and f"the guest keeps {old}" in err["error"]["message"], err
    after = (await call(rig, "operator", "GET", f"/v1/leases/{lease['id']}"))[1]
    assert [d["gpu_id"] for d in after["devices"]] == [old] and "move" not in after and after["state"] == "ACTIVE"
    assert rig.sysfs_driver(str(target.functions[0].address)) == "nvidia"
    assert await attached(rig, "vm-a") == set(lease["devices"][0]["functions"])


@pytest.mark.parametrize("phase", ["making-not-attached", "making-attached", "breaking", "making-no-target"])
async def test_a_crash_at_each_step_is_settled_by_reconcile(tmp_path: Path, phase: str) -> None:
    rig = make_rig(tmp_path)
    rig.runtime.use_store = False
    await rig.runtime.start()
    m = rig.runtime.manager
    lease = await m.request(rig.uuids["vm-a"], LeaseRequest(gpus=1), actor="test")
    old = lease.devices[0]
    target = next(g for g in m.gpus.values() if g.id != old.gpu_id)
    if phase == "making-no-target":  # journaled the move, died before the target joined the lease's devices
        await rig.runtime.stop()
        state = lease.with_changes(move=(("from", old.gpu_id), ("phase", "making"), ("to", target.id)))
    elif phase == "making-not-attached":
        await rig.runtime.stop()
        new = dataclasses.replace(old, gpu_id=target.id, functions=tuple(str(f.address) for f in target.functions),
                                  original_drivers=tuple("nvidia" for _ in target.functions), guest_addresses=())
        state = lease.with_changes(devices=(old, new), move=(("from", old.gpu_id), ("phase", "making"),
                                                             ("to", target.id)))
    else:
        moved = await m.move(lease.id, target.id, actor="test")
        await rig.runtime.stop()
        mv = dict(moved.move)
        if phase == "making-attached":  # killed before the make's end: no deadline journaled yet
            mv = {k: v for k, v in mv.items() if k != "deadline"}
        state = moved.with_changes(move=tuple(sorted({**mv, "phase": "making" if phase == "making-attached"
                                                      else "breaking"}.items())))
    journal = Journal(rig.settings.state_dir / "journal.sqlite3")
    try:
        journal.record(state, from_state=S.ACTIVE, actor="test")
    finally:
        journal.close()
    rig.runtime = build_runtime(rig.settings, hypervisor=rig.hv)
    rig.runtime.use_store = False
    await rig.runtime.start()
    try:
        after = rig.runtime.manager.leases[lease.id]
        repairs = [e.detail or "" for e in rig.runtime.journal.events(lease_id=lease.id, kinds=["repair"])]
        since = [e for e in rig.runtime.journal.events(lease_id=lease.id) if e.kind == "update"][-1]
        assert since.actor == "reconcile", since  # the restart's own steps, named as such
        if phase == "making-no-target":
            assert after.gpu_ids == (old.gpu_id,) and not after.move
            assert since.detail == "reconcile: a move with no target device", since
        elif phase == "making-not-attached":  # undone: the guest keeps its GPU, the target went back
            assert after.gpu_ids == (old.gpu_id,) and not after.move
            assert all(rig.sysfs_driver(str(f.address)) == "nvidia" for f in target.functions)
            assert any("undid the move" in r for r in repairs), repairs
            assert "the agent stopped before it was attached" in (since.detail or ""), since
        elif phase == "making-attached":  # made: waits for the guest again, a whole deadline from now
            assert set(after.gpu_ids) == {old.gpu_id, target.id} and dict(after.move)["phase"] == "waiting"
            assert dict(after.move)["deadline"] >= time.time() + moves.DEFAULT_DEADLINE_S - 60, after.move
            assert any("had attached: waiting for the guest" in r for r in repairs), repairs
        else:  # the break resumes: the old GPU goes back, the lease keeps the new one
            assert after.gpu_ids == (target.id,) and not after.move
            assert all(rig.sysfs_driver(f) == "nvidia" for f in old.functions)
            assert any("finished the move" in r for r in repairs), repairs
        assert all(rig.sysfs_driver(f) == "vfio-pci" for d in after.devices for f in d.functions)
    finally:
        await rig.runtime.stop()


async def test_a_failed_attach_gives_the_target_back_free_for_anyone(tmp_path: Path, aiohttp_client: Any) -> None:
    """The target was bound, its attach failed (and undid itself): it goes back to its host driver, is free again (no
    claim left on it: another VM leases it) and is not quarantined; the journal says the guest keeps its device."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease, old, new = await one_gpu(rig)
    rig.hv.fail_attach_after = 0
    status, err = await call(rig, "operator", "POST", f"/v1/leases/{lease['id']}/move", {"to": new})
    assert status == 409 and f"the guest keeps {old}" in err["error"]["message"], err
    assert err["error"]["field"] == "to", err
    m = rig.runtime.manager
    assert all(rig.sysfs_driver(str(f.address)) == "nvidia" for f in m.gpus[new].functions)
    gpus = {g["id"]: g for g in (await call(rig, "operator", "GET", "/v1/gpus"))[1]["gpus"]}
    assert gpus[new]["state"] == "free" and new not in m.quarantined and new not in m.claims
    events = [e.detail or "" for e in rig.runtime.journal.events(lease_id=lease["id"])]
    assert any(f"move to {new} failed" in e and e.endswith("the guest keeps its device") for e in events), events
    rig.hv.fail_attach_after = None
    status, other = await call(rig, "operator", "POST", f"/v1/leases/{lease['id']}/move", {"to": new})
    assert status == 202, other  # the same target, free again


async def test_a_target_that_cannot_go_back_to_its_driver_is_quarantined(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease, old, new = await one_gpu(rig)
    m = rig.runtime.manager
    FakeKernel(rig.tree.sys_root).set_fault("no_rebind", str(m.gpus[new].functions[0].address))
    rig.hv.fail_attach_after = 0
    status, err = await call(rig, "operator", "POST", f"/v1/leases/{lease['id']}/move", {"to": new})
    assert status == 409, err
    assert "a failed move could not return it to the host" in m.quarantined.get(new, ""), m.quarantined
    after = (await call(rig, "operator", "GET", f"/v1/leases/{lease['id']}"))[1]
    assert [d["gpu_id"] for d in after["devices"]] == [old] and "move" not in after
    events = [e.detail or "" for e in rig.runtime.journal.events(lease_id=lease["id"])]
    assert any(e.startswith(f"move to {new} failed: ") and "give-back failed" in e and "(quarantined)" in e
               for e in events), events


async def test_a_break_the_guest_holds_up_is_retried_until_it_lets_go(tmp_path: Path, aiohttp_client: Any) -> None:
    """The guest confirms the move but does not let go of the old device: the move stays `breaking` with both GPUs,
    the old one on vfio-pci in the domain; each expiry tick tries the break again, and once the guest lets go it
    finishes: the old GPU back on its host driver, the lease on the new one."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease, old, new = await one_gpu(rig)
    m = rig.runtime.manager
    old_fns = set(lease["devices"][0]["functions"])
    status, body = await call(rig, "operator", "POST", f"/v1/leases/{lease['id']}/move", {"to": new})
    assert status == 202, body
    rig.hv.set_refuse_detach("vm-a")
    status, done = await call(rig, "vm-a", "POST", f"/v1/leases/{lease['id']}/move/done")
    assert status == 200 and done["move"]["phase"] == "breaking", done
    await m.expire_due()  # retried: still held
    held = m.leases[lease["id"]]
    assert dict(held.move)["phase"] == "breaking" and set(held.gpu_ids) == {old, new}
    assert all(rig.sysfs_driver(f) == "vfio-pci" for f in old_fns) and old_fns <= await attached(rig, "vm-a")
    assert rig.hv.acknowledge_detaches("vm-a") == 1  # the guest lets go at last
    for _ in range(100):
        await m.expire_due()
        if not m.leases[lease["id"]].move:
            break
        await asyncio.sleep(0.05)
    after = m.leases[lease["id"]]
    assert after.gpu_ids == (new,) and not after.move, after
    assert all(rig.sysfs_driver(f) == "nvidia" for f in old_fns)
    assert any(f"moved from {old} to {new} (retry" in r for r in after.reasons), after.reasons  # by the retry
    events = [e.detail or "" for e in rig.runtime.journal.events(lease_id=lease["id"])]
    assert len([e for e in events if e.startswith("move: breaking")]) == 1, events  # journaled once, retried after


async def test_an_attach_whose_undo_the_guest_never_confirms_keeps_the_target_in_the_lease(
        tmp_path: Path, aiohttp_client: Any) -> None:
    """The target's first function attached, its second failed, and the guest never confirmed the undo's detach: the
    guest may hold the target, so it stays with the lease (on vfio-pci; it goes back with the lease) and the move
    ends; the journal says so, by whoever asked for the move."""
    rig = await start_rig(make_rig(tmp_path, scenario="workstation"), aiohttp_client)
    m = rig.runtime.manager
    # the workstation's display GPU (Xorg holds it) out of the way: the lease gets the 2080 Ti, the move goes to
    # the free two-function Radeon
    await quarantine_gpu(m, "gpu-0000-01-00-0", "the host's display GPU", "operator")
    new = "gpu-0000-03-00-0"
    # the Radeon held back while the lease is granted: with no model, placement may explore (epsilon) and take it
    await quarantine_gpu(m, new, "kept for the move", "operator")
    status, lease = await call(rig, "vm-a", "POST", "/v1/leases", {"gpus": 1})
    assert status == 201, lease
    await clear_quarantine(m, new, actor="operator")
    old = lease["devices"][0]["gpu_id"]
    assert len(m.gpus[new].functions) == 2 and m.gpu_state(new).value == "free"
    rig.hv.fail_attach_after = rig.hv.attach_count + 1  # the target's second function fails
    rig.hv.set_refuse_detach("vm-a")
    status, err = await call(rig, "operator", "POST", f"/v1/leases/{lease['id']}/move", {"to": new})
    assert status == 409 and f"{new} stays with the lease" in err["error"]["message"], err
    assert err["error"]["field"] == "to", err
    held = m.leases[lease["id"]]
    assert set(held.gpu_ids) == {old, new} and not held.move and held.state is S.ACTIVE, held
    assert all(rig.sysfs_driver(str(f.address)) == "vfio-pci" for f in m.gpus[new].functions)
    [ev] = [e for e in rig.runtime.journal.events(lease_id=lease["id"]) if "undo was not confirmed" in (e.detail or "")]
    assert ev.detail.startswith(f"move: attaching {new} failed and its undo was not confirmed; kept in the lease"), ev
    assert ev.actor == "operator(config)" and ev.to_state == "ACTIVE", ev  # the operator who asked for it
