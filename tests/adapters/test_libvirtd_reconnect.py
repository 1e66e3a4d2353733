"""The agent across a lost libvirt connection: the re-read on reconnect ends leases whose domain stopped meanwhile,
and nothing else.

The first test drives the simulated hypervisor (an error mid-re-read must not give a GPU back); the second runs the
whole runtime on the real LibvirtHypervisor against a private libvirtd + QEMU that is killed and restarted, and
fails, never skips, when that daemon cannot start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
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
def _define_and_start(daemon: PrivateLibvirtd, tmp_path: Path, name: str, uid: str) -> None:
    xml = tmp_path / f"{name}.xml"
    xml.write_text(tiny_domain_xml(name, uuid=uid))
    daemon.virsh("define", str(xml))
    daemon.virsh("start", uid)


def _config_attach(daemon: PrivateLibvirtd, tmp_path: Path, lease: Lease) -> None:
    """The lease's hostdevs into its domain's persistent XML only (the running QEMU cannot take them here)."""
    for dev in lease.devices:
        for hd in hostdevs_for_gpu([PciAddress.parse(f) for f in dev.functions], 1, 0):
            f = tmp_path / f"{hd.alias}.xml"
            f.write_text(hd.to_xml())
            daemon.virsh("attach-device", lease.domain_uuid, str(f), "--config")


def _qemu_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.libvirtd
@pytest.mark.asyncio(loop_scope="session")  # libvirt binds its event implementation to one loop per process
@pytest.mark.timeout(90)
async def test_agent_misses_no_stop_across_a_libvirtd_restart(libvirtd: PrivateLibvirtd, tmp_path: Path) -> None:
    """libvirtd dies with two leases ACTIVE; domain A's QEMU dies while it is down; libvirtd comes back. The agent,
    never restarted, reconnects, re-reads, ends A's lease as a stop missed while away (its GPU back on the host
    driver, its hostdev gone from A's XML) and leaves B's alone; B's later stop then arrives as a libvirt event,
    which proves the agent subscribed again.

    How the leases come to be ACTIVE: live PCI assignment needs an IOMMU (VFIO) this host lacks, so no running QEMU
    here can hold a hostdev, and a domain with one in its XML refuses to start. So the journal is seeded by the
    agent's own grant path, run once over the simulated hypervisor with domains of the same UUIDs (a stand-in for
    a host where the attach works): the GPUs are bound to vfio-pci in the fake sysfs by the agent and the journal
    holds each lease's real history up to ACTIVE. The real domains then run with those hostdevs in their persistent
    XML (CONFIG only). The agent is restarted onto the real libvirtd: its reconcile finds each domain running and
    its GPU on vfio-pci but the hostdevs missing from the live XML, tries to attach them again, is refused by
    libvirt, notes that and keeps the lease ACTIVE, which is what it does on any host where a re-attach fails. From
    there on nothing is faked: the real adapter, events, reconnect, state re-read and CONFIG detach.
    """
    asyncio.get_running_loop().set_debug(True)  # asyncio raises on loop calls from libvirt's threads: keep it on
    tree = build_tree(tmp_path / "host", "dgx8")
    uids = {"vm-ra": str(uuidlib.uuid4()), "vm-rb": str(uuidlib.uuid4())}
    settings = rig_settings(tmp_path, tree, tmp_path / "hv.json", "op-token",
                            libvirt={"uri": libvirtd.uri, "detach_timeout_s": 2.0})

    # 1. The grants, by the agent, over the simulated stand-in.
    sim = SimulatedHypervisor(path=tmp_path / "hv.json")
    for name, uid in uids.items():
        sim.define(name, running=True, uuid=uid)
    seeder = build_runtime(settings, hypervisor=sim)
    seeder.use_store = False
    await seeder.start()
    try:
        a = await seeder.manager.request(uids["vm-ra"], LeaseRequest(gpus=1), actor="test")
        b = await seeder.manager.request(uids["vm-rb"], LeaseRequest(gpus=1), actor="test")
    finally:
        await seeder.stop()
    assert a.state is S.ACTIVE and b.state is S.ACTIVE

    # 2. The real guests, holding the hostdevs in their persistent XML.
    for name, uid in uids.items():
        await asyncio.to_thread(_define_and_start, libvirtd, tmp_path, name, uid)
    for lease in (a, b):
        await asyncio.to_thread(_config_attach, libvirtd, tmp_path, lease)

    # 3. The agent on the real libvirtd.
    hv = LibvirtHypervisor(libvirtd.uri, reconnect_initial_s=0.1, reconnect_max_s=0.5)
    rt = build_runtime(settings, hypervisor=hv)
    rt.use_store = False
    await rt.start()
    try:
        for lease in (a, b):
            assert state_of(rt, lease.id) is S.ACTIVE
            (note,) = [r for r in rt.repairs if r.subject == lease.id]
            assert note.action.startswith("re-attach failed"), note  # and the lease kept, as on any refused re-attach
        functions = {x.id: [(f, o) for d in x.devices for f, o in zip(d.functions, d.original_drivers)] for x in (a, b)}
        assert all(sysfs_driver(tree.sys_root, f) == "vfio-pci" for fs in functions.values() for f, _ in fs)

        # 4. libvirtd dies; A's guest dies while nobody watches; libvirtd comes back.
        await asyncio.to_thread(libvirtd.kill_libvirtd)
        await until(lambda: not rt.hypervisor_ok, 20.0, "the agent noticing the lost connection")
        pid = int((libvirtd.base / "run" / "qemu" / "vm-ra.pid").read_text().strip())
        os.kill(pid, signal.SIGKILL)
        await until(lambda: _qemu_gone(pid), 20.0, "vm-ra's QEMU gone")
        assert state_of(rt, a.id) is S.ACTIVE  # nothing can have told the agent yet
        await asyncio.to_thread(libvirtd.start_libvirtd)

        # 5. Reconnected (same agent), A's lease ended by the re-read, B's untouched.
        await until(lambda: state_of(rt, a.id) is S.RELEASED, 30.0, "A's lease released after the reconnect")
        assert rt.started and rt.readiness()["hypervisor"]["ok"] is True
        done_a = rt.journal.get(a.id)
        assert done_a is not None and done_a.end_reason == f"domain stopped ({MISSED_WHILE_AWAY})"
        assert releasing_actor(rt, a.id) == "reconnect"
        assert all(sysfs_driver(tree.sys_root, f) == orig for f, orig in functions[a.id])
        inactive_a = await asyncio.to_thread(libvirtd.virsh, "dumpxml", uids["vm-ra"], "--inactive")
        assert parse_domain_hostdevs(inactive_a) == ()  # the agent's CONFIG detach went through the new connection
        assert state_of(rt, b.id) is S.ACTIVE
        assert all(sysfs_driver(tree.sys_root, f) == "vfio-pci" for f, _ in functions[b.id])

        # 6. B stops now: the event path (re-subscribed) ends its lease, not a re-read.
        await asyncio.to_thread(libvirtd.virsh, "destroy", uids["vm-rb"])
        await until(lambda: state_of(rt, b.id) is S.RELEASED, 20.0, "B's lease released by the stop event")
        done_b = rt.journal.get(b.id)
        assert done_b is not None and done_b.end_reason == "domain stopped"
        assert releasing_actor(rt, b.id) == "libvirt"
        assert all(sysfs_driver(tree.sys_root, f) == orig for f, orig in functions[b.id])
    finally:
        await rt.stop()
        for uid in uids.values():
            with contextlib.suppress(RuntimeError):  # a failure above stays the one reported
                await asyncio.to_thread(libvirtd.virsh, "undefine", uid)
