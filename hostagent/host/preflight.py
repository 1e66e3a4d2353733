"""What the host must not be doing with a GPU before the agent takes it for a guest, read without touching anything:
host processes holding its device nodes, a boot framebuffer on its memory, its being the boot VGA device, and how
(or whether) the kernel can reset it. `hostagent doctor` reports the same facts host-wide; the bind refuses a GPU
(`refusals`) before its first sysfs write, with the reason, instead of failing half-way or hanging in an unbind that
waits for a process to close the device.

Sources: the fd links under /proc/<pid>/fd; the device's DRM nodes (/sys/bus/pci/devices/<addr>/drm/card*,
renderD*) and NVIDIA's minor (/proc/driver/nvidia/gpus/<addr>/information, "Device Minor"); /proc/iomem ranges named
efifb, simplefb, BOOTFB or vesafb inside one of its BARs (/sys/bus/pci/devices/<addr>/resource); the boot_vga
attribute (drivers/pci/pci-sysfs.c); reset_method (Linux 5.15+, drivers/pci/pci.c: the methods in order, empty when
none) and, before it, the presence of the `reset` attribute.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hostagent.host.sysfs import Sysfs

FRAMEBUFFER = re.compile(r"efifb|simplefb|BOOTFB|vesafb")
GPU_NODES = ("/dev/nvidia", "/dev/dri/")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class Holder:
    """A host process and the GPU device nodes it has open."""

    pid: int
    command: str
    nodes: tuple[str, ...]

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command}) holds {', '.join(self.nodes)}"


def node_holders(proc_root: str | os.PathLike[str], wanted: Iterable[str] = GPU_NODES) -> list[Holder]:
    """Host processes with an open device node whose path starts with one of `wanted`, by pid."""
    root = Path(proc_root)
    prefixes = tuple(wanted)
    try:
        pids = sorted((p for p in os.listdir(root) if p.isdigit()), key=int)
    except OSError:
        return []
    out = []
    for pid in pids:
        fd_dir = root / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or not ours to read
        nodes = set()
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target.startswith(prefixes):
                nodes.add(target)
        if nodes:
            comm = (_read(root / pid / "comm") or "?").strip()
            out.append(Holder(int(pid), comm, tuple(sorted(nodes))))
    return out


def device_nodes(sysfs: Sysfs, proc_root: str | os.PathLike[str], address: str) -> list[str]:
    """The /dev nodes that are this device's own: its DRM card and render nodes, and /dev/nvidia<minor>."""
    nodes = [f"/dev/dri/{name}" for name in sysfs.listdir(f"bus/pci/devices/{address}/drm")
             if name.startswith(("card", "renderD"))]
    info = _read(Path(proc_root) / "driver/nvidia/gpus" / address / "information") or ""
    minor = re.search(r"Device Minor:\s*(\d+)", info)
    if minor:
        nodes.append(f"/dev/nvidia{minor.group(1)}")
    return nodes


def bars(sysfs: Sysfs, address: str) -> list[tuple[int, int]]:
    """The device's memory BARs (start, end) from its resource file."""
    out = []
    for line in (sysfs.read_str(f"bus/pci/devices/{address}/resource") or "").splitlines()[:6]:
        parts = line.split()
        if len(parts) >= 2 and int(parts[1], 16) > int(parts[0], 16):
            out.append((int(parts[0], 16), int(parts[1], 16)))
    return out


def framebuffers(sysfs: Sysfs, proc_root: str | os.PathLike[str], addresses: Iterable[str]) -> list[tuple[str, str]]:
    """(owner, address) for each boot framebuffer (efifb, simplefb, ...) claiming memory inside a device's BAR."""
    claims = []
    ranges = {a: bars(sysfs, a) for a in addresses}
    for line in (_read(Path(proc_root) / "iomem") or "").splitlines():
        rng, _, owner = line.strip().partition(" : ")
        if not FRAMEBUFFER.search(owner):
            continue
        try:
            start, end = (int(x, 16) for x in rng.split("-"))
        except ValueError:
            continue
        for address, spans in ranges.items():
            if any(s <= start and end <= e for s, e in spans):
                claims.append((owner.strip(), address))
    return claims


def is_boot_vga(sysfs: Sysfs, address: str) -> bool:
    """The firmware's boot display device (the console may be drawn on it)."""
    return (sysfs.read_str(f"bus/pci/devices/{address}/boot_vga") or "").strip() == "1"


def reset_methods(sysfs: Sysfs, address: str) -> list[str] | None:
    """How the kernel can reset the device: the reset_method list ([] when it has none), or None when the kernel
    predates reset_method and has a `reset` attribute (some method exists; which one is not said)."""
    text = sysfs.read_str(f"bus/pci/devices/{address}/reset_method")
    if text is not None:
        return text.split()
    return None if sysfs.exists(f"bus/pci/devices/{address}/reset") else []


@dataclass(frozen=True, slots=True)
class Preflight:
    """What the host policy says about taking a GPU: refusals stop the bind; warnings go with it."""

    refusals: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def check(sysfs: Sysfs, proc_root: str | os.PathLike[str], primary: str, functions: Iterable[str], *,
          allow_boot_vga: bool = False, no_reset: str = "warn") -> Preflight:
    """The preflight of one GPU (its primary function and every function of its group)."""
    refusals, warnings = [], []
    mine = set(device_nodes(sysfs, proc_root, primary))
    if mine:
        for h in node_holders(proc_root, mine):
            refusals.append(f"host process {h}: stop it (nvidia-persistenced, a display manager, monitoring) first")
    for owner, address in framebuffers(sysfs, proc_root, functions):
        refusals.append(f"the boot framebuffer {owner} uses {address}'s memory: add video=efifb:off (or "
                        "initcall_blacklist=sysfb_init) to the kernel command line")
    if is_boot_vga(sysfs, primary) and not allow_boot_vga:
        refusals.append(f"{primary} is the boot VGA device (the host console may use it): set host.allow_boot_vga "
                        "to lease it anyway")
    methods = reset_methods(sysfs, primary)
    if methods == []:
        why = f"{primary} has no reset method: a guest can leave it in a state the next guest inherits"
        (refusals if no_reset == "refuse" else warnings).append(
            why + ("" if no_reset == "refuse" else " (host.no_reset = warn)"))
    return Preflight(tuple(refusals), tuple(warnings))


__all__ = ["Holder", "Preflight", "bars", "check", "device_nodes", "framebuffers", "is_boot_vga", "node_holders",
           "reset_methods"]
