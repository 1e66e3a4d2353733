"""Host preflight: can this host pass GPUs through? One Check per question, each non-OK one with a fix hint."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostagent.host.preflight import framebuffers, node_holders
from hostagent.host.sysfs import Sysfs

OK, WARN, FAIL = "OK", "WARN", "FAIL"
IOMMU_HINT = ("enable VT-d / AMD-Vi in the firmware and add intel_iommu=on (Intel) or amd_iommu=on (AMD) and "
              "iommu=pt to GRUB_CMDLINE_LINUX, then update-grub and reboot")
_ECAP_IR = 1 << 3  # Intel VT-d extended capability: interrupt remapping supported


@dataclass(frozen=True, slots=True)
class Check:
    """One preflight answer."""

    name: str
    status: str  # OK | WARN | FAIL
    detail: str
    hint: str = ""

    def line(self) -> str:
        """'STATUS  name: detail' as `hostagent doctor` prints it."""
        return f"{self.status:<4}  {self.name}: {self.detail}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def check_iommu(sysfs: Sysfs, proc_root: Path) -> list[Check]:
    """IOMMU groups present; intel_iommu=on/amd_iommu=on and iommu=pt on the kernel command line."""
    groups = [g for g in sysfs.listdir("kernel/iommu_groups") if g.isdigit()]
    cmdline = (_read(proc_root / "cmdline") or "").split()
    on = [a for a in cmdline if a in ("intel_iommu=on", "amd_iommu=on")]
    out = []
    if groups:
        out.append(Check("iommu", OK, f"{len(groups)} IOMMU groups"))
    else:
        out.append(Check("iommu", FAIL, "no IOMMU groups: the IOMMU is off", IOMMU_HINT))
    if on and "iommu=pt" in cmdline:
        out.append(Check("kernel-cmdline", OK, f"{on[0]} iommu=pt"))
    elif on:
        out.append(Check("kernel-cmdline", WARN, f"{on[0]} without iommu=pt (host DMA goes through the IOMMU)",
                         "add iommu=pt to the kernel command line for host I/O performance"))
    elif groups:
        # AMD enables its IOMMU by default; say so rather than fail.
        out.append(Check("kernel-cmdline", WARN, "no intel_iommu=on / amd_iommu=on (IOMMU on by platform default)",
                         "add intel_iommu=on or amd_iommu=on, and iommu=pt, so a kernel update cannot turn it off"))
    else:
        out.append(Check("kernel-cmdline", FAIL, "no intel_iommu=on / amd_iommu=on", IOMMU_HINT))
    return out


def check_interrupt_remapping(sysfs: Sysfs) -> Check:
    """Interrupt remapping, from the VT-d extended capability register where readable."""
    units = sysfs.listdir("class/iommu")
    seen = False
    for unit in units:
        ecap = sysfs.read_int(f"class/iommu/{unit}/intel-iommu/ecap", 16)
        if ecap is None:
            continue
        seen = True
        if not ecap & _ECAP_IR:
            return Check("interrupt-remapping", WARN, f"{unit} does not support interrupt remapping",
                         "vfio needs allow_unsafe_interrupts=1 without it; prefer a platform with remapping")
    if seen:
        return Check("interrupt-remapping", OK, "supported by every VT-d unit")
    return Check("interrupt-remapping", WARN, "unknown (no readable intel-iommu capability)",
                 "check `dmesg | grep -i remapping` for 'Enabled IRQ remapping'")


def _kernel_release(proc_root: Path) -> str:
    text = _read(proc_root / "sys/kernel/osrelease")
    return text.strip() if text else os.uname().release


def check_vfio_modules(sysfs: Sysfs, proc_root: Path) -> list[Check]:
    """vfio-pci and vfio_iommu_type1 loaded, or available to load (modules.dep / modules.builtin)."""
    loaded = {line.split()[0] for line in (_read(proc_root / "modules") or "").splitlines() if line.split()}
    release = _kernel_release(proc_root)
    moddir = proc_root.parent / "lib/modules" / release
    index = (_read(moddir / "modules.dep") or "") + (_read(moddir / "modules.builtin") or "")
    known = {os.path.basename(p).split(".ko")[0].replace("-", "_")
             for p in re.findall(r"[\w/.-]+\.ko(?:\.\w+)?", index)}
    out = []
    for mod in ("vfio_pci", "vfio_iommu_type1"):
        if mod in loaded or sysfs.exists(f"module/{mod}"):
            out.append(Check(mod, OK, "loaded"))
        elif mod in known:
            out.append(Check(mod, OK, f"available for kernel {release}, loaded on first bind"))
        else:
            out.append(Check(mod, FAIL, f"not loaded and not found for kernel {release}",
                             "install the distribution kernel's modules (vfio is part of linux-image-*)"))
    return out


def check_libvirt(probe: Callable[[], str | None]) -> Check:
    """libvirt reachable (the probe returns None on success, else an error string)."""
    try:
        error = probe()
    except Exception as exc:  # a probe bug must not hide the rest of the report
        error = f"{type(exc).__name__}: {exc}"
    if error is None:
        return Check("libvirt", OK, "reachable")
    return Check("libvirt", FAIL, error, "systemctl enable --now libvirtd (or virtqemud) and check libvirt.uri")


def check_gpu_groups(inventory: Any) -> list[Check]:
    """One check per GPU: is its IOMMU group viable for passthrough?"""
    if not inventory.gpus:
        return [Check("gpus", WARN, "no GPUs of the configured vendors found", "check host.gpu_vendors")]
    out = []
    for gpu in inventory.gpus:
        name = f"gpu {gpu.address}"
        if gpu.viable:
            n = len(gpu.functions)
            out.append(Check(name, OK, f"{gpu.model}: group {gpu.iommu_group} viable ({n} function{'s' * (n != 1)})"))
        else:
            hint = ("move the card to a slot with ACS, or allow the extra device with host.group_allow_list "
                    "if it is part of the card") if gpu.group is not None else IOMMU_HINT
            out.append(Check(name, FAIL, f"{gpu.model}: {gpu.unviable_reason}", hint))
    return out


def check_pci_names(inventory: Any) -> Check:
    """GPUs the pci.ids database does not name: their features and memory are unknown (or the largest BAR's size)
    until a probe reads them from the driver."""
    unnamed = sorted({f"{g.primary.vendor_id:04x}:{g.primary.device_id:04x}" for g in inventory.gpus
                      if not g.primary.device_name})
    if not unnamed:
        return Check("pci-ids", OK, "every GPU is named in pci.ids")
    return Check("pci-ids", WARN, f"not in pci.ids: {', '.join(unnamed)}; requests that name features or memory "
                                  "cannot use them until a probe has read them from the driver",
                 "update the database (`update-pciids`, or a newer pci.ids package) or point host.pci_ids_path at a "
                 "current copy; meanwhile probe them (`hostagent probe GPU`)")


def check_host_processes(proc_root: Path) -> Check:
    """Host processes with a GPU device node open (/dev/nvidia*, /dev/dri/*)."""
    holders = [str(h) for h in node_holders(proc_root)]
    if not holders:
        return Check("host-processes", OK, "no host process holds a GPU device node")
    return Check("host-processes", WARN, "; ".join(holders),
                 "stop these processes (nvidia-persistenced, display managers, monitoring) before leasing")


def check_framebuffers(sysfs: Sysfs, proc_root: Path, inventory: Any) -> Check:
    """efifb / simplefb / BOOTFB claiming memory inside a GPU's BAR (the console owns the card)."""
    claims = [f"{owner} uses {address}'s BAR"
              for owner, address in framebuffers(sysfs, proc_root, [str(g.address) for g in inventory.gpus])]
    if not claims:
        return Check("framebuffer", OK, "no boot framebuffer on a GPU")
    return Check("framebuffer", WARN, "; ".join(claims),
                 "add video=efifb:off (or initcall_blacklist=sysfb_init) to the kernel command line")


def run_checks(sysfs: Sysfs, proc_root: str | os.PathLike[str], dev_root: str | os.PathLike[str], inventory: Any,
               libvirt_probe: Callable[[], str | None]) -> list[Check]:
    """Every preflight check, in the order an operator fixes them."""
    proc = Path(proc_root)
    checks = check_iommu(sysfs, proc)
    checks.append(check_interrupt_remapping(sysfs))
    checks += check_vfio_modules(sysfs, proc)
    if not Path(dev_root, "vfio").is_dir() and any(c.name == "vfio_pci" and c.detail == "loaded" for c in checks):
        checks.append(Check("dev-vfio", WARN, f"{Path(dev_root, 'vfio')} missing although vfio is loaded",
                            "check that devtmpfs is mounted on /dev"))
    checks.append(check_libvirt(libvirt_probe))
    checks += check_gpu_groups(inventory)
    if inventory.gpus:
        checks.append(check_pci_names(inventory))
    checks.append(check_host_processes(proc))
    checks.append(check_framebuffers(sysfs, proc, inventory))
    return checks
