"""The simulated hypervisor is as strict as libvirt and QEMU: what it refuses, with libvirt's error codes, and the
guests that are slow, silent or reject an unplug. Host checks run against a fake host tree and its fake kernel."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import libvirt
import pytest

from hostagent.domain.errors import HostError, HypervisorError
from hostagent.domain.hostdev import HostdevPci, alias_for, parse_domain_hostdevs
from hostagent.domain.pci import PciAddress
from hostagent.host.fakekernel import FakeKernel
from hostagent.host.fakesysfs import build_tree
from hostagent.virt import sim_rules
from hostagent.virt.port import DomainEvent, EventKind
from hostagent.virt.sim import DETACH_ACK_DELAY_S, SimulatedHypervisor


def _auto(*addresses: str) -> tuple[HostdevPci, ...]:
    """Hostdevs whose guest addresses libvirt picks (the agent's default layout)."""
    return tuple(HostdevPci(source=PciAddress.parse(a), alias=alias_for(PciAddress.parse(a))) for a in addresses)


def _to_vfio(kernel: FakeKernel, *addresses: str) -> None:
    kernel.load_module("vfio-pci")
    for a in addresses:
        if kernel.read_link(f"bus/pci/devices/{a}/driver"):
            kernel.write(f"bus/pci/devices/{a}/driver/unbind", a)
        kernel.write(f"bus/pci/devices/{a}/driver_override", "vfio-pci")
        kernel.write("bus/pci/drivers_probe", a)


@pytest.fixture
def host(tmp_path: Path) -> tuple[FakeKernel, list[str], SimulatedHypervisor]:
    """A dgx8 tree, its kernel, the functions of the first GPU's IOMMU group, and a simulator checking that tree."""
    tree = build_tree(tmp_path / "host", "dgx8")
    kernel = FakeKernel(tree.sys_root)
    group = kernel.read_link(f"bus/pci/devices/{tree.gpus[0]}/iommu_group")
    members = sorted(kernel.listdir(f"kernel/iommu_groups/{group}/devices"))
    hv = SimulatedHypervisor(["vm", "other"], sysfs_root=tree.sys_root, detach_ack_delay_s=0.02)
    return kernel, members, hv


def test_error_codes_are_libvirts() -> None:
    for name in ("VIR_ERR_INTERNAL_ERROR", "VIR_ERR_OPERATION_FAILED", "VIR_ERR_XML_ERROR", "VIR_ERR_SYSTEM_ERROR",
                 "VIR_ERR_OPERATION_INVALID", "VIR_ERR_CONFIG_UNSUPPORTED", "VIR_FROM_NONE", "VIR_FROM_QEMU",
                 "VIR_FROM_DOMAIN"):
        assert getattr(sim_rules, name) == getattr(libvirt, name), name


async def test_a_live_attach_needs_every_function_on_vfio_pci_and_a_viable_group(host) -> None:
    kernel, members, hv = host
    uuid = (await hv.get_domain("vm")).uuid
    first = members[0]
    with pytest.raises(HypervisorError) as exc:  # still on its host driver
        await hv.attach_hostdevs(uuid, _auto(first))
    assert "must be manually detached from the host" in exc.value.message
    assert exc.value.details["libvirt_code"] == libvirt.VIR_ERR_OPERATION_INVALID
    assert await hv.attached_hostdevs(uuid) == ()
    if len(members) > 1:  # on vfio-pci, but the rest of its group is not: QEMU finds the group not viable
        _to_vfio(kernel, first)
        with pytest.raises(HypervisorError) as exc:
            await hv.attach_hostdevs(uuid, _auto(first))
        assert "is not viable" in exc.value.message and exc.value.details["blocker"] in members[1:]
        assert exc.value.details["libvirt_code"] == libvirt.VIR_ERR_INTERNAL_ERROR
        assert await hv.attached_hostdevs(uuid) == ()
    _to_vfio(kernel, *members)
    await hv.attach_hostdevs(uuid, _auto(*members))
    assert [str(h.source) for h in await hv.attached_hostdevs(uuid)] == members
    other = (await hv.get_domain("other")).uuid
    with pytest.raises(HypervisorError) as exc:  # the group is held by "vm"
        await hv.attach_hostdevs(other, _auto(members[-1]))
    assert "in use by driver QEMU, domain vm" in exc.value.message
    assert exc.value.details["libvirt_code"] == libvirt.VIR_ERR_OPERATION_INVALID


async def test_an_unknown_function_is_a_system_error(host) -> None:
    _, _, hv = host
    with pytest.raises(HypervisorError) as exc:
        await hv.attach_hostdevs((await hv.get_domain("vm")).uuid, _auto("0000:ee:00.0"))
    assert exc.value.details["libvirt_code"] == libvirt.VIR_ERR_SYSTEM_ERROR and "config space" in exc.value.message


async def test_starting_a_domain_whose_device_is_on_its_host_driver_fails(host) -> None:
    kernel, members, hv = host
    uuid = hv.define("cold").uuid
    await hv.attach_hostdevs(uuid, _auto(members[0]))  # the definition only: nothing is checked yet
    with pytest.raises(HypervisorError, match="must be manually detached"):
        hv.start("cold")
    _to_vfio(kernel, *members)
    hv.start("cold")
    assert [str(h.source) for h in await hv.attached_hostdevs(uuid)] == [members[0]]


async def test_hotplug_slots_run_out() -> None:
    hv = SimulatedHypervisor(["vm"], hotplug_slots=1, detach_ack_delay_s=0.01)
    uuid = (await hv.get_domain("vm")).uuid
    await hv.attach_hostdevs(uuid, _auto("0000:3b:00.0"))
    before = await hv.domain_xml(uuid)
    with pytest.raises(HypervisorError) as exc:
        await hv.attach_hostdevs(uuid, _auto("0000:af:00.0"))
    assert "No more available PCI slots" in exc.value.message
    assert exc.value.details["libvirt_code"] == libvirt.VIR_ERR_INTERNAL_ERROR
    assert await hv.domain_xml(uuid) == before
    assert (await hv.detach_hostdevs(uuid, _auto("0000:3b:00.0"), 1)).confirmed  # a slot freed is usable again
    await hv.attach_hostdevs(uuid, _auto("0000:af:00.0"))


async def test_bus_0_of_an_i440fx_guest_holds_28_hot_plugged_devices() -> None:
    hv = SimulatedHypervisor(["vm"])
    uuid = (await hv.get_domain("vm")).uuid
    await hv.attach_hostdevs(uuid, _auto(*(f"0000:{b:02x}:00.0" for b in range(1, 29))))  # slots 4..31
    with pytest.raises(HypervisorError, match="No more available PCI slots"):
        await hv.attach_hostdevs(uuid, _auto("0000:e0:00.0"))
    assert len(parse_domain_hostdevs(await hv.domain_xml(uuid))) == 28


async def test_a_guest_takes_its_time_by_default() -> None:
    assert DETACH_ACK_DELAY_S >= 1.0
    hv = SimulatedHypervisor(["vm"])
    uuid = (await hv.get_domain("vm")).uuid
    await hv.attach_hostdevs(uuid, _auto("0000:3b:00.0"))
    quick = await hv.detach_hostdevs(uuid, _auto("0000:3b:00.0"), timeout_s=0.1)
    assert not quick.confirmed and [str(h.source) for h in quick.pending] == ["0000:3b:00.0"]
    assert (await hv.detach_hostdevs(uuid, _auto("0000:3b:00.0"), timeout_s=DETACH_ACK_DELAY_S + 1)).confirmed


async def test_a_second_unplug_request_while_one_is_pending_fails_as_in_qemu() -> None:
    hv = SimulatedHypervisor(["vm"], detach_ack_delay_s=0.3)
    uuid = (await hv.get_domain("vm")).uuid
    hd = _auto("0000:3b:00.0")
    await hv.attach_hostdevs(uuid, hd)
    first = await hv.detach_hostdevs(uuid, hd, timeout_s=0.01)
    assert not first.confirmed and first.errors == ()
    again = await hv.detach_hostdevs(uuid, hd, timeout_s=1)
    assert again.confirmed  # libvirt still waits for the device's DEVICE_REMOVED, which comes
    assert len(again.errors) == 1 and "is already in the process of unplug" in again.errors[0]
    assert "(libvirt error 1)" in again.errors[0]


async def test_a_guest_that_rejects_the_unplug_says_so_and_keeps_the_device() -> None:
    hv = SimulatedHypervisor(["vm"], detach_ack_delay_s=0.02)
    uuid = (await hv.get_domain("vm")).uuid
    hd = _auto("0000:3b:00.0")
    await hv.attach_hostdevs(uuid, hd)
    events: list[DomainEvent] = []
    hv.subscribe(events.append)
    hv.set_fail_detach("vm")
    rejected = await hv.detach_hostdevs(uuid, hd, timeout_s=1)
    assert not rejected.confirmed and rejected.pending == hd
    assert [(e.kind, e.detail) for e in events] == [(EventKind.DEVICE_REMOVAL_FAILED, hd[0].alias)]
    # kept by the guest, no longer pending: a retry is a new request
    assert [h.source for h in await hv.attached_hostdevs(uuid)] == [hd[0].source]
    hv.set_fail_detach("vm", False)
    retried = await hv.detach_hostdevs(uuid, hd, timeout_s=1)
    assert retried.confirmed and retried.errors == ()
    assert [e.kind for e in events][-1] is EventKind.DEVICE_REMOVED


async def test_the_strict_settings_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "hv.json"
    hv = SimulatedHypervisor(["vm"], path=path, hotplug_slots=2, fail_detach=(), refuse_multifunction_unplug=False)
    hv.set_fail_detach("vm")
    hv2 = SimulatedHypervisor.load(path)
    assert hv2.hotplug_slots == 2 and hv2.fail_detach == hv.fail_detach and not hv2.refuse_multifunction_unplug
    assert hv2.refuse_nonzero_function_hotplug and hv2.detach_ack_delay_s == DETACH_ACK_DELAY_S
    await asyncio.sleep(0)


def test_the_fake_kernel_and_the_simulator_share_the_vfio_markers() -> None:
    from hostagent.host import fakekernel

    assert (sim_rules.VFIO_OPEN_DIR, sim_rules.VFIO_REQUEST_DIR) == (fakekernel.VFIO_OPEN_DIR,
                                                                     fakekernel.VFIO_REQUEST_DIR)


async def test_unbinding_vfio_pci_under_a_running_guest_blocks_until_the_guest_lets_go(host) -> None:
    """As in Linux: the unbind waits for QEMU to close the device, QEMU asks the guest to unplug it, the guest
    acknowledges (DEVICE_REMOVED), and only then does the unbind complete."""
    kernel, members, hv = host
    hv.detach_ack_delay_s = 0.2
    uuid = (await hv.get_domain("vm")).uuid
    _to_vfio(kernel, *members)
    await hv.attach_hostdevs(uuid, _auto(*members))
    events: list[DomainEvent] = []
    hv.subscribe(events.append)
    assert kernel.holder(members[0]) == "vm"
    unbind = asyncio.ensure_future(asyncio.to_thread(kernel.write, "bus/pci/drivers/vfio-pci/unbind", members[0]))
    for _ in range(100):
        if members[0] in kernel.hanging():
            break
        await asyncio.sleep(0.01)
    assert kernel.hanging()[members[0]] == "vfio-pci/unbind (held by vm)" and not unbind.done()
    await asyncio.wait_for(unbind, 5)
    assert [(e.kind, e.detail) for e in events] == [(EventKind.DEVICE_REMOVED, alias_for(PciAddress.parse(members[0])))]
    assert kernel.read_link(f"bus/pci/devices/{members[0]}/driver") is None and kernel.holder(members[0]) is None
    assert members[0] not in [str(h.source) for h in await hv.attached_hostdevs(uuid)]
    await hv.close()


async def test_a_guest_that_never_lets_go_keeps_the_unbind_blocked(host, monkeypatch: pytest.MonkeyPatch) -> None:
    from hostagent.host import fakekernel

    monkeypatch.setattr(fakekernel, "VFIO_RELEASE_WAIT_S", 0.5)
    kernel, members, hv = host
    uuid = (await hv.get_domain("vm")).uuid
    _to_vfio(kernel, *members)
    await hv.attach_hostdevs(uuid, _auto(*members))
    hv.subscribe(lambda _e: None)
    hv.set_refuse_detach("vm")
    with pytest.raises(HostError) as exc:
        await asyncio.to_thread(kernel.write, "bus/pci/drivers/vfio-pci/unbind", members[0])
    assert exc.value.details["errno"] == errno.EBUSY and "still held by vm" in exc.value.message
    assert kernel.read_link(f"bus/pci/devices/{members[0]}/driver") == "vfio-pci"  # never taken from the guest
    assert members[0] in [str(h.source) for h in await hv.attached_hostdevs(uuid)]
    hv.shutdown("vm")  # QEMU exits: the device is closed, and now it can be unbound
    assert kernel.holder(members[0]) is None
    kernel.write("bus/pci/drivers/vfio-pci/unbind", members[0])
    await hv.close()
