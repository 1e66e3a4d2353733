"""Fake host trees (sysfs, /dev/vfio, /proc) shaped like real ones, for tests and the demo.

`build_tree(root, scenario)` writes `root/sys` (the sysfs root), `root/dev`, `root/proc` and `root/lib/modules`.
Scenario names are an API: `dgx8`, `workstation`, `shared-rootport`, `iommu-off`, `demo16`, `mixed16`. Writes to the tree
behave like the kernel's only through hostagent.host.fakekernel.FakeKernel, which whoever built the tree composes
explicitly (`host.kernel = "fake"` in the agent's settings, or `FakeKernel(tree.sys_root)` in a test).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hostagent.domain.pci import PciAddress

NATIVE_DRIVER_FILE = ".fake_native_driver"
RESET_SUPPORTED_FILE = ".fake_reset_supported"  # the reset methods the device has (reset_method may list fewer)
KERNEL_RELEASE = "6.1.0-18-amd64"
GiB = 1024**3
MiB = 1024**2

# Driver name -> module that provides it (None: built into the kernel, as pcieport is).
DRIVER_MODULES: dict[str, str | None] = {
    "pcieport": None,
    "nvidia": "nvidia",
    "snd_hda_intel": "snd_hda_intel",
    "xhci_hcd": "xhci_pci",
    "nvidia-gpu": "i2c_nvidia_gpu",
    "amdgpu": "amdgpu",
    "mlx5_core": "mlx5_core",
    "nvme": "nvme",
    "igc": "igc",
    "i40e": "i40e",
    "skx_uncore": None,
    "vfio-pci": "vfio_pci",
}

# BAR flags as the kernel prints them in `resource` (IORESOURCE_* bits).
_MEM32 = 0x40200
_MEM64_PREF = 0x14220C
_IO = 0x40101


# "workstation" is a desktop as found (no iommu=pt, Xorg holding the NVIDIA card, efifb on the RTX 4090's BAR: the
# agent refuses to lease that card); "workstation-vfio" is the same machine prepared for passthrough (booted with
# iommu=pt and video=efifb:off, no display manager).
SCENARIOS = ("dgx8", "workstation", "workstation-vfio", "shared-rootport", "iommu-off", "demo16", "mixed16")


@dataclass
class FakeDevice:
    """One PCI function to write into the tree."""

    address: str
    vendor: int
    device: int
    class_code: int
    driver: str | None
    parent: str | None  # upstream bridge address; None for a device on the root bus
    numa: int = -1
    subsystem: tuple[int, int] = (0, 0)
    bars: tuple[tuple[int, int, int], ...] = ()  # (bar index, size, flags)
    link: tuple[str, int, str, int] | None = None  # current speed, width, max speed, max width
    vram: int | None = None  # amdgpu's mem_info_vram_total
    # How the kernel can reset it (Linux 5.15+ `reset_method`, in the kernel's order); "" when it has none, and then,
    # as in Linux (pci_dev_reset_attr_is_visible), neither `reset` nor `reset_method` exists.
    reset_methods: str = "flr bus"
    group_key: str = ""  # devices sharing a key share an IOMMU group
    group: int | None = None


@dataclass(frozen=True)
class FakeHost:
    """Where a built tree lives and what is in it."""

    root: Path
    sys_root: Path
    dev_root: Path
    proc_root: Path
    scenario: str
    gpus: tuple[str, ...]  # primary display function addresses
    groups: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for humans."""
        return f"{self.scenario}: {len(self.gpus)} GPUs, {len(self.groups)} IOMMU groups under {self.sys_root}"


class _Topo:
    """Builds a device list bus by bus, the way firmware enumerates it."""

    GEN = {3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe", 5: "32.0 GT/s PCIe"}

    def __init__(self) -> None:
        self.devices: list[FakeDevice] = []

    def add(self, dev: FakeDevice) -> FakeDevice:
        """Add a function; its group defaults to its physical device (functions of a card share one)."""
        if not dev.group_key:
            dev.group_key = dev.address[:-2]
        self.devices.append(dev)
        return dev

    def link(self, gen: int, width: int, max_gen: int | None = None, max_width: int | None = None) -> tuple[str, int, str, int]:
        """Link attributes for a PCIe generation and width."""
        return (self.GEN[gen], width, self.GEN[max_gen or gen], max_width or width)

    def host_bridge(self, bus: int, numa: int) -> None:
        """The root complex's host bridge (00.0 on the root bus)."""
        self.add(FakeDevice(f"0000:{bus:02x}:00.0", 0x8086, 0x2020, 0x060000, None, None, numa))

    def root_port(self, bus: int, slot: int, numa: int, gen: int = 4) -> str:
        """A root port with pcieport bound."""
        addr = f"0000:{bus:02x}:{slot:02x}.0"
        self.add(FakeDevice(addr, 0x8086, 0x2030, 0x060400, "pcieport", None, numa, link=self.link(gen, 16)))
        return addr

    def switch(self, parent: str, up_bus: int, ports: int, numa: int, group_key: str = "") -> list[str]:
        """A PCIe switch below `parent`: upstream port on up_bus, downstream ports on up_bus+1; returns the latter."""
        up = f"0000:{up_bus:02x}:00.0"
        self.add(FakeDevice(up, 0x1000, 0xC010, 0x060400, "pcieport", parent, numa, (0x1000, 0xA096),
                            link=self.link(4, 16), group_key=group_key))
        downs = []
        for i in range(ports):
            d = f"0000:{up_bus + 1:02x}:{i:02x}.0"
            self.add(FakeDevice(d, 0x1000, 0xC010, 0x060400, "pcieport", up, numa, (0x1000, 0xA096),
                                link=self.link(4, 16), group_key=group_key))
            downs.append(d)
        return downs


# -- device models ---------------------------------------------------------------------------------------------

def _nv_bars(bar0: int, bar1: int, bar3: int) -> tuple[tuple[int, int, int], ...]:
    return ((0, bar0, _MEM32), (1, bar1, _MEM64_PREF), (3, bar3, _MEM64_PREF))


NVIDIA_MODELS: dict[str, dict[str, object]] = {
    # key: (device id, class, subsystem, BARs, link gen)
    "a100-sxm4-40gb": {"device": 0x20B0, "class": 0x030200, "subsys": (0x10DE, 0x134F),
                       "bars": _nv_bars(16 * MiB, 64 * GiB, 32 * MiB), "gen": 4},
    "a100-pcie-40gb": {"device": 0x20F1, "class": 0x030200, "subsys": (0x10DE, 0x145F),
                       "bars": _nv_bars(16 * MiB, 64 * GiB, 32 * MiB), "gen": 4},
    "v100-pcie-32gb": {"device": 0x1DB6, "class": 0x030200, "subsys": (0x10DE, 0x124A),
                       "bars": _nv_bars(16 * MiB, 32 * GiB, 32 * MiB), "gen": 3},
    "t4": {"device": 0x1EB8, "class": 0x030200, "subsys": (0x10DE, 0x12A2),
           "bars": _nv_bars(16 * MiB, 16 * GiB, 32 * MiB), "gen": 3},
    # Quadro RTX 6000: pci.ids prints no size, so discovery estimates from the (large) BAR1.
    "rtx6000": {"device": 0x1E30, "class": 0x030000, "subsys": (0x10DE, 0x12BA),
                "bars": _nv_bars(16 * MiB, 32 * GiB, 32 * MiB), "gen": 3},
}


def _nvidia_gpu(topo: _Topo, addr: str, parent: str, numa: int, model: str, group_key: str = "") -> None:
    m = NVIDIA_MODELS[model]
    topo.add(FakeDevice(addr, 0x10DE, int(m["device"]), int(m["class"]), "nvidia", parent, numa,  # type: ignore[call-overload]
                        m["subsys"], m["bars"], topo.link(int(m["gen"]), 16), group_key=group_key))  # type: ignore[arg-type,call-overload]


def _mlx_nic(topo: _Topo, bus: int, parent: str, numa: int, group_key: str = "") -> str:
    addr = f"0000:{bus:02x}:00.0"
    topo.add(FakeDevice(addr, 0x15B3, 0x101D, 0x020000, "mlx5_core", parent, numa, (0x15B3, 0x0016),
                        ((0, 32 * MiB, _MEM64_PREF),), topo.link(4, 16), group_key=group_key))
    return addr


def _nvme(topo: _Topo, bus: int, parent: str, numa: int) -> None:
    topo.add(FakeDevice(f"0000:{bus:02x}:00.0", 0x144D, 0xA824, 0x010802, "nvme", parent, numa, (0x144D, 0xA809),
                        ((0, 32 * 1024, _MEM64_PREF),), topo.link(4, 4)))


# -- scenarios -------------------------------------------------------------------------------------------------

def _dgx_like(models: list[list[str]], gpus_per_switch: int, extras: bool) -> _Topo:
    """2 NUMA nodes (root buses 00 and 80), 2 switches per node, `gpus_per_switch` GPUs per switch."""
    topo = _Topo()
    for numa, root_bus in ((0, 0x00), (1, 0x80)):
        topo.host_bridge(root_bus, numa)
        bus = root_bus + 1
        for sw in range(2):
            rp = topo.root_port(root_bus, 1 + sw, numa)
            downs = topo.switch(rp, bus, gpus_per_switch, numa)
            bus += 2
            for i, down in enumerate(downs):
                model = models[numa * 2 + sw][i]
                _nvidia_gpu(topo, f"0000:{bus:02x}:00.0", down, numa, model)
                bus += 1
        if extras and numa == 0:
            _mlx_nic(topo, bus, topo.root_port(root_bus, 3, numa), numa)
            _nvme(topo, bus + 1, topo.root_port(root_bus, 4, numa), numa)
    return topo


def _scenario_dgx8() -> _Topo:
    return _dgx_like([["a100-sxm4-40gb"] * 2] * 4, 2, extras=True)


def _scenario_demo16() -> _Topo:
    return _dgx_like([["a100-pcie-40gb"] * 4, ["v100-pcie-32gb"] * 4, ["t4"] * 4, ["rtx6000"] * 4], 4, extras=True)


# Turing boards (GeForce RTX 2080 Ti, Quadro RTX 6000) carry four functions in one group: VGA, HDMI audio, and the
# USB-C (VirtualLink) port's xHCI and UCSI controllers. A lease takes all four.
_TURING_FUNCTIONS = ((0x040300, 0x10F7, "snd_hda_intel", ((0, 16 * 1024, _MEM32),)),
                     (0x0C0330, 0x1AD6, "xhci_hcd", ((0, 256 * 1024, _MEM64_PREF),)),
                     (0x0C8000, 0x1AD7, "nvidia-gpu", ((0, 4 * 1024, _MEM32),)))


def _turing_board(topo: _Topo, bus: int, parent: str, numa: int, device: int, subsys: tuple[int, int],
                  bar1: int) -> None:
    vga = (0x030000, device, "nvidia", _nv_bars(16 * MiB, bar1, 32 * MiB))
    for fn, (cls, dev, drv, bars) in enumerate((vga, *_TURING_FUNCTIONS)):
        topo.add(FakeDevice(f"0000:{bus:02x}:00.{fn}", 0x10DE, dev, cls, drv, parent, numa, subsys, bars,
                            topo.link(3, 16)))


def _scenario_mixed16() -> _Topo:
    """The demo's default: datacenter GPUs behind switches (4 A100 and 4 V100 on node 0, 4 T4 on node 1) and four
    Turing boards on node 1's root ports (2 Quadro RTX 6000, 2 GeForce RTX 2080 Ti), each a group of four functions."""
    topo = _Topo()
    for numa, root_bus in ((0, 0x00), (1, 0x80)):
        topo.host_bridge(root_bus, numa)
    bus = 0x01
    for sw, model in enumerate(("a100-pcie-40gb", "v100-pcie-32gb")):
        for i, down in enumerate(topo.switch(topo.root_port(0x00, 1 + sw, 0), bus, 4, 0)):
            _nvidia_gpu(topo, f"0000:{bus + 2 + i:02x}:00.0", down, 0, model)
        bus += 6
    _mlx_nic(topo, bus, topo.root_port(0x00, 3, 0), 0)
    _nvme(topo, bus + 1, topo.root_port(0x00, 4, 0), 0)
    bus = 0x81
    for i, down in enumerate(topo.switch(topo.root_port(0x80, 1, 1), bus, 4, 1)):
        _nvidia_gpu(topo, f"0000:{bus + 2 + i:02x}:00.0", down, 1, "t4")
    bus += 6
    boards = [(0x1E30, (0x10DE, 0x12BA), 32 * GiB)] * 2 + [(0x1E07, (0x10DE, 0x12FA), 16 * GiB)] * 2
    for k, (device, subsys, bar1) in enumerate(boards):
        _turing_board(topo, bus + k, topo.root_port(0x80, 2 + k, 1, gen=3), 1, device, subsys, bar1)
    return topo


def _scenario_workstation() -> _Topo:
    topo = _Topo()
    topo.host_bridge(0, 0)
    # RTX 4090 behind a root port without ACS: the port shares the card's group (bridges are allowed there).
    rp1 = topo.root_port(0, 1, 0)
    key = "0000:01:00"
    topo.devices[-1].group_key = key
    topo.add(FakeDevice("0000:01:00.0", 0x10DE, 0x2684, 0x030000, "nvidia", rp1, 0, (0x1043, 0x889C),
                        ((0, 16 * MiB, _MEM32), (1, 32 * GiB, _MEM64_PREF), (3, 32 * MiB, _MEM64_PREF), (5, 128, _IO)),
                        topo.link(4, 16), group_key=key))
    topo.add(FakeDevice("0000:01:00.1", 0x10DE, 0x22BA, 0x040300, "snd_hda_intel", rp1, 0, (0x1043, 0x889C),
                        ((0, 16 * 1024, _MEM32),), topo.link(4, 16), group_key=key))
    # RTX 2080 Ti (Turing): VGA, HDMI audio, USB xHCI and UCSI, all one card, one group.
    rp2 = topo.root_port(0, 0x1C, 0, gen=3)
    tu = ((0x030000, 0x1E07, "nvidia", _nv_bars(16 * MiB, 256 * MiB, 32 * MiB)),
          (0x040300, 0x10F7, "snd_hda_intel", ((0, 16 * 1024, _MEM32),)),
          (0x0C0330, 0x1AD6, "xhci_hcd", ((0, 256 * 1024, _MEM64_PREF),)),
          (0x0C8000, 0x1AD7, "nvidia-gpu", ((0, 4 * 1024, _MEM32),)))
    for fn, (cls, dev, drv, bars) in enumerate(tu):
        topo.add(FakeDevice(f"0000:02:00.{fn}", 0x10DE, dev, cls, drv, rp2, 0, (0x10DE, 0x12FA), bars,
                            topo.link(3, 16)))
    # AMD Radeon RX 6800 XT with its HDMI audio; amdgpu exports the VRAM size.
    rp3 = topo.root_port(0, 0x1D, 0)
    topo.add(FakeDevice("0000:03:00.0", 0x1002, 0x73BF, 0x030000, "amdgpu", rp3, 0, (0x1002, 0x0E3A),
                        ((0, 16 * GiB, _MEM64_PREF), (2, 256 * MiB, _MEM64_PREF), (5, 256, _IO)),
                        topo.link(4, 16), vram=16 * GiB))
    topo.add(FakeDevice("0000:03:00.1", 0x1002, 0xAB28, 0x040300, "snd_hda_intel", rp3, 0, (0x1002, 0xAB28),
                        ((0, 16 * 1024, _MEM32),), topo.link(4, 16)))
    # An onboard NIC and NVMe for the host.
    rp4 = topo.root_port(0, 0x1B, 0, gen=3)
    topo.add(FakeDevice("0000:04:00.0", 0x8086, 0x15F3, 0x020000, "igc", rp4, 0, (0x8086, 0x0000),
                        ((0, 1 * MiB, _MEM32),), topo.link(3, 1)))
    _nvme(topo, 5, topo.root_port(0, 0x06, 0), 0)
    for d in topo.devices:
        d.numa = -1  # single-socket desktops report no NUMA node
    return topo


def _scenario_shared_rootport() -> _Topo:
    topo = _Topo()
    topo.host_bridge(0, 0)
    # A root port and a switch without ACS: the A10 and a ConnectX NIC behind it land in one group.
    key = "shared"
    rp = topo.root_port(0, 1, 0)
    topo.devices[-1].group_key = key
    downs = topo.switch(rp, 1, 2, 0, group_key=key)
    topo.add(FakeDevice("0000:03:00.0", 0x10DE, 0x2236, 0x030200, "nvidia", downs[0], 0, (0x10DE, 0x1482),
                        _nv_bars(16 * MiB, 32 * GiB, 32 * MiB), topo.link(4, 16), group_key=key))
    _mlx_nic(topo, 4, downs[1], 0, group_key=key)
    # A second GPU alone in its group, to contrast.
    _nvidia_gpu(topo, "0000:05:00.0", topo.root_port(0, 2, 0), 0, "t4")
    return topo


def _scenario_iommu_off() -> _Topo:
    topo = _Topo()
    topo.host_bridge(0, 0)
    _nvidia_gpu(topo, "0000:01:00.0", topo.root_port(0, 1, 0), 0, "a100-pcie-40gb")
    _nvidia_gpu(topo, "0000:02:00.0", topo.root_port(0, 2, 0), 0, "a100-pcie-40gb")
    _nvme(topo, 3, topo.root_port(0, 3, 0), 0)
    return topo


_BUILDERS: dict[str, Callable[[], _Topo]] = {
    "dgx8": _scenario_dgx8,
    "workstation": _scenario_workstation,
    "workstation-vfio": _scenario_workstation,
    "shared-rootport": _scenario_shared_rootport,
    "iommu-off": _scenario_iommu_off,
    "demo16": _scenario_demo16,
    "mixed16": _scenario_mixed16,
}

CMDLINES = {
    True: f"BOOT_IMAGE=/boot/vmlinuz-{KERNEL_RELEASE} root=UUID=5b1f0f5e-8d4c-4f53-9a51-2b0c3e7d9a11 ro quiet "
          "intel_iommu=on iommu=pt",
    False: f"BOOT_IMAGE=/boot/vmlinuz-{KERNEL_RELEASE} root=UUID=5b1f0f5e-8d4c-4f53-9a51-2b0c3e7d9a11 ro quiet",
}


# -- writing ---------------------------------------------------------------------------------------------------

def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def relative_symlink(link: Path, target: Path) -> None:
    """Create `link` pointing at `target` with a relative path, as sysfs does (the tree stays movable)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(link):
        link.unlink()
    os.symlink(os.path.relpath(target, link.parent), link)


def make_driver_dir(sys_root: Path, name: str) -> Path:
    """bus/pci/drivers/<name> with its control files."""
    d = sys_root / "bus/pci/drivers" / name
    d.mkdir(parents=True, exist_ok=True)
    for f in ("bind", "unbind", "new_id", "remove_id", "uevent"):
        p = d / f
        if not p.exists():
            p.write_text("")
    module = DRIVER_MODULES.get(name)
    if module:
        relative_symlink(d / "module", sys_root / "module" / module)
    return d


def make_module_dir(sys_root: Path, module: str, refcnt: int = 0) -> None:
    """sys/module/<module> as a loaded module shows it."""
    d = sys_root / "module" / module
    d.mkdir(parents=True, exist_ok=True)
    _write(d / "initstate", "live\n")
    _write(d / "refcnt", f"{refcnt}\n")


def _resource_text(bars: tuple[tuple[int, int, int], ...], base: int) -> str:
    """13 lines 'start end flags' as the kernel prints for an endpoint; unused lines are zeros."""
    rows = [(0, 0, 0)] * 13
    addr = base
    for index, size, flags in sorted(bars, key=lambda b: -b[1]):
        addr = (addr + size - 1) // size * size  # natural alignment, as firmware assigns
        rows[index] = (addr, addr + size - 1, flags)
        addr += size
    return "".join(f"0x{s:016x} 0x{e:016x} 0x{f:016x}\n" for s, e, f in rows)


def _device_path(sys_root: Path, dev: FakeDevice, by_addr: dict[str, FakeDevice]) -> Path:
    chain = [dev.address]
    p = dev.parent
    while p is not None:
        chain.append(p)
        p = by_addr[p].parent
    root_bus = chain[-1][:7]  # "0000:00"
    return sys_root.joinpath("devices", f"pci{root_bus}", *reversed(chain))


def _interrupts_text(ncpu: int = 8) -> str:
    head = " " * 11 + "".join(f"CPU{i:<8d}" for i in range(ncpu)).rstrip() + "\n"

    def row(label: str, counts: list[int], tail: str) -> str:
        return f"{label:>4}: " + "".join(f"{c:>10d} " for c in counts) + tail + "\n"

    lines = [
        row("0", [44] + [0] * (ncpu - 1), " IO-APIC    2-edge      timer"),
        row("8", [0, 1] + [0] * (ncpu - 2), " IO-APIC    8-edge      rtc0"),
        row("9", [0] * ncpu, " IO-APIC    9-fasteoi   acpi"),
        row("24", [0, 0, 1873, 0] + [0] * (ncpu - 4), " PCI-MSI 1048576-edge      nvme0q0"),
        row("25", [51234] + [0] * (ncpu - 1), " IR-PCI-MSIX-0000:09:00.0    0-edge      mlx5_async@pci:0000:09:00.0"),
    ]
    tail = [
        row("NMI", [12] * ncpu, "  Non-maskable interrupts"),
        row("LOC", [1234567] * ncpu, "  Local timer interrupts"),
        "ERR:          0\n",
        "MIS:          0\n",
    ]
    return head + "".join(lines) + "".join(tail)


def record_interrupts(proc_root: str | os.PathLike[str], address: str, count: int, vectors: int = 2) -> None:
    """Set a device's vfio-msix lines in a fake /proc/interrupts to `count` in all (the demo's 'guest' at work)."""
    record_interrupts_of(proc_root, {address: count}, vectors)


def record_interrupts_of(proc_root: str | os.PathLike[str], counts: Mapping[str, int], vectors: int = 2) -> None:
    """`record_interrupts` for several devices (address -> count) in one rewrite of the file."""
    if not counts:
        return
    path = Path(proc_root) / "interrupts"
    lines = path.read_text().splitlines(keepends=True)
    marks = tuple(f"({address})" for address in counts)
    header, rest = lines[0], [ln for ln in lines[1:] if not any(m in ln for m in marks)]
    ncpu = len(header.split())
    numbered = [ln for ln in rest if ln.split(":")[0].strip().isdigit()]
    named = [ln for ln in rest if not ln.split(":")[0].strip().isdigit()]
    irq = max((int(ln.split(":")[0]) for ln in numbered), default=99) + 1
    for address, count in counts.items():
        per = count // vectors
        for v in range(vectors):
            n = per + (count - per * vectors if v == 0 else 0)
            cpus = [n] + [0] * (ncpu - 1)
            numbered.append(f"{irq:>4}: " + "".join(f"{c:>10d} " for c in cpus)
                            + f" IR-PCI-MSIX-{address}    {v}-edge      vfio-msix[{v}]({address})\n")
            irq += 1
    tmp = path.with_name(f".interrupts.{os.getpid()}")
    tmp.write_text(header + "".join(numbered) + "".join(named))
    os.replace(tmp, path)  # a reader (the reaper, in a worker thread) sees the old file or the new one, never half


def _proc_modules_line(module: str) -> str:
    return f"{module} 65536 0 - Live 0x0000000000000000\n"


def node_cpus(node: int) -> str:
    """The CPU list of a fake host's NUMA node: 16 CPUs each, node 0 first."""
    return f"{16 * node}-{16 * node + 15}"


def build_tree(root: str | os.PathLike[str], scenario: str) -> FakeHost:
    """Write a fake host for `scenario` under root; return where its parts are."""
    if scenario not in _BUILDERS:
        from hostagent.domain.errors import InvalidInput

        raise InvalidInput(f"unknown fake-host scenario {scenario!r}; known: {', '.join(SCENARIOS)}", field="scenario")
    root = Path(root)
    sys_root, dev_root, proc_root = root / "sys", root / "dev", root / "proc"
    topo = _BUILDERS[scenario]()
    iommu = scenario != "iommu-off"
    by_addr = {d.address: d for d in topo.devices}

    # IOMMU group numbers in address order of each group's first member, as the kernel assigns them at boot.
    if iommu:
        numbers: dict[str, int] = {}
        for d in sorted(topo.devices, key=lambda d: PciAddress.parse(d.address)):
            d.group = numbers.setdefault(d.group_key, len(numbers))

    sys_root.mkdir(parents=True, exist_ok=True)
    (sys_root / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
    # The NUMA nodes (drivers/base/node.c), 16 CPUs each: what a device's local_cpulist and a VM's pinning refer to.
    for node in sorted({max(d.numa, 0) for d in topo.devices} or {0}):
        _write(sys_root / f"devices/system/node/node{node}/cpulist", node_cpus(node) + "\n")
    _write(sys_root / "bus/pci/drivers_probe", "")
    _write(sys_root / "bus/pci/drivers_autoprobe", "1\n")
    _write(sys_root / "bus/pci/rescan", "")
    (dev_root / "vfio").mkdir(parents=True, exist_ok=True)

    modules: list[str] = []
    base = 0x38_0000_0000
    for d in topo.devices:
        path = _device_path(sys_root, d, by_addr)
        path.mkdir(parents=True, exist_ok=True)
        attrs = {
            "vendor": f"0x{d.vendor:04x}", "device": f"0x{d.device:04x}",
            "subsystem_vendor": f"0x{d.subsystem[0]:04x}", "subsystem_device": f"0x{d.subsystem[1]:04x}",
            "class": f"0x{d.class_code:06x}", "revision": "0xa1", "numa_node": str(d.numa),
            "driver_override": "(null)", "enable": "1" if d.driver else "0", "irq": "0",
            "local_cpulist": node_cpus(max(d.numa, 0)), "remove": "",
            NATIVE_DRIVER_FILE: d.driver or "",
        }
        if d.reset_methods:
            attrs.update(reset="", reset_method=d.reset_methods, **{RESET_SUPPORTED_FILE: d.reset_methods})
        if d.link:
            attrs.update(current_link_speed=d.link[0], current_link_width=str(d.link[1]),
                         max_link_speed=d.link[2], max_link_width=str(d.link[3]))
        if d.vram is not None:
            attrs["mem_info_vram_total"] = str(d.vram)
        for name, value in attrs.items():
            _write(path / name, value + "\n" if value else "")
        bars = d.bars
        (path / "resource").write_text(_resource_text(bars, base))
        base += 0x10_0000_0000
        relative_symlink(sys_root / "bus/pci/devices" / d.address, path)
        relative_symlink(path / "subsystem", sys_root / "bus/pci")
        if d.group is not None:
            gdir = sys_root / "kernel/iommu_groups" / str(d.group)
            (gdir / "devices").mkdir(parents=True, exist_ok=True)
            _write(gdir / "type", "DMA\n" if scenario != "dgx8" else "identity\n")
            _write(gdir / "reserved_regions", "0x00000000fee00000 0x00000000feefffff msi\n")
            relative_symlink(path / "iommu_group", gdir)
            relative_symlink(gdir / "devices" / d.address, path)
        if d.driver:
            ddir = make_driver_dir(sys_root, d.driver)
            relative_symlink(path / "driver", ddir)
            relative_symlink(ddir / d.address, path)
            mod = DRIVER_MODULES.get(d.driver)
            if mod and mod not in modules:
                modules.append(mod)
    for extra in ("vfio", "nvidia_uvm", "nvidia_modeset", "kvm", "kvm_intel") if iommu else ("kvm", "kvm_intel"):
        if extra.startswith("nvidia") and "nvidia" not in modules:
            continue
        if extra not in modules:
            modules.append(extra)
    for mod in modules:
        make_module_dir(sys_root, mod)
    # KVM's APICv is on, as on current Intel hosts; this IOMMU's capability register has no posted interrupts (bit
    # 59), so the host's vfio interrupt counters see the devices' interrupts (host.interrupts.irq_bypass)
    _write(sys_root / "module/kvm_intel/parameters/enable_apicv", "Y\n")
    if "vfio" in modules:
        (dev_root / "vfio" / "vfio").write_text("")
    if iommu:
        _write(sys_root / "class/iommu/dmar0/intel-iommu/cap", "d2008c40660462\n")
        _write(sys_root / "class/iommu/dmar0/intel-iommu/ecap", "f050da\n")
        _write(sys_root / "class/iommu/dmar0/intel-iommu/version", "1:0\n")

    proc_root.mkdir(parents=True, exist_ok=True)
    cmdline = CMDLINES[iommu]
    iomem = "00000000-00000fff : Reserved\n00001000-0009ffff : System RAM\n"
    if scenario == "workstation":
        # A desktop as found: no iommu=pt, Xorg holding the NVIDIA card, efifb on the 4090's BAR1.
        cmdline = cmdline.replace(" iommu=pt", "")
        fd = proc_root / "1234" / "fd"
        fd.mkdir(parents=True, exist_ok=True)
        _write(proc_root / "1234" / "comm", "Xorg\n")
        for n, node in ((3, "/dev/nvidiactl"), (4, "/dev/nvidia0"), (5, "/dev/null")):
            os.symlink(node, fd / str(n))
        bar1 = (sys_root / "bus/pci/devices/0000:01:00.0/resource").read_text().splitlines()[1].split()
        start = int(bar1[0], 16)
        iomem += f"{start:x}-{int(bar1[1], 16):x} : 0000:01:00.0\n  {start:x}-{start + 0x7FFFFF:x} : efifb\n"
    # The NVIDIA driver's view: each GPU it drives and its /dev/nvidia<minor>, numbered in address order.
    nvidia = sorted((d.address for d in topo.devices if d.driver == "nvidia"), key=PciAddress.parse)
    for minor, address in enumerate(nvidia):
        _write(proc_root / "driver/nvidia/gpus" / address / "information",
               f"Model: \t\t NVIDIA GPU\nDevice Minor: \t {minor}\nBus Location: \t {address}\n")
    _write(proc_root / "cmdline", cmdline + "\n")
    _write(proc_root / "modules", "".join(_proc_modules_line(m) for m in modules))
    _write(proc_root / "interrupts", _interrupts_text())
    _write(proc_root / "iomem", iomem)
    _write(proc_root / "sys/kernel/osrelease", KERNEL_RELEASE + "\n")
    _write(proc_root / "sys/kernel/random/boot_id", "6f1c1c5e-2f7a-4c7e-9d0b-3c1f5a0e7b21\n")
    moddir = root / "lib/modules" / KERNEL_RELEASE
    _write(moddir / "modules.dep", "".join(
        f"kernel/drivers/vfio/{p}.ko.xz:{deps}\n" for p, deps in (
            ("vfio", " kernel/drivers/vfio/vfio_iommu_type1.ko.xz kernel/virt/lib/irqbypass.ko.xz"),
            ("vfio_iommu_type1", ""),
            ("pci/vfio-pci-core", " kernel/drivers/vfio/vfio.ko.xz kernel/virt/lib/irqbypass.ko.xz"),
            ("pci/vfio-pci", " kernel/drivers/vfio/pci/vfio-pci-core.ko.xz kernel/drivers/vfio/vfio.ko.xz"),
        )))
    _write(moddir / "modules.builtin", "kernel/drivers/pci/pcie/portdrv.ko\n")

    groups: dict[int, list[str]] = {}
    for d in topo.devices:
        if d.group is not None:
            groups.setdefault(d.group, []).append(d.address)
    gpus = tuple(d.address for d in topo.devices if d.class_code >> 16 == 0x03)
    return FakeHost(root=root, sys_root=sys_root, dev_root=dev_root, proc_root=proc_root, scenario=scenario,
                    gpus=gpus, groups={k: tuple(v) for k, v in sorted(groups.items())})


def main(argv: list[str] | None = None) -> int:
    """`python -m hostagent.host.fakesysfs SCENARIO DIR`: build a tree and print its sysfs root."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in SCENARIOS:
        print(f"usage: python -m hostagent.host.fakesysfs {{{'|'.join(SCENARIOS)}}} DIR", file=sys.stderr)
        return 2
    host = build_tree(Path(args[1]), args[0])
    print(host.sys_root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
