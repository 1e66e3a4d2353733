"""The simulated hypervisor behaves like libvirt where leasing depends on it, and survives kill -9."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hostagent.domain.errors import HypervisorError, NotFound
from hostagent.domain.hostdev import (GuestPciAddress, HostdevPci, alias_for, free_guest_slots, hostdevs_for_gpu,
                                      parse_domain_hostdevs)
from hostagent.domain.pci import PciAddress
from hostagent.virt.port import DomainEvent, DomainInfo, DomainState, EventKind, Hypervisor
from hostagent.virt.sim import SimulatedHypervisor

A = PciAddress.parse
GPU = [A("0000:3b:00.0"), A("0000:3b:00.1")]


def _gpu(slot: int = 5, funcs: list[PciAddress] = GPU) -> tuple[HostdevPci, ...]:
    """Each function in a guest slot of its own, at function 0 (what libvirt hot-plugs), from `slot` on."""
    return tuple(HostdevPci(source=f, guest=GuestPciAddress(0, 0, slot + i, 0), alias=alias_for(f))
                 for i, f in enumerate(funcs))


def _multi(slot: int = 5, funcs: list[PciAddress] = GPU) -> tuple[HostdevPci, ...]:
    """The functions as one multifunction device on one guest slot (cold-plugged only: libvirt hot-plugs function 0)."""
    return hostdevs_for_gpu(funcs, 0, slot)


def _recorder(hv: SimulatedHypervisor) -> list[DomainEvent]:
    events: list[DomainEvent] = []
    hv.subscribe(events.append)
    return events


async def test_implements_the_port_and_looks_up_domains() -> None:
    hv: Hypervisor = SimulatedHypervisor(["vm-a", DomainInfo("vm-b", "11111111-2222-3333-4444-555555555555",
                                                            DomainState.SHUT_OFF)])
    doms = {d.name: d for d in await hv.list_domains()}
    assert doms["vm-a"].state == "running" and doms["vm-b"].state is DomainState.SHUT_OFF
    assert (await hv.get_domain("11111111-2222-3333-4444-555555555555")).name == "vm-b"
    assert (await hv.get_domain(doms["vm-a"].uuid.upper())).name == "vm-a"
    with pytest.raises(NotFound):
        await hv.get_domain("nope")
    with pytest.raises(NotFound):
        await hv.attached_hostdevs("00000000-0000-0000-0000-000000000000")


async def test_attach_to_running_domain_changes_live_and_persistent_xml() -> None:
    hv = SimulatedHypervisor(["vm"])
    uuid = (await hv.get_domain("vm")).uuid
    slots = free_guest_slots(await hv.domain_xml(uuid), 0, 2)
    assert slots == (4, 5)  # the simulated guest uses slots 1-3 of bus 0
    hds = _gpu(slots[0])
    await hv.attach_hostdevs(uuid, hds)
    assert parse_domain_hostdevs(await hv.domain_xml(uuid, live=True)) == hds
    assert parse_domain_hostdevs(await hv.domain_xml(uuid, live=False)) == hds
    assert await hv.attached_hostdevs(uuid) == hds
    assert free_guest_slots(await hv.domain_xml(uuid), 0, 1) == (6,)


async def test_attach_to_shut_off_domain_is_persistent_only_and_follows_a_start() -> None:
    hv = SimulatedHypervisor()
    info = hv.define("vm")
    await hv.attach_hostdevs(info.uuid, _gpu())
    assert await hv.attached_hostdevs(info.uuid) == _gpu()
    hv.start("vm")
    assert parse_domain_hostdevs(await hv.domain_xml(info.uuid, live=True)) == _gpu()


async def test_clashes_are_refused_like_libvirt_and_nothing_changes() -> None:
    hv = SimulatedHypervisor(["vm", "other"])
    uuid = (await hv.get_domain("vm")).uuid
    other = (await hv.get_domain("other")).uuid
    await hv.attach_hostdevs(uuid, _gpu(5))
    before = await hv.domain_xml(uuid)
    with pytest.raises(HypervisorError, match="already in the"):
        await hv.attach_hostdevs(uuid, _gpu(6))  # same PCI sources again
    with pytest.raises(HypervisorError, match="double use of PCI Address"):
        await hv.attach_hostdevs(uuid, _gpu(5, [A("0000:af:00.0")]))  # guest slot 5 function 0 is taken
    with pytest.raises(HypervisorError, match="in use by driver QEMU, domain vm"):
        await hv.attach_hostdevs(other, _gpu(5))  # another running domain holds the device
    assert await hv.domain_xml(uuid) == before
    assert await hv.attached_hostdevs(other) == ()


async def test_failure_part_way_undoes_what_was_attached() -> None:
    hv = SimulatedHypervisor(["vm"], fail_attach_after=1)
    uuid = (await hv.get_domain("vm")).uuid
    with pytest.raises(HypervisorError, match="simulated failure attaching 0000:3b:00.1"):
        await hv.attach_hostdevs(uuid, _gpu())
    assert await hv.attached_hostdevs(uuid) == ()
    assert parse_domain_hostdevs(await hv.domain_xml(uuid, live=False)) == ()


async def test_acknowledged_detach_is_confirmed_by_device_removed_events() -> None:
    hv = SimulatedHypervisor(["vm"], detach_ack_delay_s=0.05)
    events = _recorder(hv)
    uuid = (await hv.get_domain("vm")).uuid
    await hv.attach_hostdevs(uuid, _gpu())
    result = await hv.detach_hostdevs(uuid, await hv.attached_hostdevs(uuid), timeout_s=5)
    assert result.confirmed and result.removed == _gpu() and result.pending == ()
    assert [(e.kind, e.detail) for e in events] == [
        (EventKind.DEVICE_REMOVED, "ua-hostagent-0000-3b-00-0"),
        (EventKind.DEVICE_REMOVED, "ua-hostagent-0000-3b-00-1"),
    ]
    assert await hv.attached_hostdevs(uuid) == ()


async def test_refused_detach_stays_pending_until_the_domain_stops() -> None:
    hv = SimulatedHypervisor(["vm"])
    uuid = (await hv.get_domain("vm")).uuid
    hv.set_refuse_detach("vm")
    events = _recorder(hv)
    await hv.attach_hostdevs(uuid, _gpu())
    result = await hv.detach_hostdevs(uuid, _gpu(), timeout_s=0.05)
    assert not result.confirmed and result.pending == _gpu() and result.removed == ()
    # Persistent definition lost it at once; the running guest still holds it.
    assert parse_domain_hostdevs(await hv.domain_xml(uuid, live=False)) == ()
    assert await hv.attached_hostdevs(uuid) == _gpu()
    again = await hv.detach_hostdevs(uuid, _gpu(), timeout_s=0.01)
    assert not again.confirmed
    waiting = asyncio.ensure_future(hv.detach_hostdevs(uuid, _gpu(), timeout_s=5))
    await asyncio.sleep(0.01)
    hv.shutdown("vm")
    assert (await waiting).confirmed  # the device left with the guest
    assert [e.kind for e in events] == [EventKind.STOPPED]


async def test_acknowledging_a_refused_detach_later_emits_device_removed() -> None:
    hv = SimulatedHypervisor(["vm"], refuse_detach=())
    uuid = (await hv.get_domain("vm")).uuid
    hv.set_refuse_detach(uuid)
    await hv.attach_hostdevs(uuid, _gpu()[:1])
    assert not (await hv.detach_hostdevs(uuid, _gpu()[:1], 0.01)).confirmed
    events = _recorder(hv)
    assert hv.acknowledge_detaches("vm") == 1
    assert [(e.kind, e.detail) for e in events] == [(EventKind.DEVICE_REMOVED, "ua-hostagent-0000-3b-00-0")]
    assert await hv.attached_hostdevs(uuid) == ()


async def test_detach_from_shut_off_domain_is_confirmed_at_once() -> None:
    hv = SimulatedHypervisor()
    uuid = hv.define("vm").uuid
    hv.set_refuse_detach(uuid)  # no guest runs, so nobody can refuse
    await hv.attach_hostdevs(uuid, _gpu())
    assert (await hv.detach_hostdevs(uuid, _gpu(), timeout_s=0)).confirmed
    assert await hv.attached_hostdevs(uuid) == ()


async def test_lifecycle_events() -> None:
    hv = SimulatedHypervisor()
    events = _recorder(hv)
    info = hv.define("vm", running=True)
    hv.shutdown("vm")
    hv.start(info.uuid)
    hv.crash("vm")
    assert (await hv.get_domain("vm")).state is DomainState.CRASHED
    hv.start("vm")
    hv.undefine("vm")
    assert [e.kind.value for e in events] == ["defined", "started", "stopped", "started", "crashed", "started",
                                              "stopped", "undefined"]
    assert {e.uuid for e in events} == {info.uuid} and {e.name for e in events} == {"vm"}
    with pytest.raises(NotFound):
        await hv.get_domain(info.uuid)


async def test_state_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "hv.json"
    hv = SimulatedHypervisor(["vm", "idle"], path=path, detach_ack_delay_s=0.2)
    uuid = (await hv.get_domain("vm")).uuid
    await hv.attach_hostdevs(uuid, _gpu())
    hv.shutdown("idle")
    hv2 = SimulatedHypervisor.load(path)
    assert hv2.detach_ack_delay_s == 0.2
    assert {(d.name, d.state) for d in await hv2.list_domains()} == {("vm", "running"), ("idle", "shut-off")}
    assert await hv2.attached_hostdevs(uuid) == _gpu()
    assert await hv2.domain_xml(uuid) == await hv.domain_xml(uuid)


async def test_pending_detaches_after_restart(tmp_path: Path) -> None:
    path = tmp_path / "hv.json"
    hv = SimulatedHypervisor(["acks", "refuses"], path=path, detach_ack_delay_s=30)
    acks, refuses = (await hv.get_domain("acks")).uuid, (await hv.get_domain("refuses")).uuid
    hv.set_refuse_detach(refuses)
    await hv.attach_hostdevs(acks, _gpu()[:1])
    await hv.attach_hostdevs(refuses, _gpu(5, [A("0000:af:00.0")]))
    assert not (await hv.detach_hostdevs(acks, _gpu()[:1], 0.01)).confirmed
    assert not (await hv.detach_hostdevs(refuses, _gpu(5, [A("0000:af:00.0")]), 0.01)).confirmed
    await hv.close()
    # While the agent was dead an acknowledging guest let go; a refusing one still holds on.
    hv2 = SimulatedHypervisor.load(path)
    assert await hv2.attached_hostdevs(acks) == ()
    assert [h.source for h in await hv2.attached_hostdevs(refuses)] == [A("0000:af:00.0")]
    assert refuses in hv2.refuse_detach


def test_a_crash_before_rename_leaves_the_previous_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hv.json"
    hv = SimulatedHypervisor(["vm"], path=path)
    good = path.read_text()

    def crash(*_: object) -> None:
        raise OSError("killed before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        hv.define("second")
    assert path.read_text() == good
    monkeypatch.undo()
    assert [d.name for d in SimulatedHypervisor.load(path).domains_sync()] == ["vm"]


def test_unreadable_state_is_a_hypervisor_error(tmp_path: Path) -> None:
    path = tmp_path / "hv.json"
    path.write_text("{not json")
    with pytest.raises(HypervisorError, match="unreadable"):
        SimulatedHypervisor.load(path)


CHURN = textwrap.dedent("""
    import asyncio, sys
    from hostagent.domain.hostdev import hostdevs_for_gpu
    from hostagent.domain.pci import PciAddress
    from hostagent.virt.sim import SimulatedHypervisor

    async def main():
        hv = SimulatedHypervisor.load(sys.argv[1])
        uuid = (await hv.get_domain("vm")).uuid
        hds = hostdevs_for_gpu([PciAddress.parse("0000:3b:00.0"), PciAddress.parse("0000:3b:00.1")], 0, 5)
        print("ready", flush=True)
        while True:
            if await hv.attached_hostdevs(uuid):
                await hv.detach_hostdevs(uuid, hds, 1.0)
            else:
                await hv.attach_hostdevs(uuid, hds)

    asyncio.run(main())
""")


def test_kill_9_during_churn_always_leaves_a_loadable_consistent_state(tmp_path: Path) -> None:
    path = tmp_path / "hv.json"
    SimulatedHypervisor(["vm"], path=path)
    for delay in (0.05, 0.13, 0.21):
        proc = subprocess.Popen([sys.executable, "-c", CHURN, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        # Wait until the churn has rewritten the file a few times, then kill without warning.
        start = path.stat().st_mtime_ns
        for _ in range(400):
            if path.stat().st_mtime_ns != start:
                break
            subprocess.run(["sleep", "0.005"], check=True)
        subprocess.run(["sleep", str(delay)], check=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        hv = SimulatedHypervisor.load(path)
        doc = json.loads(path.read_text())
        assert [d["name"] for d in doc["domains"]] == ["vm"]
        live = asyncio.run(hv.attached_hostdevs(hv.domains_sync()[0].uuid))
        # All or nothing: an attach is persisted whole, a detach removes both functions.
        assert len(live) in (0, 2)


async def test_libvirt_like_refusal_to_unplug_multifunction_devices() -> None:
    hv = SimulatedHypervisor(detach_ack_delay_s=0.01)  # libvirt's refusals are the default
    uuid = hv.define("vm").uuid
    await hv.attach_hostdevs(uuid, _multi())  # cold-plugged: a multifunction slot is fine in the definition
    hv.start("vm")
    result = await hv.detach_hostdevs(uuid, _multi(), timeout_s=1)
    assert not result.confirmed and result.pending == _multi()
    assert all("multifunction" in e and "(libvirt error 9)" in e for e in result.errors) and len(result.errors) == 2
    single = _gpu(6, [A("0000:af:00.0")])  # one function alone on its slot: unplug works
    await hv.attach_hostdevs(uuid, single)
    assert (await hv.detach_hostdevs(uuid, single, timeout_s=1)).confirmed
    hv.shutdown("vm")
    assert await hv.attached_hostdevs(uuid) == ()
