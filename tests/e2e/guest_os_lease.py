"""Runs INSIDE the QEMU test guest (the `guest_os` phase of guest_nested_libvirt.py): the whole lease against an
inner domain that runs a real Linux (#19), so the guest's kernel acknowledges the unplug.

The inner domain boots Debian's kernel (the uncompressed ELF through PVH: no self-decompression under nested TCG)
with the test guest's initramfs and the outer guest's / over 9p (tests/e2e/inner_os.py); its stage 2 lists the
PCI devices it sees (address, vendor, device) into the share every second. The agent's LeaseManager over the real
SysfsHost and LibvirtHypervisor then leases the two-function e1000e group into it (each function on a hot-plug
root port), the inner kernel's listing shows both functions arrive, and the release detaches them: the inner
kernel's pciehp acknowledges (attention button, its 5 s confirmation), libvirt emits DEVICE_REMOVED, and the agent
gives both back to e1000e: RELEASED, never DETACH_PENDING. Per-step timings are recorded.

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
from hostagent.services.leases import LeaseManager, LeasePolicy
from hostagent.store.journal import Journal
from tests.e2e.guest_nested_libvirt import drivers, follow_events, gpus_at, transitions_of, wait_for
from tests.e2e.inner_os import CACHE, FIRST_PORT, STOP, boot_inner, inner_os_domain_xml, pci_now, stage2_script

BOOT_TIMEOUT_S = 480.0  # the inner boot under nested TCG: ~75-130 s measured, more on a loaded machine
DETACH_TIMEOUT_S = 90.0  # the agent's wait for DEVICE_REMOVED: pciehp's 5 s, slowed by nested emulation


async def guest_os_phase(conn: Any, hv: Any, pair_first: str, vmlinux: str) -> dict[str, Any]:
    """Boot, lease, see, release, give back; the facts for the test."""
    share = Path("/tmp/inner-os")
    xml = inner_os_domain_xml("inner-os", kernel=vmlinux, initrd=CACHE / "initramfs.cpio.gz", root_dir="/",
                              share_dir=share, memory_mib=512, vcpus=2, hotplug_ports=2, user_net=False,
                              console_path=Path("/tmp/inner-os-console.log"))
    rec: dict[str, Any] = {}
    rec["boot"] = boot = await asyncio.to_thread(boot_inner, conn, "inner-os", xml, share,
                                                 stage2_script("true", keep_running=True), BOOT_TIMEOUT_S)
    if boot.get("state") != "done":
        return rec
    await wait_for(lambda: bool(pci_now(share)), 30)
    before = pci_now(share)
    rec["guest_pci_before"] = before
    inv = await asyncio.to_thread(discover, Sysfs("/sys"), vendors=())
    [gpu] = gpus_at(inv, [pair_first])
    pair = [str(a) for a in gpu.group.addresses]  # type: ignore[union-attr]
    rec["functions"] = pair
    rec["drivers_before"] = drivers(pair)
    manager = LeaseManager(gpus=[gpu], host=SysfsHost(Sysfs("/sys")), hypervisor=hv,  # type: ignore[arg-type]
                           journal=Journal(Path("/tmp/guest_os.db")),
                           policy=LeasePolicy(guest_bus=FIRST_PORT, detach_timeout_s=DETACH_TIMEOUT_S))
    transitions = transitions_of(manager)
    unsubscribe = follow_events(manager, hv)
    dom = conn.lookupByUUIDString(boot["uuid"])
    try:
        t0 = time.monotonic()
        lease = await manager.request(boot["uuid"], LeaseRequest(gpus=1), actor="e2e")
        rec["grant_s"] = round(time.monotonic() - t0, 2)
        rec["granted_state"], rec["granted_error"] = lease.state.value, lease.error
        rec["drivers_active"] = drivers(pair)
        rec["live_sources_active"] = sorted(str(h.source) for h in await hv.attached_hostdevs(boot["uuid"]))
        if lease.state.value != "ACTIVE":
            return rec
        t0 = time.monotonic()
        seen = await wait_for(lambda: len(pci_now(share)) >= len(before) + len(pair), 180)
        rec["guest_sees_s"] = round(time.monotonic() - t0, 2) if seen else None
        rec["guest_new_devices"] = sorted(set(pci_now(share)) - set(before))
        t0 = time.monotonic()
        released = await manager.release(lease.id, actor="e2e", reason="the guest OS phase")
        rec["release_s"] = round(time.monotonic() - t0, 2)
        rec["release_returned_state"] = released.state.value
        rec["finished"] = await wait_for(lambda: lease.id not in manager.leases, 2 * DETACH_TIMEOUT_S)
        rec["finish_s"] = round(time.monotonic() - t0, 2)
        final = manager.journal.get(lease.id)
        rec["final_state"] = final.state.value if final is not None else None
        rec["end_reason"] = final.end_reason if final is not None else None
        rec["drivers_final"] = drivers(pair)
        rec["live_sources_final"] = sorted(str(h.source) for h in await hv.attached_hostdevs(boot["uuid"]))
        gone = await wait_for(lambda: len(pci_now(share)) <= len(before), 30)
        rec["guest_pci_after"] = pci_now(share) if gone else pci_now(share)
        rec["transitions"] = transitions
        rec["gpu_state_final"] = manager.gpu_state(gpu.id).value
    finally:
        unsubscribe()
        (share / STOP).write_text("")
        ended = await wait_for(lambda: not _active(dom), 60)
        if not ended:
            await asyncio.to_thread(dom.destroy)
        rec["inner_dmesg_hotplug"] = [ln for ln in _text(share / "dmesg.txt").splitlines()
                                      if "pciehp" in ln or "hotplug" in ln.lower()][-12:]
    return rec


def _active(dom: Any) -> bool:
    try:
        return bool(dom.isActive())
    except Exception:
        return False


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
