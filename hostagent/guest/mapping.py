"""Which GPU the guest sees is which GPU of a lease: by guest PCI address, falling back to order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hostagent.guest.sampler import GpuInfo, normalize_bus_id


@dataclass(frozen=True, slots=True)
class DeviceMap:
    """Guest GPU index -> host gpu_id, and how each was matched."""

    gpu_of: Mapping[int, str]
    how: Mapping[int, str]  # "pci-address" | "order"
    unmapped: tuple[str, ...]  # lease gpu_ids no guest GPU was found for

    def index_of(self, gpu_id: str) -> int | None:
        """The guest index of a leased GPU."""
        for idx, gid in self.gpu_of.items():
            if gid == gpu_id:
                return idx
        return None


def map_devices(devices: Sequence[GpuInfo], leases: Sequence[Mapping[str, Any]]) -> DeviceMap:
    """Map guest GPUs to the devices of every given lease (oldest lease first).

    A guest address from the lease's `guest_addresses` that the guest also reports is certain. What is left is
    paired in order (guest bus order vs the lease's device order): on q35 the guest firmware numbers the buses,
    so libvirt's guest address may not be what the guest sees.
    """
    by_bus = {d.bus_id: d.index for d in devices}
    gpu_of: dict[int, str] = {}
    how: dict[int, str] = {}
    pending: list[str] = []
    for lease in leases:
        for dev in lease.get("devices") or ():
            hit = None
            for addr in dev.get("guest_addresses") or ():
                idx = by_bus.get(normalize_bus_id(addr))
                if idx is not None and idx not in gpu_of:
                    hit = idx
                    break
            if hit is None:
                pending.append(dev["gpu_id"])
            else:
                gpu_of[hit] = dev["gpu_id"]
                how[hit] = "pci-address"
    free = [d.index for d in sorted(devices, key=lambda d: d.bus_id) if d.index not in gpu_of]
    for gpu_id, idx in zip(pending, free):
        gpu_of[idx] = gpu_id
        how[idx] = "order"
    mapped = set(gpu_of.values())
    return DeviceMap(gpu_of, how, tuple(g for g in pending if g not in mapped))
