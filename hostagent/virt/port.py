"""The hypervisor port: what the services layer asks of libvirt (or of the simulated hypervisor)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hostagent.domain.hostdev import HostdevPci


class DomainState(enum.StrEnum):
    """A domain's run state, reduced to what leasing cares about (equal to, and formats as, its string value)."""

    RUNNING = "running"
    SHUT_OFF = "shut-off"
    PAUSED = "paused"
    CRASHED = "crashed"


class EventKind(enum.StrEnum):
    """What happened to a domain, or to the connection (equal to, and formats as, its string value)."""

    STARTED = "started"
    STOPPED = "stopped"
    CRASHED = "crashed"
    DEFINED = "defined"
    UNDEFINED = "undefined"
    DEVICE_REMOVED = "device_removed"
    DEVICE_REMOVAL_FAILED = "device_removal_failed"
    DISCONNECTED = "disconnected"  # the connection dropped; uuid and name are empty
    RECONNECTED = "reconnected"  # the connection is back: re-read domain state, events may have been missed


@dataclass(frozen=True, slots=True)
class DomainInfo:
    """A libvirt domain as the agent sees it."""

    name: str
    uuid: str
    state: DomainState
    persistent: bool = True


@dataclass(frozen=True, slots=True)
class DomainEvent:
    """A lifecycle, device or connection event; `detail` is the device alias for device events."""

    uuid: str
    name: str
    kind: EventKind
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class DetachResult:
    """Which hostdevs the hypervisor confirmed removed, and which are still pending (never acknowledged)."""

    removed: tuple[HostdevPci, ...]
    pending: tuple[HostdevPci, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def confirmed(self) -> bool:
        """True only when every hostdev asked for is confirmed gone from the domain."""
        return not self.pending


EventCallback = Callable[[DomainEvent], None]


class Hypervisor(Protocol):
    """Domain lookup, hostdev attach/detach with verification, and lifecycle events."""

    async def list_domains(self) -> list[DomainInfo]:
        """Every domain, running or not."""

    async def get_domain(self, name_or_uuid: str) -> DomainInfo:
        """One domain by name or UUID; NotFound when unknown."""

    async def domain_xml(self, uuid: str, live: bool = True) -> str:
        """The live XML (running domain) or the persistent (inactive) XML."""

    async def attach_hostdevs(self, uuid: str, hostdevs: Sequence[HostdevPci]) -> None:
        """Attach (live and persistent when running, live only where the persistent definition holds the device
        already; persistent when shut off), verify, undo on failure."""

    async def detach_hostdevs(self, uuid: str, hostdevs: Sequence[HostdevPci], timeout_s: float) -> DetachResult:
        """Detach and wait up to timeout_s for removal; never claims removal the guest has not acknowledged."""

    async def attached_hostdevs(self, uuid: str) -> tuple[HostdevPci, ...]:
        """PCI hostdevs in the domain now (live XML when running, else persistent XML)."""

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Call `callback` on the event loop for every DomainEvent; returns an unsubscribe function."""

    async def close(self) -> None:
        """Release the connection and stop background work."""
