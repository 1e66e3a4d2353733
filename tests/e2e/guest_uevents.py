"""Runs INSIDE the QEMU test guest (a phase of guest_nested_libvirt.py): the real kernel's PCI uevents reach the
agent's OutOfBandWatcher through pyudev's netlink monitor (`kernel` source, no udevd in the guest), and each change
made by hand is told from the agent's own and acted on.

  own        the agent leases the one-function e1000e into an inner domain and, once the domain is destroyed,
             gives it back: every uevent of those binds is the agent's own (no finding);
  unbind     `echo ADDR > /sys/bus/pci/drivers/e1000e/unbind` on a free device: attention, "unbound from e1000e";
  vfio       driver_override + unbind + drivers_probe by hand on another free device: attention, "vfio-bound";
  remove     `echo 1 > /sys/bus/pci/devices/ADDR/remove`: quarantine, the address missing; then
             `echo 1 > /sys/bus/pci/rescan`: the device comes back on e1000e, a `returned` finding.

For each step the time from the write to the agent's finding is recorded (`noticed_s`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from hostagent.domain.lease import LeaseRequest
from hostagent.host.adapter import SysfsHost
from hostagent.host.discovery import discover
from hostagent.host.sysfs import Sysfs
from hostagent.host.uevents import KernelUevents
from hostagent.services.leases import LeaseManager, LeasePolicy
from hostagent.services.out_of_band import OutOfBandWatcher
from hostagent.store.journal import Journal
from tests.e2e.guest_nested_libvirt import GUEST_BUS, drivers, follow_events, gpus_at, inner_domain, wait_for

NOTICE_WITHIN_S = 10.0  # the bounded wait here; the recorded `noticed_s` is what the test judges


def write(path: str, value: str) -> None:
    Path(path).write_text(value)


async def noticed(watcher: OutOfBandWatcher, change: str, before: int) -> float | None:
    """Seconds until the watcher's count of `change` passes `before` (None: not within NOTICE_WITHIN_S)."""
    t0 = time.monotonic()
    if await wait_for(lambda: watcher.counts.get(change, 0) > before, NOTICE_WITHIN_S):
        return round(time.monotonic() - t0, 3)
    return None


async def uevents_phase(conn: Any, hv: Any, own_addr: str, vfio_addr: str, remove_addr: str) -> dict[str, Any]:
    """The four steps above; the facts for the test."""
    inv = await asyncio.to_thread(discover, Sysfs("/sys"), vendors=())
    gpus = gpus_at(inv, [own_addr, vfio_addr, remove_addr])
    by_addr = {str(g.address): g for g in gpus}
    host = SysfsHost(Sysfs("/sys"))
    manager = LeaseManager(gpus=gpus, host=host, hypervisor=hv,  # type: ignore[arg-type]
                           journal=Journal(Path("/tmp/uevents.db")),
                           policy=LeasePolicy(guest_bus=GUEST_BUS, detach_timeout_s=8.0))
    watcher = OutOfBandWatcher(manager, KernelUevents(), own=host.own)
    unsubscribe = follow_events(manager, hv)
    rec: dict[str, Any] = {"drivers_before": drivers([own_addr, vfio_addr, remove_addr])}
    await watcher.start()
    rec["watching"], rec["source_error"] = watcher.watching, watcher.error
    try:
        # own: a whole lease, bind to give-back, makes no finding
        dom, _ = await asyncio.to_thread(inner_domain, conn, "inner-uevents")
        for other in (vfio_addr, remove_addr):  # out of placement for this step: the lease takes own_addr
            manager.attention[by_addr[other].id] = "kept for the steps by hand"
        lease = await manager.request(dom.UUIDString(), LeaseRequest(gpus=1), actor="e2e")
        manager.attention.clear()
        rec["own_lease_state"] = lease.state.value
        await manager.release(lease.id, actor="e2e", reason="uevents phase")
        await asyncio.to_thread(dom.destroy)  # no OS: the detach is acknowledged only by the domain's end
        rec["own_released"] = await wait_for(lambda: lease.id not in manager.leases, 60)
        await asyncio.sleep(1.0)  # the give-back's uevents arrive
        rec["own_drivers_after"] = drivers([own_addr])
        rec["own_uevents"] = watcher.own_uevents
        rec["own_findings"] = dict(watcher.counts)

        # unbind by hand
        t0 = time.monotonic()
        write("/sys/bus/pci/drivers/e1000e/unbind", remove_addr)
        rec["unbind_noticed_s"] = await noticed(watcher, "unbound", 0)
        rec["unbind_attention"] = manager.attention.get(by_addr[remove_addr].id)
        rec["unbind_write_s"] = round(time.monotonic() - t0, 3)

        # vfio-pci by hand
        write(f"/sys/bus/pci/devices/{vfio_addr}/driver_override", "vfio-pci")
        write("/sys/bus/pci/drivers/e1000e/unbind", vfio_addr)
        write("/sys/bus/pci/drivers_probe", vfio_addr)
        rec["vfio_noticed_s"] = await noticed(watcher, "vfio-bound", 0)
        rec["vfio_attention"] = manager.attention.get(by_addr[vfio_addr].id)
        rec["vfio_driver"] = drivers([vfio_addr])[vfio_addr]
        # put it back for the phases that may follow
        write("/sys/bus/pci/drivers/vfio-pci/unbind", vfio_addr)
        write(f"/sys/bus/pci/devices/{vfio_addr}/driver_override", "\n")
        write("/sys/bus/pci/drivers_probe", vfio_addr)

        # removed through sysfs, then back with a rescan
        write(f"/sys/bus/pci/devices/{remove_addr}/remove", "1")
        rec["remove_noticed_s"] = await noticed(watcher, "removed", 0)
        rec["remove_quarantine"] = manager.quarantined.get(by_addr[remove_addr].id)
        rec["missing_after_remove"] = sorted(manager.missing)
        rec["sysfs_after_remove"] = Path(f"/sys/bus/pci/devices/{remove_addr}").exists()
        write("/sys/bus/pci/rescan", "1")
        rec["rescan_noticed_s"] = await noticed(watcher, "returned", 0)
        await wait_for(lambda: drivers([remove_addr])[remove_addr] is not None, 10)
        rec["missing_after_rescan"] = sorted(manager.missing)
        rec["driver_after_rescan"] = drivers([remove_addr])[remove_addr]
        rec["findings"] = list(watcher.findings)
        rec["counts"] = dict(watcher.counts)
        rec["uevents"] = watcher.uevents
    finally:
        unsubscribe()
        await watcher.stop()
    return rec
