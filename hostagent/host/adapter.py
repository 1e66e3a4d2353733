"""SysfsHost: the host port the lease service drives (binding, give-back, current drivers, vfio interrupts)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hostagent.domain.inventory import Gpu, IommuGroup
from hostagent.host import preflight
from hostagent.host.binding import VFIO_PCI, BindResult, Step, VfioBinder
from hostagent.host.interrupts import read_vfio_interrupts
from hostagent.host.sysfs import Sysfs
from hostagent.host.uevents import OwnChanges

OnStep = Callable[[str, str], None]


class SysfsHost:
    """Implements services.ports.HostPort over a Sysfs (real, or the fake kernel). Blocking: call from a thread."""

    def __init__(self, sysfs: Sysfs, *, dev_root: str | os.PathLike[str] = "/dev",
                 proc_root: str | os.PathLike[str] = "/proc", step_timeout_s: float = 10.0,
                 inventory: Any = None, journal: Callable[[Step], None] | None = None,
                 allow_boot_vga: bool = False, no_reset: str = "warn") -> None:
        self.sysfs = sysfs
        self.proc_root = Path(proc_root)
        self.allow_boot_vga = allow_boot_vga
        self.no_reset = no_reset
        self.inventory = inventory
        self.own = OwnChanges()  # the uevents the agent's own writes cause (services.out_of_band tells them apart)
        self.binder = VfioBinder(sysfs, dev_root, step_timeout_s, journal=journal, own=self.own)

    def current_drivers(self, gpu: Gpu) -> dict[str, str | None]:
        """address -> driver bound now, for every function of the GPU's group."""
        return {str(f.address): self.binder.driver_of(f.address) for f in gpu.functions}

    @staticmethod
    def _group(gpu: Gpu) -> IommuGroup | None:
        return gpu.group

    def bind(self, gpu: Gpu, on_step: OnStep | None = None) -> BindResult:
        """Move every function of the group to vfio-pci (rolls itself back on failure)."""
        group = self._group(gpu)
        if group is None:
            return BindResult(False, error=f"{gpu.id}: {gpu.unviable_reason}")
        if not group.viable:
            return BindResult(False, error=f"{gpu.id}: {group.reason}")
        pre = self.preflight(gpu)
        if pre.refusals:
            return BindResult(False, error=f"{gpu.id} is in use by the host: " + "; ".join(pre.refusals),
                              refused=True, drivers=self.current_drivers(gpu))
        res = self.binder.bind_group(group, on_step)
        return dataclasses.replace(res, warnings=pre.warnings) if pre.warnings else res

    def preflight(self, gpu: Gpu) -> preflight.Preflight:
        """What stops the host giving this GPU to a guest now (see host.preflight), touching nothing."""
        if self.binder.driver_of(gpu.address) == VFIO_PCI:
            return preflight.Preflight()  # already the guests' (a retried grant): the host has let go of it
        return preflight.check(self.sysfs, self.proc_root, str(gpu.address), [str(f.address) for f in gpu.functions],
                               allow_boot_vga=self.allow_boot_vga, no_reset=self.no_reset)

    def give_back(self, gpu: Gpu, original: Mapping[str, str | None], on_step: OnStep | None = None) -> BindResult:
        """Return every function to its original driver ('*' = any host driver, None = leave unbound)."""
        group = self._group(gpu)
        if group is None:
            return BindResult(False, error=f"{gpu.id}: no IOMMU group")
        return self.binder.release_group(group, original, on_step)

    def plan_bind(self, gpu: Gpu) -> Sequence[str]:
        """Human lines describing the bind steps, touching nothing."""
        group = self._group(gpu)
        if group is None or not group.viable:
            return [f"refuse: {gpu.unviable_reason}"]
        return self.binder.plan_bind(group)

    def plan_give_back(self, gpu: Gpu, original: Mapping[str, str | None]) -> Sequence[str]:
        """Human lines describing the give-back steps, touching nothing."""
        group = self._group(gpu)
        if group is None:
            return [f"refuse: {gpu.id} has no IOMMU group"]
        return self.binder.plan_release(group, original)

    def vfio_interrupts(self) -> dict[str, int]:
        """address -> total vfio interrupt count from /proc/interrupts."""
        return {str(a): n for a, n in read_vfio_interrupts(self.proc_root).items()}
