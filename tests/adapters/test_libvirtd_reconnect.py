"""The agent across a lost libvirt connection: the re-read on reconnect ends leases whose domain stopped or vanished
meanwhile, and nothing else; and a lease whose device is missing from its domain is attached again or ends.

The first test drives the simulated hypervisor (an error mid-re-read must not give a GPU back); the second runs the
whole runtime on the real LibvirtHypervisor against a private libvirtd + QEMU that is killed and restarted, and
fails, never skips, when that daemon cannot start.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid as uuidlib
from pathlib import Path

import pytest

from hostagent.domain.errors import HypervisorUnavailable
from hostagent.domain.hostdev import hostdevs_for_gpu, parse_domain_hostdevs
from hostagent.domain.lease import Lease, LeaseRequest, LeaseState
from hostagent.domain.pci import PciAddress
from hostagent.host.fakesysfs import build_tree
from hostagent.runtime import MISSED_WHILE_AWAY, Runtime, build_runtime
from hostagent.virt.libvirt_adapter import LibvirtHypervisor
from hostagent.virt.port import DomainEvent, DomainInfo, EventKind
from hostagent.virt.sim import SimulatedHypervisor
from tests.support.agent import make_rig, rig_settings, sysfs_driver
from tests.support.libvirtd import PrivateLibvirtd, libvirtd, tiny_domain_xml  # noqa: F401 (libvirtd: a fixture)
from tests.support.waits import until

S = LeaseState


def state_of(rt: Runtime, lease_id: str) -> LeaseState:
    """A lease's state: live in the manager, or as the journal kept it once ended."""
    live = rt.manager.leases.get(lease_id)
    if live is not None:
        return live.state
    ended = rt.journal.get(lease_id)
    assert ended is not None, lease_id
    return ended.state


def releasing_actor(rt: Runtime, lease_id: str) -> str:
    """Who ended the lease: the actor of its step to RELEASING in the journal."""
    (step,) = [e for e in rt.journal.events(lease_id=lease_id) if e.to_state == S.RELEASING.value]
    return step.actor


async def test_reread_error_keeps_the_lease_and_reads_again(tmp_path: Path) -> None:
    """After a reconnect the agent re-reads each ACTIVE lease's domain. An error from that read (here the connection
    drops again mid-read) says nothing about the guest, which may still run with its GPU: the lease stays ACTIVE on
    vfio-pci (the agent used to take any error for "undefined" and give the GPU back to the host under a running
    guest) and the domain is read again until libvirt answers. A definite NotFound still ends its lease at once."""
    rig = make_rig(tmp_path)
    rt, hv = rig.runtime, rig.hv
    rt.use_store = False
    rt.reread_retry_s = 0.05
    await rt.start()
    try:
        a = await rt.manager.request(rig.uuids["vm-a"], LeaseRequest(gpus=1), actor="test")
        b = await rt.manager.request(rig.uuids["vm-b"], LeaseRequest(gpus=1), actor="test")
        fa, fb = a.devices[0].functions[0], b.devices[0].functions[0]
        assert a.state is S.ACTIVE and rig.sysfs_driver(fa) == "vfio-pci"
        listeners = list(hv._subscribers)
        hv._emit(DomainEvent("", "", EventKind.DISCONNECTED))
        hv._subscribers.clear()  # the connection is down: events are lost
        hv.undefine("vm-b")  # gone for good while the agent was away: a definite NotFound on the re-read
        reads: list[str] = []
        answering = asyncio.Event()
        real_get = hv.get_domain

        async def flaky(name_or_uuid: str) -> DomainInfo:
            reads.append(name_or_uuid)
            if name_or_uuid == a.domain_uuid and not answering.is_set():
                raise HypervisorUnavailable("reading domain vm-a: libvirt connection unavailable: dropped again")
            return await real_get(name_or_uuid)

        hv.get_domain = flaky  # type: ignore[method-assign]
        hv._subscribers.extend(listeners)
        hv._emit(DomainEvent("", "", EventKind.RECONNECTED))
        # The retry reading vm-a a second time means the first pass is over, whatever it did with the lease.
        await until(lambda: reads.count(a.domain_uuid) >= 2 or state_of(rt, a.id) is not S.ACTIVE, 10.0,
                    "a second read of vm-a")
        assert state_of(rt, a.id) is S.ACTIVE, rt.journal.get(a.id)
        assert rig.sysfs_driver(fa) == "vfio-pci"  # still the guest's: never rebound under a running guest
        assert (await real_get("vm-a")).state == "running"
        await until(lambda: state_of(rt, b.id) is S.RELEASED, 20.0, "vm-b's lease released")
        done_b = rt.journal.get(b.id)
        assert done_b is not None and done_b.end_reason == f"domain undefined ({MISSED_WHILE_AWAY})"
        assert rig.sysfs_driver(fb) == "nvidia"
        # vm-a stops while the agent still cannot read it (its event lost); once libvirt answers, the retry finds it.
        hv._subscribers.clear()
        hv.shutdown("vm-a")
        hv._subscribers.extend(listeners)
        answering.set()
        await until(lambda: state_of(rt, a.id) is S.RELEASED, 20.0, "vm-a's lease released by the retry")
        done_a = rt.journal.get(a.id)
        assert done_a is not None and done_a.end_reason == f"domain stopped ({MISSED_WHILE_AWAY})"
        assert releasing_actor(rt, a.id) == "reconnect"
        assert rig.sysfs_driver(fa) == "nvidia"
    finally:
        await rt.stop()


# -- the real libvirtd ------------------------------------------------------------------------------------------
def _define(daemon: PrivateLibvirtd, tmp_path: Path, name: str, uid: str, *, start: bool) -> None:
    xml = tmp_path / f"{name}.xml"
    xml.write_text(tiny_domain_xml(name, uuid=uid))
    daemon.virsh("define", str(xml))
    if start:
        daemon.virsh("start", uid)


def _config_attach(daemon: PrivateLibvirtd, tmp_path: Path, lease: Lease) -> None:
    """The lease's hostdevs into its domain's persistent XML only (the running QEMU cannot take them here)."""
    for dev in lease.devices:
        for hd in hostdevs_for_gpu([PciAddress.parse(f) for f in dev.functions], 1, 0):
            f = tmp_path / f"{hd.alias}.xml"
            f.write_text(hd.to_xml())
            daemon.virsh("attach-device", lease.domain_uuid, str(f), "--config")


@pytest.mark.libvirtd
@pytest.mark.asyncio(loop_scope="session")  # libvirt binds its event implementation to one loop per process
@pytest.mark.timeout(90)
async def test_agent_on_a_real_libvirtd_across_its_restart(libvirtd: PrivateLibvirtd, tmp_path: Path) -> None:
    """Three ACTIVE leases meet a real libvirtd; the agent is never restarted while libvirtd is killed and started.

    - vm-ra runs, its lease's hostdev only in its persistent XML (the running QEMU never got it): at start the
      agent attaches it again, libvirt refuses (this host has no IOMMU for VFIO), and the lease ends, its GPU back on
      the host driver and the hostdev out of the persistent XML. A lease is never left ACTIVE without its device,
      the invariant the crash matrix checks (tests/support/crash.py).
    - vm-rb and vm-rc are shut off with `leases.keep_on_domain_stop`: their leases hold the GPUs in the persistent
      XML and stay ACTIVE. libvirtd dies; vm-rb's definition is removed while it is down; libvirtd comes back. The
      agent reconnects, re-reads, and ends vm-rb's lease as an undefine missed while away (given back), leaving
      vm-rc's alone; vm-rc's undefine then arrives as a libvirt event, which proves the agent subscribed again.

    How the leases come to be ACTIVE: live PCI assignment needs an IOMMU (VFIO) this host lacks, so the journal is
    seeded by the agent's own grant path, run once over the simulated hypervisor with domains of the same UUIDs (a
    stand-in for a host where the attach works): the GPUs are bound to vfio-pci in the fake sysfs by the agent and
    the journal holds each lease's real history up to ACTIVE. From there on nothing is faked: the real adapter, its
    refusal, events, reconnect, state re-read and CONFIG detach. (A live lease across a restart, QEMU holding the
    device, is the nested e2e's to prove.)
    """
    asyncio.get_running_loop().set_debug(True)  # asyncio raises on loop calls from libvirt's threads: keep it on
    tree = build_tree(tmp_path / "host", "dgx8")
    uids = {"vm-ra": str(uuidlib.uuid4()), "vm-rb": str(uuidlib.uuid4()), "vm-rc": str(uuidlib.uuid4())}
    settings = rig_settings(tmp_path, tree, tmp_path / "hv.json", "op-token",
                            libvirt={"uri": libvirtd.uri, "detach_timeout_s": 2.0},
                            leases={"keep_on_domain_stop": True})

    # 1. The grants, by the agent, over the simulated stand-in.
    sim = SimulatedHypervisor(path=tmp_path / "hv.json")
    for name, uid in uids.items():
        sim.define(name, running=True, uuid=uid)
    seeder = build_runtime(settings, hypervisor=sim)
    seeder.use_store = False
    await seeder.start()
    try:
        a, b, c = [await seeder.manager.request(uid, LeaseRequest(gpus=1), actor="test") for uid in uids.values()]
    finally:
        await seeder.stop()
    assert a.state is S.ACTIVE and b.state is S.ACTIVE and c.state is S.ACTIVE

    # 2. The real guests, holding the hostdevs in their persistent XML; only vm-ra runs.
    for (name, uid), lease in zip(uids.items(), (a, b, c)):
        await asyncio.to_thread(_define, libvirtd, tmp_path, name, uid, start=name == "vm-ra")
        await asyncio.to_thread(_config_attach, libvirtd, tmp_path, lease)
    functions = {x.id: [(f, o) for d in x.devices for f, o in zip(d.functions, d.original_drivers)]
                 for x in (a, b, c)}

    # 3. The agent on the real libvirtd: vm-ra's lease ends (libvirt refuses the re-attach), the others are kept.
    hv = LibvirtHypervisor(libvirtd.uri, reconnect_initial_s=0.1, reconnect_max_s=0.5)
    rt = build_runtime(settings, hypervisor=hv)
    rt.use_store = False
    await rt.start()
    try:
        (note,) = [r for r in rt.repairs if r.subject == a.id]
        assert note.action.startswith("re-attach refused") and note.action.endswith("lease ended"), note
        assert state_of(rt, a.id) is S.RELEASED
        done_a = rt.journal.get(a.id)
        assert done_a is not None and (done_a.end_reason or "").startswith(
            "device missing from the domain; re-attach refused"), done_a.end_reason
        assert all(sysfs_driver(tree.sys_root, f) == orig for f, orig in functions[a.id])
        inactive_a = await asyncio.to_thread(libvirtd.virsh, "dumpxml", uids["vm-ra"], "--inactive")
        assert parse_domain_hostdevs(inactive_a) == ()  # the release's CONFIG detach went through libvirt
        for lease in (b, c):
            assert state_of(rt, lease.id) is S.ACTIVE
            assert not [r for r in rt.repairs if r.subject == lease.id]  # nothing was missing: no repair
            assert all(sysfs_driver(tree.sys_root, f) == "vfio-pci" for f, _ in functions[lease.id])

        # 4. libvirtd dies; vm-rb's definition goes while nobody watches; libvirtd comes back.
        await asyncio.to_thread(libvirtd.kill_libvirtd)
        await until(lambda: not rt.hypervisor_ok, 20.0, "the agent noticing the lost connection")
        (libvirtd.base / "etc" / "qemu" / "vm-rb.xml").unlink()
        assert state_of(rt, b.id) is S.ACTIVE  # nothing can have told the agent yet
        await asyncio.to_thread(libvirtd.start_libvirtd)

        # 5. Reconnected (same agent), vm-rb's lease ended by the re-read, vm-rc's untouched.
        await until(lambda: state_of(rt, b.id) is S.RELEASED, 30.0, "vm-rb's lease released after the reconnect")
        assert rt.started and rt.readiness()["hypervisor"]["ok"] is True
        done_b = rt.journal.get(b.id)
        assert done_b is not None and done_b.end_reason == f"domain undefined ({MISSED_WHILE_AWAY})"
        assert releasing_actor(rt, b.id) == "reconnect"
        assert all(sysfs_driver(tree.sys_root, f) == orig for f, orig in functions[b.id])
        assert state_of(rt, c.id) is S.ACTIVE
        assert all(sysfs_driver(tree.sys_root, f) == "vfio-pci" for f, _ in functions[c.id])

        # 6. vm-rc is undefined now: the event path (re-subscribed) ends its lease, not a re-read.
        await asyncio.to_thread(libvirtd.virsh, "undefine", uids["vm-rc"])
        await until(lambda: state_of(rt, c.id) is S.RELEASED, 20.0, "vm-rc's lease released by the undefine event")
        done_c = rt.journal.get(c.id)
        assert done_c is not None and done_c.end_reason == "domain undefined"
        assert releasing_actor(rt, c.id) == "libvirt"
        assert all(sysfs_driver(tree.sys_root, f) == orig for f, orig in functions[c.id])
    finally:
        await rt.stop()
        for uid in uids.values():
            with contextlib.suppress(RuntimeError):  # a failure above stays the one reported
                await asyncio.to_thread(libvirtd.virsh, "destroy", uid)
            with contextlib.suppress(RuntimeError):
                await asyncio.to_thread(libvirtd.virsh, "undefine", uid)
