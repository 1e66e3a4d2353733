"""Per-device vfio interrupt counts from /proc/interrupts (the host-side activity signal for a leased GPU)."""

from __future__ import annotations

import re
from pathlib import Path

from hostagent.domain.errors import InvalidInput
from hostagent.domain.pci import PciAddress

# vfio-pci names its handlers vfio-msix[N](addr), vfio-msi[N](addr) and vfio-intx(addr).
_VFIO_NAME = re.compile(r"vfio-(?:msix|msi|intx)(?:\[\d+\])?\(([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\)")


def parse_interrupts(text: str) -> dict[PciAddress, int]:
    """Sum over CPUs of every vfio interrupt line, per device address."""
    lines = text.splitlines()
    if not lines:
        return {}
    ncpu = len(lines[0].split())  # header: CPU0 CPU1 ...
    totals: dict[PciAddress, int] = {}
    for line in lines[1:]:
        label, sep, rest = line.partition(":")
        if not sep or not label.strip().isdigit():
            continue  # NMI/LOC/.../ERR/MIS summary lines
        m = _VFIO_NAME.search(rest)
        if m is None:
            continue
        count = 0
        for token in rest.split()[:ncpu]:
            if not token.isdigit():
                break  # a line with fewer columns (CPUs gone offline) ends its counts early
            count += int(token)
        try:
            addr = PciAddress.parse(m.group(1))
        except InvalidInput:
            continue
        totals[addr] = totals.get(addr, 0) + count
    return totals


def read_vfio_interrupts(proc_root: str | Path = "/proc") -> dict[PciAddress, int]:
    """parse_interrupts of <proc_root>/interrupts; empty when unreadable."""
    try:
        text = (Path(proc_root) / "interrupts").read_text(errors="replace")
    except OSError:
        return {}
    return parse_interrupts(text)


# Whether a passed-through device's interrupts reach the host's vfio handler, where /proc/interrupts counts them.
# With posted interrupts (Intel VT-d PI with APICv; AMD's IOMMU guest virtual APIC with AVIC) KVM's IRQ bypass
# delivers them straight to the guest's vCPUs, and the host's counters stay flat while the GPU works.
VTD_CAP_PI = 1 << 59  # VT-d capability register bit 59: Posted Interrupts support (Intel VT-d spec, 11.4.2)
AMD_EFR_GA = 1 << 7  # AMD IOMMU extended feature register bit 7: GASup, guest virtual APIC (AMD IOMMU spec, 3.4.1)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _on(value: str | None) -> bool:
    return (value or "").upper() in ("Y", "1")


def _hex_fields(value: str | None) -> list[int]:
    out = []
    for part in (value or "").replace(":", " ").split():
        try:
            out.append(int(part, 16))
        except ValueError:
            continue
    return out


def irq_bypass(sys_root: str | Path = "/sys") -> str | None:
    """Why this host's vfio interrupt counters may miss a busy guest's device interrupts (posted interrupts
    possible), or None when they see every interrupt. Reads KVM's module parameters (kvm_intel enable_apicv,
    kvm_amd avic) and the IOMMUs' capability registers under <sys_root>/class/iommu."""
    root = Path(sys_root)
    iommus = root / "class/iommu"
    if _on(_read(root / "module/kvm_intel/parameters/enable_apicv")):
        for cap in sorted(iommus.glob("dmar*/intel-iommu/cap")):
            if any(v & VTD_CAP_PI for v in _hex_fields(_read(cap))[:1]):
                return (f"VT-d posted interrupts ({cap.parent.parent.name}) with APICv: a guest's device interrupts "
                        "can bypass the host")
    if _on(_read(root / "module/kvm_amd/parameters/avic")):
        for feat in sorted(iommus.glob("ivhd*/amd-iommu/features")):
            if any(v & AMD_EFR_GA for v in _hex_fields(_read(feat))[:1]):
                return (f"AMD IOMMU guest virtual APIC ({feat.parent.parent.name}) with AVIC: a guest's device "
                        "interrupts can bypass the host")
    return None
