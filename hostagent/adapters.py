"""Settings -> the adapters the agent composes: the hypervisor (libvirt, or the simulated one for `sim://`), the
kernel's sysfs (or the fake kernel, `host.kernel = "fake"`), its PCI uevents, and the inventory discovered there.
The CLI's commands open the same ones the agent does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hostagent.config import Settings
from hostagent.host.discovery import Inventory, discover
from hostagent.host.sysfs import Sysfs


def open_hypervisor(settings: Settings) -> Any:
    """libvirt for a real URI; the simulated hypervisor for `sim:///path/state.json`."""
    uri = settings.libvirt.uri
    if uri.startswith("sim://"):
        from hostagent.virt.sim import SimulatedHypervisor

        path = uri[len("sim://"):] or None
        # the simulator checks a live attach against the host's sysfs, as libvirt and QEMU do
        root = settings.host.sysfs_root
        return SimulatedHypervisor.load(Path(path), sysfs_root=root) if path else SimulatedHypervisor(sysfs_root=root)
    from hostagent.virt.libvirt_adapter import LibvirtHypervisor

    return LibvirtHypervisor(uri)


def open_kernel(settings: Settings) -> Sysfs:
    """The sysfs at `host.sysfs_root`, answered by the running kernel; `host.kernel = "fake"` composes the fake kernel
    instead, for a tree that hostagent.host.fakesysfs built (the demo and the test rigs choose it; the real adapters
    never import a fake, and nothing picks one from what a tree holds)."""
    if settings.host.kernel == "fake":
        from hostagent.host.fakekernel import FakeKernel

        return FakeKernel(settings.host.sysfs_root)
    return Sysfs(settings.host.sysfs_root)


def open_uevents(settings: Settings) -> Any:
    """The kernel's PCI uevents (pyudev's netlink monitor); the fake kernel's own for its trees (`host.kernel`)."""
    if settings.host.kernel == "fake":
        from hostagent.host.fakekernel import FakeUevents

        return FakeUevents(settings.host.sysfs_root)
    from hostagent.host.uevents import KernelUevents

    return KernelUevents()


def discover_host(settings: Settings) -> Inventory:
    """Read the host's PCI inventory (read-only)."""
    sysfs = open_kernel(settings)
    allow = frozenset(tuple(int(x, 16) for x in pair.split(":")) for pair in settings.host.group_allow_list)
    return discover(sysfs, vendors=tuple(v.lower() for v in settings.host.gpu_vendors),
                    pci_ids_path=settings.host.pci_ids_path, allow_list=allow)  # type: ignore[arg-type]


__all__ = ["discover_host", "open_hypervisor", "open_kernel", "open_uevents"]
