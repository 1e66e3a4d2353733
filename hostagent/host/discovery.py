"""Read the host's PCI inventory from sysfs: functions, IOMMU groups, GPUs. Read-only: never writes."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from hostagent.domain.inventory import Gpu, IommuGroup, PciFunction, gpu_id_for, memory_from_name
from hostagent.domain.numa import parse_cpuset
from hostagent.domain.pci import PciAddress
from hostagent.host.pciids import PciIds, load_pci_ids
from hostagent.host.sysfs import Sysfs

_ADDR_RE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
DEFAULT_PCI_IDS = "/usr/share/misc/pci.ids"


@dataclass(frozen=True)
class Inventory:
    """Everything discovery found, as frozen values."""

    functions: tuple[PciFunction, ...]
    groups: dict[int, IommuGroup] = field(default_factory=dict)
    gpus: tuple[Gpu, ...] = ()
    iommu_enabled: bool = False

    def function(self, address: PciAddress | str) -> PciFunction | None:
        """The function at an address, or None."""
        addr = PciAddress.parse(address) if isinstance(address, str) else address
        return next((f for f in self.functions if f.address == addr), None)

    def group_of(self, address: PciAddress | str) -> IommuGroup | None:
        """The IOMMU group holding an address, or None (unknown address or IOMMU off)."""
        fn = self.function(address)
        return self.groups.get(fn.iommu_group) if fn is not None and fn.iommu_group is not None else None

    def gpu(self, gpu_id: str) -> Gpu | None:
        """A GPU by id, or None."""
        return next((g for g in self.gpus if g.id == gpu_id), None)


def _hex(sysfs: Sysfs, rel: str) -> int | None:
    return sysfs.read_int(rel, 16)


def _bar_sizes(text: str | None) -> tuple[int, ...]:
    """Sizes of BARs 0-5 from the `resource` file ('start end flags' per line); unused BARs are left out."""
    sizes = []
    for line in (text or "").splitlines()[:6]:
        parts = line.split()
        if len(parts) < 2:
            continue
        start, end = int(parts[0], 16), int(parts[1], 16)
        if end > start or start:
            sizes.append(end - start + 1)
    return tuple(sizes)


def _parent_chain(sysfs: Sysfs, address: str) -> tuple[PciAddress, ...]:
    """Upstream bridges from the resolved device path, nearest first (root port last)."""
    path = sysfs.resolve(f"bus/pci/devices/{address}")
    if path is None:
        return ()
    parts = [p for p in path.parts[:-1] if _ADDR_RE.match(p)]
    return tuple(PciAddress.parse(p) for p in reversed(parts))


def read_function(sysfs: Sysfs, address: str, ids: PciIds) -> PciFunction | None:
    """One PCI function's attributes, or None when its vendor/device/class cannot be read."""
    base = f"bus/pci/devices/{address}"
    vendor, device, cls = _hex(sysfs, f"{base}/vendor"), _hex(sysfs, f"{base}/device"), _hex(sysfs, f"{base}/class")
    if vendor is None or device is None or cls is None:
        return None
    sv, sd = _hex(sysfs, f"{base}/subsystem_vendor"), _hex(sysfs, f"{base}/subsystem_device")
    numa = sysfs.read_int(f"{base}/numa_node")
    override = sysfs.read_str(f"{base}/driver_override")
    group = sysfs.read_link(f"{base}/iommu_group")
    device_name = ids.device(vendor, device)
    if device_name is not None and sv is not None and sd is not None and memory_from_name(device_name) is None:
        # A board name can be more precise ('Tesla T10 16GB' under a generic chip name).
        board = ids.subsystem(vendor, device, sv, sd)
        if board and memory_from_name(board) is not None:
            device_name = f"{device_name} ({board})"
    return PciFunction(
        address=PciAddress.parse(address),
        vendor_id=vendor,
        device_id=device,
        class_code=cls,
        subsystem_vendor_id=sv,
        subsystem_device_id=sd,
        vendor_name=ids.vendor(vendor),
        device_name=device_name,
        driver=sysfs.read_link(f"{base}/driver"),
        driver_override=None if override in (None, "", "(null)") else override,
        numa_node=None if numa is None or numa < 0 else numa,
        iommu_group=int(group) if group and group.isdigit() else None,
        link_speed=sysfs.read_str(f"{base}/current_link_speed") or None,
        link_width=sysfs.read_int(f"{base}/current_link_width"),
        max_link_speed=sysfs.read_str(f"{base}/max_link_speed") or None,
        max_link_width=sysfs.read_int(f"{base}/max_link_width"),
        parent_chain=_parent_chain(sysfs, address),
        bar_sizes=_bar_sizes(sysfs.read_str(f"{base}/resource")),
    )


def describe(fn: PciFunction, ids: PciIds) -> str:
    """'0000:05:00.0 Ethernet controller (mlx5_core)' for operators."""
    return f"{fn.address} {ids.class_name(fn.class_code)} ({fn.driver or 'no driver'})"


def _group(number: int, members: list[PciFunction], ids: PciIds, allow_list: frozenset[tuple[int, int]],
           anchor: PciFunction | None) -> IommuGroup:
    """A group is viable when every non-bridge member belongs to the anchor's physical device or is allow-listed."""
    members = sorted(members, key=lambda f: f.address)
    functions = [f for f in members if not f.is_bridge]
    bridges = tuple(f for f in members if f.is_bridge)
    if anchor is None and functions:
        anchor = functions[0]
    if anchor is not None:
        functions.sort(key=lambda f: (f.address != anchor.address, f.address))
    foreign = [f for f in functions if anchor is not None and f.address.device != anchor.address.device
               and (f.vendor_id, f.device_id) not in allow_list]
    reason = None
    if foreign:
        what = ", ".join(describe(f, ids) for f in foreign)
        reason = f"group {number} also holds {what}, {'a host device' if len(foreign) == 1 else 'host devices'}"
    return IommuGroup(number=number, functions=tuple(functions), bridges=bridges, viable=not foreign, reason=reason)


def _memory(sysfs: Sysfs, fn: PciFunction) -> tuple[int | None, str]:
    vram = sysfs.read_int(f"bus/pci/devices/{fn.address}/mem_info_vram_total")
    if vram:
        return vram, "sysfs"
    by_name = memory_from_name(fn.device_name)
    if by_name:
        return by_name, "name"
    if fn.bar_sizes:
        return max(fn.bar_sizes), "bar"
    return None, "unknown"


def topology_ids(fn: PciFunction) -> dict[str, str]:
    """Root port and PCIe switch (its upstream port) above a function, from the parent chain."""
    out: dict[str, str] = {}
    chain = fn.parent_chain
    if chain:
        out["root_port"] = str(chain[-1])
    if len(chain) >= 3:
        # nearest-first chain: downstream port, upstream port (the switch), ..., root port
        out["switch"] = str(chain[-2])
    return out


def discover(
    sysfs: Sysfs,
    *,
    vendors: Iterable[str] = ("10de", "1002"),
    pci_ids_path: str = DEFAULT_PCI_IDS,
    allow_list: frozenset[tuple[int, int]] = frozenset(),
) -> Inventory:
    """Read every PCI function, group and GPU under the sysfs root (never writes)."""
    ids = load_pci_ids(pci_ids_path)
    vendor_ids = {int(v, 16) for v in vendors}
    functions = tuple(
        fn for fn in (read_function(sysfs, a, ids) for a in sysfs.listdir("bus/pci/devices") if _ADDR_RE.match(a))
        if fn is not None
    )
    by_group: dict[int, list[PciFunction]] = {}
    for fn in functions:
        if fn.iommu_group is not None:
            by_group.setdefault(fn.iommu_group, []).append(fn)
    iommu_enabled = bool(sysfs.listdir("kernel/iommu_groups")) or bool(by_group)

    primaries = [f for f in functions if f.is_display and f.vendor_id in vendor_ids]
    groups: dict[int, IommuGroup] = {}
    for number, members in sorted(by_group.items()):
        anchor = next((f for f in primaries if f.iommu_group == number), None)
        groups[number] = _group(number, members, ids, allow_list, anchor)

    gpus = []
    for primary in primaries:
        group = groups.get(primary.iommu_group) if primary.iommu_group is not None else None
        if group is not None and sum(1 for p in primaries if p.iommu_group == group.number) > 1:
            # Two GPUs in one group: each GPU's view of it names the other as foreign.
            group = _group(group.number, by_group[group.number], ids, allow_list, primary)
        if group is not None:
            funcs = group.functions
        else:
            funcs = (primary,) + tuple(f for f in functions if f.address.device == primary.address.device
                                       and f.address != primary.address)
        memory, source = _memory(sysfs, primary)
        gpus.append(Gpu(id=gpu_id_for(primary.address), primary=primary, functions=funcs, group=group,
                        memory_bytes=memory, memory_source=source, extra=topology_ids(primary)))
    return Inventory(functions=functions, groups=groups, gpus=tuple(gpus), iommu_enabled=iommu_enabled)


def numa_cells(sysfs: Sysfs) -> dict[int, frozenset[int]]:
    """The host's NUMA nodes and the CPUs of each (devices/system/node/node<N>/cpulist, drivers/base/node.c); {}
    where the kernel lists none (no NUMA, or a tree that does not say). What libvirt's capabilities XML reports
    as its cells, read where the agent reads everything else about the host."""
    cells: dict[int, frozenset[int]] = {}
    for name in sysfs.listdir("devices/system/node"):
        if not re.fullmatch(r"node[0-9]+", name):
            continue
        text = sysfs.read_str(f"devices/system/node/{name}/cpulist")
        if text is None:
            continue
        try:
            cells[int(name[4:])] = parse_cpuset(text)
        except ValueError:
            continue  # a list this reader does not understand names no CPU it could place a VM by
    return cells
