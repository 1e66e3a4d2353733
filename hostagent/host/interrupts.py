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
