"""Names for PCI ids from the pci.ids database (Debian package pci.ids), parsed once per path."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PciIds:
    """Vendor, device, subsystem and class names."""

    vendors: dict[int, str] = field(default_factory=dict)
    devices: dict[tuple[int, int], str] = field(default_factory=dict)
    subsystems: dict[tuple[int, int, int, int], str] = field(default_factory=dict)
    classes: dict[int, str] = field(default_factory=dict)  # base class
    subclasses: dict[tuple[int, int], str] = field(default_factory=dict)

    def vendor(self, vendor: int) -> str | None:
        """Vendor name, e.g. 'NVIDIA Corporation'."""
        return self.vendors.get(vendor)

    def device(self, vendor: int, device: int) -> str | None:
        """Device name, e.g. 'GA100 [A100 SXM4 40GB]'."""
        return self.devices.get((vendor, device))

    def subsystem(self, vendor: int, device: int, sub_vendor: int, sub_device: int) -> str | None:
        """Subsystem (board) name, e.g. 'Quadro RTX 6000'."""
        return self.subsystems.get((vendor, device, sub_vendor, sub_device))

    def class_name(self, class_code: int) -> str:
        """Subclass name ('Ethernet controller'), else base class name, else the hex code."""
        base, sub = (class_code >> 16) & 0xFF, (class_code >> 8) & 0xFF
        return self.subclasses.get((base, sub)) or self.classes.get(base) or f"class 0x{class_code:06x}"


def parse_pci_ids(text: str) -> PciIds:
    """Parse pci.ids text (tab-indented vendor/device/subsystem lines, then 'C' class sections)."""
    ids = PciIds()
    vendor: int | None = None
    device: int | None = None
    base: int | None = None
    in_classes = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("C "):
            in_classes = True
            code, _, name = line[2:].partition("  ")
            base = int(code, 16)
            ids.classes[base] = name.strip()
            continue
        if not line.startswith("\t"):
            in_classes = False
            code, _, name = line.partition("  ")
            try:
                vendor = int(code, 16)
            except ValueError:
                vendor = None  # a header we do not know
                continue
            ids.vendors[vendor] = name.strip()
            device = None
            continue
        depth = len(line) - len(line.lstrip("\t"))
        body = line.strip()
        try:
            if in_classes:
                if depth == 1 and base is not None:
                    code, _, name = body.partition("  ")
                    ids.subclasses[(base, int(code, 16))] = name.strip()
            elif vendor is not None and depth == 1:
                code, _, name = body.partition("  ")
                device = int(code, 16)
                ids.devices[(vendor, device)] = name.strip()
            elif vendor is not None and device is not None and depth == 2:
                pair, _, name = body.partition("  ")
                sv, sd = pair.split()
                ids.subsystems[(vendor, device, int(sv, 16), int(sd, 16))] = name.strip()
        except ValueError:
            continue  # a malformed line costs a name, never the inventory
    return ids


@functools.lru_cache(maxsize=4)
def load_pci_ids(path: str = "/usr/share/misc/pci.ids") -> PciIds:
    """The parsed database at `path` (cached); empty when the file is missing, so names fall back to hex."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_pci_ids(f.read())
    except OSError:
        return PciIds()
