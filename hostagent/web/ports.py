"""What the web layer needs from a running agent, and nothing more: the services it reads and the few operations
it calls, as one structural protocol. The composition root (:class:`hostagent.runtime.Runtime`) satisfies it; the
web modules name this protocol, never the root, so the web layer depends on the services and the root alone knows
every part (no import runs from ``hostagent.web`` back to ``hostagent.runtime``)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hostagent.config import Settings
    from hostagent.domain.lease import Lease
    from hostagent.host.adapter import SysfsHost
    from hostagent.services.leases import LeaseManager
    from hostagent.services.out_of_band import OutOfBandWatcher
    from hostagent.services.reaper import Reaper
    from hostagent.store.aio import AsyncUsageStore
    from hostagent.store.ingest import SampleIngestor
    from hostagent.store.journal import Journal
    from hostagent.web.auth import Identity, TokenBook


class AgentServices(Protocol):
    """The running agent as the API, the dashboard, the metrics and the topology routes see it."""

    settings: Settings
    host: SysfsHost
    journal: Journal
    manager: LeaseManager
    tokens: TokenBook
    store: AsyncUsageStore | None  # None when the agent runs without a usage store
    ingestor: SampleIngestor | None
    reaper: Reaper | None
    watcher: OutOfBandWatcher | None  # the kernel's uevents (None: not composed, e.g. a test's bare runtime)
    clock: Callable[[], float]
    started: bool  # reconciled and serving
    hypervisor_ok: bool  # the hypervisor connection answers
    recent_samples: dict[str, collections.deque[dict[str, Any]]]  # per lease: the last guest samples, in memory

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a blocking call in a worker thread."""

    async def refresh_drivers(self, gpu_id: str | None = None) -> None:
        """Re-read the GPU functions' drivers for the views (when anything changed, or they are a few seconds old;
        one GPU's always)."""

    def gpu_view(self, gpu_id: str) -> dict[str, Any]:
        """A GPU's JSON as an operator sees it."""

    def gpu_view_for(self, gpu_id: str, identity: Identity | None) -> dict[str, Any]:
        """A GPU's JSON as this caller may see it."""

    async def gpu_detail(self, gpu_id: str, identity: Identity | None) -> dict[str, Any]:
        """A GPU's JSON with live drivers and its history."""

    async def lease_usage(self, lease_id: str) -> dict[str, Any]:
        """A lease's usage so far."""

    def samples_refused_for(self, lease: Lease) -> float: ...

    async def accept_samples(self, lease: Lease, samples: list[dict[str, Any]]) -> int:
        """Take a heartbeat's samples (raises Overloaded when the ingest queue is full)."""

    def readiness(self) -> dict[str, dict[str, Any]]:
        """The checks behind /readyz."""

    def store_health(self) -> dict[str, Any]:
        """Whether the usage store takes everything in time, and what is behind."""
