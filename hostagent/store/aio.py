"""The usage store for the event loop: every call runs in a worker thread, and a background task replays the spool."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO, TypeVar

from hostagent.domain.inventory import Gpu
from hostagent.store.repo import UsageStore
from hostagent.store.samples import Sample

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncUsageStore:
    """Async facade over :class:`UsageStore`: never blocks the loop; keeps replaying the spool while degraded."""

    def __init__(self, store: UsageStore, *, max_workers: int = 4, replay_min_s: float = 0.5,
                 replay_max_s: float = 5.0) -> None:  # a retry at most 5 s apart: back soon after an outage ends
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="usage-store")
        # one thread for the lease mirror: transitions must reach the store in the order they happened
        self._mirror = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-mirror")
        self._replay_min_s = replay_min_s
        self._replay_max_s = replay_max_s
        self._task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()

    @classmethod
    async def open(cls, url: str, host_id: str | None = None, *, spool_path: Path | str, start: bool = True,
                   **kwargs: Any) -> AsyncUsageStore:
        """Open the store in a thread (migrating when asked; degraded, not failed, if the database is down)."""
        facade_kw = {k: kwargs.pop(k) for k in ("max_workers", "replay_min_s", "replay_max_s") if k in kwargs}
        store = await asyncio.to_thread(UsageStore, url, host_id, spool_path=spool_path, **kwargs)
        self = cls(store, **facade_kw)
        if start:
            self.start()
        return self

    def start(self) -> None:
        """Start the background spool replay."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._replay_loop(), name="usage-store-replay")

    async def close(self) -> None:
        """Stop replaying, finish queued mirror writes, and close the store."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await asyncio.to_thread(self._mirror.shutdown, wait=True)
        await self.run(self.store.close)
        self._pool.shutdown(wait=True)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run any blocking store function in the store's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    # -- status (no I/O) -----------------------------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        """True while writes go to the local spool."""
        return self.store.degraded

    @property
    def spool_depth(self) -> int:
        """Writes waiting for replay."""
        return self.store.spool_depth

    def status(self) -> dict[str, Any]:
        """Figures for /readyz and metrics."""
        return self.store.status()

    async def _replay_loop(self) -> None:
        delay = self._replay_min_s
        while True:
            if self.store.degraded:
                try:
                    done = await self.run(self.store.replay_spool)
                except Exception:  # keep the loop alive whatever one replay did; it logs and retries
                    log.exception("spool replay failed")
                    done = False
                if done or self.store.reachable:
                    delay = self._replay_min_s
                    if not done:
                        continue  # reachable with more to replay: go on at once
                else:
                    delay = min(self._replay_max_s, delay * 2)
            try:
                async with asyncio.timeout(delay):  # not wait_for: on 3.11 it can swallow a cancel (see runtime)
                    await self._kick.wait()
            except TimeoutError:
                pass
            self._kick.clear()

    def kick(self) -> None:
        """Try a replay now instead of waiting for the backoff (e.g. after an operator fixed the database)."""
        self._kick.set()

    # -- the UsageSink port: never blocks leasing ----------------------------------------------------------------
    def lease_changed(self, lease: Any, event: Any | None) -> None:
        """Mirror a lease (and its event) in the background, in order; errors are logged, never raised."""
        fut = self._mirror.submit(self.store.record_lease, lease, event)
        fut.add_done_callback(_log_failure)

    async def drain_mirror(self) -> None:
        """Wait until every mirrored lease change queued so far is written (or spooled)."""
        await asyncio.wrap_future(self._mirror.submit(lambda: None))

    # -- the repository, awaited ---------------------------------------------------------------------------------
    async def upsert_gpus(self, gpus: Iterable[Mapping[str, Any] | Gpu]) -> int:
        """See UsageStore.upsert_gpus."""
        return await self.run(self.store.upsert_gpus, list(gpus))

    async def list_gpus(self, **kw: Any) -> list[dict[str, Any]]:
        """See UsageStore.list_gpus."""
        return await self.run(self.store.list_gpus, **kw)

    async def publish_fleet(self, info: Mapping[str, Any], states: Mapping[str, str], **kw: Any) -> None:
        """See UsageStore.publish_fleet."""
        await self.run(self.store.publish_fleet, info, states, **kw)

    async def fleet_hosts(self) -> list[dict[str, Any]]:
        """See UsageStore.fleet_hosts."""
        return await self.run(self.store.fleet_hosts)

    async def insert_lease(self, lease: Mapping[str, Any]) -> str:
        """See UsageStore.insert_lease."""
        return await self.run(self.store.insert_lease, lease)

    async def update_lease(self, lease_id: str, changes: Mapping[str, Any]) -> None:
        """See UsageStore.update_lease."""
        await self.run(self.store.update_lease, lease_id, changes)

    async def add_lease_event(self, lease_id: str | None, **kw: Any) -> str:
        """See UsageStore.add_lease_event."""
        return await self.run(self.store.add_lease_event, lease_id, **kw)

    async def get_lease(self, lease_id: str) -> dict[str, Any]:
        """See UsageStore.get_lease."""
        return await self.run(self.store.get_lease, lease_id)

    async def list_leases(self, **kw: Any) -> list[dict[str, Any]]:
        """See UsageStore.list_leases."""
        return await self.run(self.store.list_leases, **kw)

    async def add_samples(self, samples: Iterable[Mapping[str, Any] | Sample], **kw: Any) -> int:
        """See UsageStore.add_samples (prefer SampleIngestor on the heartbeat path)."""
        return await self.run(self.store.add_samples, list(samples), **kw)

    async def lease_usage_summary(self, lease_id: str) -> dict[str, Any]:
        """See UsageStore.lease_usage_summary."""
        return await self.run(self.store.lease_usage_summary, lease_id)

    async def gpu_history(self, gpu_id: str, since: float, until: float | None = None,
                          resolution: int | str = "auto", **kw: Any) -> list[dict[str, Any]]:
        """See UsageStore.gpu_history."""
        return await self.run(self.store.gpu_history, gpu_id, since, until, resolution, **kw)

    async def add_reclaim_event(self, **kw: Any) -> str:
        """See UsageStore.add_reclaim_event."""
        return await self.run(self.store.add_reclaim_event, **kw)

    async def list_reclaim_events(self, **kw: Any) -> list[dict[str, Any]]:
        """See UsageStore.list_reclaim_events."""
        return await self.run(self.store.list_reclaim_events, **kw)

    async def add_probe_result(self, gpu_id: str, **kw: Any) -> str:
        """See UsageStore.add_probe_result."""
        return await self.run(self.store.add_probe_result, gpu_id, **kw)

    async def list_probe_results(self, **kw: Any) -> list[dict[str, Any]]:
        """See UsageStore.list_probe_results."""
        return await self.run(self.store.list_probe_results, **kw)

    async def save_model_version(self, version: str, **kw: Any) -> dict[str, Any]:
        """See UsageStore.save_model_version."""
        return await self.run(self.store.save_model_version, version, **kw)

    async def list_model_versions(self, **kw: Any) -> list[dict[str, Any]]:
        """See UsageStore.list_model_versions."""
        return await self.run(self.store.list_model_versions, **kw)

    async def get_model_version(self, version: str | None = None, **kw: Any) -> dict[str, Any]:
        """See UsageStore.get_model_version."""
        return await self.run(self.store.get_model_version, version, **kw)

    async def finished_leases(self, **kw: Any) -> int:
        """See UsageStore.finished_leases."""
        return int(await self.run(self.store.finished_leases, **kw))

    async def training_records(self, **kw: Any) -> list[dict[str, Any]]:
        """See UsageStore.training_records."""
        return await self.run(self.store.training_records, **kw)

    async def export_csv(self, kind: str, since: float | None, until: float | None, out: TextIO | Path | str) -> int:
        """See UsageStore.export_csv."""
        return await self.run(self.store.export_csv, kind, since, until, out)

    async def prune(self, raw_older_than_s: float, minute_older_than_s: float, **kw: Any) -> dict[str, int]:
        """See UsageStore.prune."""
        return await self.run(self.store.prune, raw_older_than_s, minute_older_than_s, **kw)


def _log_failure(fut: Future[Any]) -> None:
    exc = fut.exception()
    if exc is not None:
        log.error("mirroring a lease to the usage store failed: %s", exc)
