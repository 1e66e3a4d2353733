"""LibvirtHypervisor against a real, private libvirtd + QEMU (TCG). Fails, never skips, without libvirtd.

PCI hostdevs go in with CONFIG only (shut-off domains): live PCI assignment needs an IOMMU this host lacks,
and libvirt accepts a persistent managed='no' hostdev whose source device does not exist.
"""

from __future__ import annotations

import asyncio
import uuid as uuidlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from hostagent.domain.errors import Conflict, HypervisorError, NotFound
from hostagent.domain.hostdev import GuestPciAddress, HostdevPci, free_guest_slots, hostdevs_for_gpu, parse_domain_hostdevs
from hostagent.domain.pci import PciAddress
from hostagent.virt.libvirt_adapter import LibvirtHypervisor, probe
from hostagent.virt.port import DomainEvent, DomainState, EventKind
from tests.support.libvirtd import PrivateLibvirtd, libvirtd, tiny_domain_xml  # noqa: F401 (libvirtd: a fixture)

pytestmark = [pytest.mark.libvirtd, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(120)]

A = PciAddress.parse
FOUR = [A(f"0000:3b:00.{i}") for i in range(4)]  # GPU, audio, USB, UCSI: need not exist for CONFIG attach


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def hv(libvirtd: PrivateLibvirtd) -> AsyncIterator[LibvirtHypervisor]:
    """One adapter (one connection) for the session, as in the agent."""
    # Debug mode makes asyncio raise on loop calls from libvirt's worker threads: keep that guard on.
    asyncio.get_running_loop().set_debug(True)
    adapter = LibvirtHypervisor(libvirtd.uri, reconnect_initial_s=0.1, reconnect_max_s=0.5)
    await adapter.connect()
    yield adapter
    await adapter.close()


def _define(libvirtd: PrivateLibvirtd, tmp_path: Path, name: str) -> str:
    uid = str(uuidlib.uuid4())
    f = tmp_path / f"{name}.xml"
    f.write_text(tiny_domain_xml(name, uuid=uid))
    libvirtd.virsh("define", str(f))
    return uid


class Events:
    """Collects the adapter's events; `wait_for` returns the first matching one or fails after a timeout."""

    def __init__(self, hv: LibvirtHypervisor) -> None:
        self.seen: list[DomainEvent] = []
        self._changed = asyncio.Event()
        self.unsubscribe = hv.subscribe(self._on)

    def _on(self, ev: DomainEvent) -> None:
        self.seen.append(ev)
        self._changed.set()

    async def wait_for(self, kind: EventKind, uuid: str | None = None, timeout: float = 15.0) -> DomainEvent:
        async def look() -> DomainEvent:
            while True:
                for ev in self.seen:
                    if ev.kind is kind and (uuid is None or ev.uuid == uuid):
                        return ev
                self._changed.clear()
                await self._changed.wait()

        try:
            return await asyncio.wait_for(look(), timeout)
        except TimeoutError:
            pytest.fail(f"no {kind.value} event within {timeout}s; saw {[(e.kind.value, e.uuid) for e in self.seen]}")


async def test_config_attach_is_exactly_the_rendered_xml(hv: LibvirtHypervisor, libvirtd: PrivateLibvirtd,
                                                         tmp_path: Path) -> None:
    uid = _define(libvirtd, tmp_path, "vm-attach")
    assert (await hv.get_domain(uid)).state is DomainState.SHUT_OFF
    (slot,) = free_guest_slots(await hv.domain_xml(uid, live=False), 1, 1)  # bus 1 is a root port: slot 0 only
    hds = hostdevs_for_gpu(FOUR, 1, slot, rom_bar_off=True)
    await hv.attach_hostdevs(uid, hds)
    inactive = await hv.domain_xml(uid, live=False)
    assert parse_domain_hostdevs(inactive) == hds  # libvirt kept every field we rendered, nothing else
    assert await hv.attached_hostdevs(uid) == hds
    with pytest.raises(Conflict):
        free_guest_slots(inactive, 1, 1)
    result = await hv.detach_hostdevs(uid, hds, timeout_s=5)
    assert result.confirmed and result.removed == hds
    assert parse_domain_hostdevs(await hv.domain_xml(uid, live=False)) == ()
    libvirtd.virsh("undefine", uid)


async def test_failure_part_way_rolls_back_what_was_attached(hv: LibvirtHypervisor, libvirtd: PrivateLibvirtd,
                                                             tmp_path: Path) -> None:
    uid = _define(libvirtd, tmp_path, "vm-rollback")
    good = HostdevPci(A("0000:3b:00.0"), GuestPciAddress(0, 1, 0, 0), alias="ua-hostagent-0000-3b-00-0")
    clash = HostdevPci(A("0000:5e:00.0"), GuestPciAddress(0, 1, 0, 0), alias="ua-hostagent-0000-5e-00-0")
    with pytest.raises(HypervisorError, match="double use of PCI Address") as info:
        await hv.attach_hostdevs(uid, [good, clash])
    assert info.value.details["rollback_confirmed"] is True
    assert info.value.details["libvirt_code"] > 0
    assert await hv.attached_hostdevs(uid) == ()
    libvirtd.virsh("undefine", uid)


async def test_live_attach_refused_without_iommu_leaves_nothing(hv: LibvirtHypervisor, libvirtd: PrivateLibvirtd,
                                                                tmp_path: Path) -> None:
    uid = _define(libvirtd, tmp_path, "vm-live")
    events = Events(hv)
    libvirtd.virsh("start", uid)
    await events.wait_for(EventKind.STARTED, uid)
    assert (await hv.get_domain("vm-live")).state == "running"
    with pytest.raises(HypervisorError) as info:
        await hv.attach_hostdevs(uid, hostdevs_for_gpu(FOUR[:1], 2, 0))
    assert "VFIO" in info.value.message or "vfio" in info.value.message
    assert await hv.attached_hostdevs(uid) == ()
    assert parse_domain_hostdevs(await hv.domain_xml(uid, live=False)) == ()
    # Detaching what is not attached from a running domain: nothing to wait for, confirmed at once.
    assert (await hv.detach_hostdevs(uid, hostdevs_for_gpu(FOUR[:1], 2, 0), timeout_s=1)).confirmed
    libvirtd.virsh("destroy", uid)
    await events.wait_for(EventKind.STOPPED, uid)
    libvirtd.virsh("undefine", uid)
    events.unsubscribe()


async def test_lifecycle_events_arrive(hv: LibvirtHypervisor, libvirtd: PrivateLibvirtd, tmp_path: Path) -> None:
    events = Events(hv)
    uid = _define(libvirtd, tmp_path, "vm-events")
    assert (await events.wait_for(EventKind.DEFINED, uid)).name == "vm-events"
    libvirtd.virsh("start", uid)
    await events.wait_for(EventKind.STARTED, uid)
    libvirtd.virsh("destroy", uid)
    await events.wait_for(EventKind.STOPPED, uid)
    libvirtd.virsh("undefine", uid)
    await events.wait_for(EventKind.UNDEFINED, uid)
    kinds = [e.kind for e in events.seen if e.uuid == uid]
    assert kinds == [EventKind.DEFINED, EventKind.STARTED, EventKind.STOPPED, EventKind.UNDEFINED]
    events.unsubscribe()


async def test_unknown_domain_is_not_found(hv: LibvirtHypervisor) -> None:
    with pytest.raises(NotFound) as info:
        await hv.get_domain("no-such-domain")
    assert info.value.field == "domain"
    with pytest.raises(NotFound):
        await hv.attached_hostdevs(str(uuidlib.uuid4()))
    with pytest.raises(NotFound):
        await hv.detach_hostdevs(str(uuidlib.uuid4()), hostdevs_for_gpu(FOUR[:1], 1, 0), timeout_s=1)


async def test_probe(libvirtd: PrivateLibvirtd, tmp_path: Path) -> None:
    assert probe(libvirtd.uri) is None
    problem = probe(f"qemu:///system?socket={tmp_path}/nothing-here")
    assert problem is not None and "cannot connect" in problem


async def test_reconnects_after_libvirtd_dies(hv: LibvirtHypervisor, libvirtd: PrivateLibvirtd,
                                              tmp_path: Path) -> None:
    uid = _define(libvirtd, tmp_path, "vm-survivor")
    libvirtd.virsh("start", uid)
    events = Events(hv)
    libvirtd.kill_libvirtd()
    await events.wait_for(EventKind.DISCONNECTED)
    assert not hv.connected
    await asyncio.to_thread(libvirtd.start_libvirtd)
    await events.wait_for(EventKind.RECONNECTED)
    assert hv.connected
    # The guest outlived the daemon; the new connection sees it and its events flow again.
    assert (await hv.get_domain(uid)).state is DomainState.RUNNING
    libvirtd.virsh("destroy", uid)
    await events.wait_for(EventKind.STOPPED, uid)
    libvirtd.virsh("undefine", uid)
    events.unsubscribe()
