"""What reconciliation at start says it did: each repair names its lease (in the repairs list and in the journal),
each step it takes is the reconciler's, and a lease it ends says why.

Operators read these lines to learn what the agent changed while they were not looking (`hostagent repairs`, the
lease page's events); a repair with no lease, or a step with no actor, is a step nobody can trace.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hostagent.domain.errors import HypervisorUnavailable
from hostagent.domain.lease import LeaseRequest, LeaseState
from hostagent.host.fakekernel import FakeKernel
from hostagent.runtime import build_runtime
from hostagent.services.lease_types import guest_addr
from hostagent.services.reconcile import Reconciler
from hostagent.store.journal import Journal
from tests.support.agent import AgentRig, make_rig

S = LeaseState


async def _leased_then_stopped(tmp_path: Path, gpus: int = 1) -> tuple[AgentRig, str, list[str]]:
    """One ACTIVE lease of vm-a, then the agent stops (the lease stays in the journal, its GPUs on vfio-pci)."""
    rig = make_rig(tmp_path)
    rig.runtime.use_store = False
    await rig.runtime.start()
    lease = await rig.runtime.manager.request(rig.uuids["vm-a"], LeaseRequest(gpus=gpus), actor="test")
    assert lease.state is S.ACTIVE
    functions = [f for d in lease.devices for f in d.functions]
    await rig.runtime.stop()
    return rig, lease.id, functions


async def _start_again(rig: AgentRig) -> None:
    rig.runtime = build_runtime(rig.settings, hypervisor=rig.hv)
    rig.runtime.use_store = False
    await rig.runtime.start()


def _journal_steps(rig: AgentRig, lease_id: str, *states: LeaseState, **changes: Any) -> None:
    """Journal the stopped agent's lease through `states`, as if it had died in the last of them; `changes` (a field
    -> a function of the lease) are made at the first step."""
    journal = Journal(rig.settings.state_dir / "journal.sqlite3")
    try:
        lease = journal.get(lease_id)
        assert lease is not None
        lease = dataclasses.replace(lease, **{k: f(lease) for k, f in changes.items()})
        for st in states:
            prev, lease = lease.state, dataclasses.replace(lease, state=st)
            journal.record(lease, from_state=prev, actor="test")
    finally:
        journal.close()


def _repair_events(rig: AgentRig, lease_id: str) -> list[str]:
    return [e.detail or "" for e in rig.runtime.journal.events(lease_id=lease_id, kinds=["repair"])]


async def test_a_lease_whose_domain_is_gone_ends_by_the_reconciler_saying_why(tmp_path: Path) -> None:
    rig, lease_id, functions = await _leased_then_stopped(tmp_path)
    rig.hv.undefine("vm-a")  # while the agent was away
    await _start_again(rig)
    try:
        rt = rig.runtime
        done = rt.journal.get(lease_id)
        assert done is not None and done.state is S.RELEASED and done.end_reason == "domain undefined", done
        steps = [(e.to_state, e.actor, e.detail) for e in rt.journal.events(lease_id=lease_id, kinds=["transition"])]
        assert ("RELEASING", Reconciler.ACTOR, "domain no longer exists") in steps, steps
        assert all(actor == Reconciler.ACTOR for _, actor, _ in steps[steps.index(
            ("RELEASING", Reconciler.ACTOR, "domain no longer exists")):]), steps
        (note,) = [r for r in rt.repairs if r.subject == lease_id]
        assert note.found == "ACTIVE lease whose domain is gone" and note.action == "released: RELEASED"
        assert _repair_events(rig, lease_id) == ["found ACTIVE lease whose domain is gone; released: RELEASED"]
        assert all(rig.sysfs_driver(f) == "nvidia" for f in functions)
    finally:
        await rig.runtime.stop()


async def test_an_unanswered_reattach_keeps_the_lease_and_says_so_on_it(tmp_path: Path) -> None:
    rig, lease_id, functions = await _leased_then_stopped(tmp_path)
    rig.hv.eject("vm-a", functions[0])  # its DEVICE_REMOVED lost: nobody listened

    async def unreachable(*_: object, **__: object) -> None:
        raise HypervisorUnavailable("libvirt: connection reset by peer")

    rig.hv.attach_hostdevs = unreachable  # type: ignore[method-assign]
    await _start_again(rig)
    try:
        rt = rig.runtime
        assert rt.manager.leases[lease_id].state is S.ACTIVE  # unreachable says nothing of the guest: kept
        assert all(rig.sysfs_driver(f) == "vfio-pci" for f in functions)
        (note,) = [r for r in rt.repairs if r.subject == lease_id]
        assert note.action.startswith("re-attach failed") and note.action.endswith("lease kept until libvirt answers")
        (detail,) = _repair_events(rig, lease_id)
        assert "re-attach failed" in detail, detail
    finally:
        await rig.runtime.stop()


async def test_a_lease_stopped_in_rebinding_is_finished_under_its_own_id(tmp_path: Path) -> None:
    rig, lease_id, functions = await _leased_then_stopped(tmp_path)
    # the agent died after the guest let go and before the GPU was back on its host driver
    rig.hv.eject("vm-a", functions[0])
    _journal_steps(rig, lease_id, S.RELEASING, S.DETACHING, S.REBINDING)
    await _start_again(rig)
    try:
        rt = rig.runtime
        done = rt.journal.get(lease_id)
        assert done is not None and done.state is S.RELEASED, done
        (note,) = [r for r in rt.repairs if r.subject == lease_id]
        assert note.found == "lease stopped in REBINDING" and note.action == "gave devices back: now RELEASED"
        assert _repair_events(rig, lease_id) == ["found lease stopped in REBINDING; gave devices back: now RELEASED"]
        assert all(rig.sysfs_driver(f) == "nvidia" for f in functions)
    finally:
        await rig.runtime.stop()


async def test_a_lease_stopped_in_attaching_without_its_device_is_rolled_back_saying_where_it_stopped(
        tmp_path: Path) -> None:
    rig, lease_id, functions = await _leased_then_stopped(tmp_path, gpus=2)
    for f in functions:
        rig.hv.eject("vm-a", f)  # the attach never completed, as far as the domain shows
    _journal_steps(rig, lease_id, S.ATTACHING)
    await _start_again(rig)
    try:
        rt = rig.runtime
        done = rt.journal.get(lease_id)
        assert done is not None and done.state is S.FAILED, done
        (note,) = [r for r in rt.repairs if r.subject == lease_id]
        gave = "; ".join(f"gave {d.gpu_id} back to its host driver" for d in done.devices)
        assert note.found == "lease stopped in ATTACHING" and note.action == f"rolled back to FAILED: {gave}", note
        (step,) = [e for e in rt.journal.events(lease_id=lease_id, kinds=["transition"]) if e.to_state == "FAILED"]
        assert step.detail == gave and step.actor == Reconciler.ACTOR, step
        assert all(rig.sysfs_driver(f) == "nvidia" for f in functions)
    finally:
        await rig.runtime.stop()


async def test_a_lease_stopped_in_attaching_whose_guest_keeps_the_device_waits_for_it_by_the_reconcilers_steps(
        tmp_path: Path) -> None:
    """Stopped in ATTACHING with one of its two GPUs attached, and the guest does not let go of the undo's detach:
    the lease holds the devices (DETACH_PENDING, nothing given back), and every step on the way is the
    reconciler's."""
    rig, lease_id, functions = await _leased_then_stopped(tmp_path, gpus=2)
    journal = Journal(rig.settings.state_dir / "journal.sqlite3")
    try:
        lease = journal.get(lease_id)
        assert lease is not None
        for f in lease.devices[1].functions:
            rig.hv.eject("vm-a", f)  # the attach stopped after the first GPU
    finally:
        journal.close()
    rig.hv.set_refuse_detach("vm-a")
    _journal_steps(rig, lease_id, S.ATTACHING)
    await _start_again(rig)
    try:
        rt = rig.runtime
        assert rt.manager.leases[lease_id].state is S.DETACH_PENDING
        assert all(rig.sysfs_driver(f) == "vfio-pci" for f in functions)
        (note,) = [r for r in rt.repairs if r.subject == lease_id]
        assert (note.found, note.action) == ("lease stopped in ATTACHING",
                                             "detach not acknowledged: lease kept DETACH_PENDING"), note
        steps = [(e.to_state, e.actor) for e in rt.journal.events(lease_id=lease_id, kinds=["transition"])
                 if e.actor != "test"][-4:]
        assert steps == [(st, Reconciler.ACTOR) for st in ("ACTIVE", "RELEASING", "DETACHING", "DETACH_PENDING")], \
            steps
    finally:
        await rig.runtime.stop()


async def test_a_leased_device_found_off_vfio_pci_is_bound_again_and_the_repair_says_which(tmp_path: Path) -> None:
    """The host rebooted while the agent was away (leases are kept while a domain is shut off): the domain is shut
    off and the lease's functions came back on their host driver. The restart binds them to vfio-pci again, each
    repair naming its GPU, or saying why the bind failed."""
    rig = make_rig(tmp_path, leases={"keep_on_domain_stop": True})
    rig.runtime.use_store = False
    await rig.runtime.start()
    lease = await rig.runtime.manager.request(rig.uuids["vm-a"], LeaseRequest(gpus=2), actor="test")
    assert lease.state is S.ACTIVE
    await rig.runtime.stop()
    rig.hv.shutdown("vm-a")  # the reboot: the guest let go of every device
    kernel = FakeKernel(rig.tree.sys_root)
    for f in (a for d in lease.devices for a in d.functions):  # and the host's drivers took them at boot
        kernel.write(f"bus/pci/devices/{f}/driver_override", "\n")
        kernel.write("bus/pci/drivers/vfio-pci/unbind", f)
        kernel.write("bus/pci/drivers_probe", f)
        assert rig.sysfs_driver(f) == "nvidia"
    ok, bad = lease.devices
    kernel.set_fault("fail_bind", bad.functions[0])  # one of them will not go back to vfio-pci
    await _start_again(rig)
    try:
        rt = rig.runtime
        assert all(rig.sysfs_driver(f) == "vfio-pci" for f in ok.functions)
        events = _repair_events(rig, lease.id)
        assert f"found {ok.gpu_id} not on vfio-pci; re-bound" in events, events
        assert any(e.startswith(f"found {bad.gpu_id} not on vfio-pci; re-bind failed: ") for e in events), events
        notes = {r.subject: r for r in rt.repairs}
        assert notes[lease.id].found.endswith("not on vfio-pci"), rt.repairs
    finally:
        await rig.runtime.stop()


async def test_a_lease_stopped_in_attaching_with_every_device_attached_is_finished_with_the_domains_addresses(
        tmp_path: Path) -> None:
    """The agent died after the attach and before ACTIVE: the journal says ATTACHING with no guest addresses (libvirt
    chooses them at the attach), the domain holds every function. The restart finishes the lease to ACTIVE, saying
    so, with the guest addresses the domain gave each function."""
    rig, lease_id, functions = await _leased_then_stopped(tmp_path, gpus=2)
    live = {str(h.source): h for h in await rig.hv.attached_hostdevs(rig.uuids["vm-a"])}
    _journal_steps(rig, lease_id, S.ATTACHING, devices=lambda lease: tuple(
        dataclasses.replace(d, guest_addresses=("",) * len(d.functions)) for d in lease.devices))
    await _start_again(rig)
    try:
        rt = rig.runtime
        done = rt.manager.leases[lease_id]
        assert done.state is S.ACTIVE, done
        want = {f: guest_addr(live[f]) for f in functions}
        assert all(want.values()) and {a: g for d in done.devices for a, g in zip(d.functions, d.guest_addresses)} \
            == want, done.devices
        assert _repair_events(rig, lease_id) == ["found ATTACHING lease fully attached; finished to ACTIVE"]
        (step,) = [e for e in rt.journal.events(lease_id=lease_id, kinds=["transition"]) if e.actor == Reconciler.ACTOR]
        assert (step.to_state, step.detail) == ("ACTIVE", "reconcile: attach had completed"), step
    finally:
        await rig.runtime.stop()
