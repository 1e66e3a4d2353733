"""The ports the services layer drives. Adapters implement them; tests pass fakes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hostagent.domain.hostops import HostOpResult, Step
from hostagent.domain.inventory import Gpu

__all__ = ["HostOpResult", "HostPort", "Step", "UsageSink"]


class HostPort(Protocol):
    """What the lease service needs from the host (sysfs). Blocking: called from a worker thread."""

    def current_drivers(self, gpu: Gpu) -> dict[str, str | None]:
        """address -> driver bound now, for every function of the GPU's group."""

    def bind(self, gpu: Gpu, on_step: Callable[[str, str], None] | None = None) -> HostOpResult:
        """Move every function of the group to vfio-pci (rolls itself back on failure)."""

    def give_back(self, gpu: Gpu, original: dict[str, str | None],
                  on_step: Callable[[str, str], None] | None = None) -> HostOpResult:
        """Return every function to its original driver (or none)."""

    def plan_bind(self, gpu: Gpu) -> Sequence[str]:
        """Human lines describing the bind steps, touching nothing."""

    def plan_give_back(self, gpu: Gpu, original: dict[str, str | None]) -> Sequence[str]:
        """Human lines describing the give-back steps, touching nothing."""

    def vfio_interrupts(self) -> dict[str, int]:
        """address -> total vfio interrupt count from /proc/interrupts."""


class UsageSink(Protocol):
    """Where lease records, events and samples are mirrored (the usage store). Must never block leasing."""

    def lease_changed(self, lease: Any, event: Any | None) -> None:
        """A lease was written to the journal; mirror it (best effort, queued)."""
