"""What the agent knows of its host: PCI functions, IOMMU groups and GPUs, as plain frozen values."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from hostagent.domain.pci import PciAddress

PCI_CLASS_BRIDGE = 0x06
PCI_CLASS_DISPLAY = 0x03
DISPLAY_SUBCLASSES = (0x00, 0x02, 0x80)  # VGA, 3D controller, other display


PROBE_CLAIM_PREFIX = "probe:"  # a claim on a GPU held by a probe, not a lease: "probe:<gpu id>"


class GpuState(str, enum.Enum):
    """Device-level state shown to operators and used by placement."""

    FREE = "free"
    LEASED = "leased"
    WARNED = "warned"
    DETACH_PENDING = "detach-pending"
    PROBING = "probing"  # held by a health or task probe between leases (placement cannot take it meanwhile)
    QUARANTINED = "quarantined"
    UNAVAILABLE = "unavailable"  # group not viable or IOMMU off


@dataclass(frozen=True, slots=True)
class PciFunction:
    """One PCI function as read from sysfs."""

    address: PciAddress
    vendor_id: int
    device_id: int
    class_code: int  # 24-bit: base class, subclass, prog-if
    subsystem_vendor_id: int | None = None
    subsystem_device_id: int | None = None
    vendor_name: str | None = None
    device_name: str | None = None
    driver: str | None = None
    driver_override: str | None = None
    numa_node: int | None = None
    iommu_group: int | None = None
    link_speed: str | None = None
    link_width: int | None = None
    max_link_speed: str | None = None
    max_link_width: int | None = None
    parent_chain: tuple[PciAddress, ...] = ()  # nearest upstream bridge first, root port last
    bar_sizes: tuple[int, ...] = ()

    @property
    def base_class(self) -> int:
        """PCI base class (0x03 display, 0x06 bridge, ...)."""
        return (self.class_code >> 16) & 0xFF

    @property
    def subclass(self) -> int:
        """PCI subclass."""
        return (self.class_code >> 8) & 0xFF

    @property
    def is_bridge(self) -> bool:
        """Bridges stay on their host drivers; vfio accepts them in a group."""
        return self.base_class == PCI_CLASS_BRIDGE

    @property
    def is_display(self) -> bool:
        """A VGA/3D/display controller."""
        return self.base_class == PCI_CLASS_DISPLAY and self.subclass in DISPLAY_SUBCLASSES

    @property
    def class_hex(self) -> str:
        """Class code as the kernel prints it."""
        return f"0x{self.class_code:06x}"

    @property
    def name(self) -> str:
        """Human name: pci.ids names, or hex ids."""
        vendor = self.vendor_name or f"{self.vendor_id:04x}"
        device = self.device_name or f"{self.device_id:04x}"
        return f"{vendor} {device}"


@dataclass(frozen=True, slots=True)
class IommuGroup:
    """An IOMMU group: the unit that moves to vfio-pci together."""

    number: int
    functions: tuple[PciFunction, ...]  # every non-bridge member
    bridges: tuple[PciFunction, ...] = ()
    viable: bool = True
    reason: str | None = None  # why not viable

    @property
    def addresses(self) -> tuple[PciAddress, ...]:
        """Addresses of the members that are bound to vfio-pci (bridges excluded)."""
        return tuple(f.address for f in self.functions)


_GB_IN_NAME = re.compile(r"(\d+(?:\.\d+)?)\s*GB\b", re.IGNORECASE)


# Board memory of common models whose pci.ids names carry no size (matched as substrings, most specific first).
KNOWN_MEMORY_GIB: tuple[tuple[str, float], ...] = (
    ("RTX 4090", 24), ("RTX 4080", 16), ("RTX 3090", 24), ("RTX 3080", 10), ("RTX 2080 Ti", 11),
    ("RTX 2080", 8), ("RTX A6000", 48), ("RTX 6000 Ada", 48), ("Quadro RTX 6000", 24), ("RTX 6000", 24),
    ("RTX 8000", 48), ("Tesla T4", 16), ("[A10]", 24), ("A10G", 24), ("[A16]", 16), ("[A30]", 24),
    ("[A40]", 48), ("L40S", 48), ("[L40]", 48), ("[L4]", 24), ("Tesla P100", 16), ("Tesla P40", 24),
    ("V100", 16), ("H100", 80), ("H200", 141), ("RX 6800", 16), ("RX 7900 XTX", 24), ("Instinct MI100", 32),
    ("Instinct MI210", 64), ("MI250", 128),
)


def memory_from_name(name: str | None) -> int | None:
    """Memory size from a pci.ids model name: the 'NNGB' it prints ('GA100 [A100 SXM4 40GB]'), or a known model."""
    if not name:
        return None
    m = _GB_IN_NAME.search(name)
    if m:
        return int(float(m.group(1)) * 1024**3)
    for needle, gib in KNOWN_MEMORY_GIB:
        if needle in name:
            return int(gib * 1024**3)
    return None


def gpu_id_for(address: PciAddress) -> str:
    """Stable, URL-safe GPU id derived from the primary function's address."""
    return f"gpu-{address.domain:04x}-{address.bus:02x}-{address.slot:02x}-{address.function:x}"


@dataclass(frozen=True, slots=True)
class Gpu:
    """A leasable GPU: its primary function plus every function of its IOMMU group."""

    id: str
    primary: PciFunction
    functions: tuple[PciFunction, ...]  # primary first, then the group's other non-bridge members
    group: IommuGroup | None
    memory_bytes: int | None = None
    memory_source: str = "unknown"  # sysfs | name | bar | probe (the driver, through a probe) | unknown
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def address(self) -> PciAddress:
        """The primary (display) function's address."""
        return self.primary.address

    @property
    def vendor(self) -> str:
        """Vendor name or hex id."""
        return self.primary.vendor_name or f"{self.primary.vendor_id:04x}"

    @property
    def model(self) -> str:
        """Model name from pci.ids, or hex id."""
        return self.primary.device_name or f"{self.primary.vendor_id:04x}:{self.primary.device_id:04x}"

    @property
    def numa_node(self) -> int | None:
        """NUMA node, None when the platform has none."""
        return self.primary.numa_node

    @property
    def iommu_group(self) -> int | None:
        """IOMMU group number, None with the IOMMU off."""
        return self.group.number if self.group else None

    @property
    def viable(self) -> bool:
        """Can this GPU be leased at all (IOMMU on and group viable)?"""
        return self.group is not None and self.group.viable

    @property
    def unviable_reason(self) -> str | None:
        """Why not viable, for operators."""
        if self.group is None:
            return "IOMMU is off or the device has no IOMMU group: enable intel_iommu=on / amd_iommu=on"
        return self.group.reason

    def to_dict(self) -> dict[str, Any]:
        """The inventory part of a GPU's JSON (the CLI and GET /v1/gpus add its state)."""
        p = self.primary
        return {
            "id": self.id,
            "address": str(self.address),
            "vendor": self.vendor,
            "vendor_id": f"{p.vendor_id:04x}",
            "device_id": f"{p.device_id:04x}",
            "model": self.model,
            "memory_bytes": self.memory_bytes,
            "memory_source": self.memory_source,
            "numa_node": self.numa_node,
            "iommu_group": self.iommu_group,
            "viable": self.viable,
            "unviable_reason": self.unviable_reason,
            "link": {"speed": p.link_speed, "width": p.link_width, "max_speed": p.max_link_speed,
                     "max_width": p.max_link_width},
            "functions": [{"address": str(f.address), "class": f.class_hex, "driver": f.driver, "name": f.name}
                          for f in self.functions],
        }
