"""Heartbeat ingestion off the request path: a bounded queue of samples flushed to the store by size or time."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sized
from concurrent.futures import Executor
from typing import Any

from hostagent.domain.errors import (HostAgentError, InvalidInput, NotFound, Overloaded, StoreUnavailable,
                                     TooManyRequests)
from hostagent.store.samples import MAX_SKEW_S, Sample, validate_samples

log = logging.getLogger(__name__)


class SampleIngestor:
    """Accept samples at once (validated), write them in batches of one executemany each, in a worker thread.

    ``write`` is a blocking function taking a list of Samples (``UsageStore.write_samples``); ``flush()`` ends with
    ``write([])``, after which that store's background rollups include every sample written. During an outage it
    spools, so a flush never waits on MySQL for long. ``submit`` refuses with Overloaded when the queue is full, and
    with TooManyRequests when the submitting tenant's samples already fill its share of it (``tenant_share`` of
    ``max_queue``): one guest's flood fills its share, not the queue every other guest needs. An accepted sample is dropped only when the store refuses it (an unknown lease or GPU: ``rejected``) or
    when ``close()`` cannot write what is still queued; ``dropped`` counts both, so "nothing lost" is a figure.
    """

    def __init__(self, write: Callable[[list[Sample]], Any], *, max_queue: int = 20_000, batch: int = 1000,
                 interval_s: float = 1.0, executor: Executor | None = None, max_skew_s: float = MAX_SKEW_S,
                 clock: Callable[[], float] = time.time, tenant_share: float = 1.0) -> None:
        if max_queue < 1 or batch < 1 or interval_s <= 0:
            raise InvalidInput("max_queue and batch must be >= 1 and interval_s > 0", field="store.queue_max")
        self._write = write
        self.max_queue = max_queue
        self.batch = batch
        self.interval_s = interval_s
        self._executor = executor
        self._skew = max_skew_s
        self._clock = clock
        self.tenant_cap = max(1, int(max_queue * tenant_share))
        self._groups: collections.deque[list[Sample]] = collections.deque()  # one group per submit call
        self._owners: collections.deque[str] = collections.deque()  # the tenant of each group
        self.by_tenant: dict[str, int] = {}  # samples queued or being written, per tenant
        self._since: collections.deque[float] = collections.deque()  # when each group was accepted (monotonic)
        self._depth = 0
        self._inflight = 0
        self._inflight_since: float | None = None
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.flushed = 0
        self.batches = 0
        self.rejected = 0  # refused by the store at flush time (unknown lease/GPU): counted, logged, dropped
        self.dropped = 0  # accepted but never to be written: the rejected ones, and any close() could not write
        self.overloaded = 0  # submit calls refused because the queue was full
        self.over_share = 0  # submit calls refused because their tenant held its share of the queue
        self.errors = 0  # flushes that failed and were retried

    # -- accepting -----------------------------------------------------------------------------------------------
    def submit(self, samples: Iterable[Mapping[str, Any] | Sample], *, lease_id: str | None = None,
               now: float | None = None, tenant: str = "") -> int:
        """Validate and queue samples; returns how many. InvalidInput for bad ones, Overloaded when full,
        TooManyRequests when `tenant` holds its share."""
        if self._closing:
            raise StoreUnavailable("sample ingestion is shutting down", field="samples")
        if isinstance(samples, Sized) and samples:
            # refuse a full queue before validating: a guest told to retry would have it validated twice
            self._check_room(len(samples), tenant)
        batch = validate_samples(samples, now=self._clock() if now is None else now, max_skew_s=self._skew,
                                 default_lease_id=lease_id or "")
        if not batch:
            return 0
        self._check_room(len(batch), tenant)
        self._groups.append(batch)
        self._owners.append(tenant)
        self._since.append(time.monotonic())
        self._depth += len(batch)
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + len(batch)
        if self._depth >= self.batch:
            self._wake.set()
        return len(batch)

    def _settled(self, owners: Iterable[str], groups: Iterable[list[Sample]]) -> None:
        """Groups written (or dropped for good) no longer count against their tenants' shares."""
        for tenant, g in zip(owners, groups):
            left = self.by_tenant.get(tenant, 0) - len(g)
            if left > 0:
                self.by_tenant[tenant] = left
            else:
                self.by_tenant.pop(tenant, None)

    def _check_room(self, n: int, tenant: str = "") -> None:
        held = self.by_tenant.get(tenant, 0)
        if tenant and held + n > self.tenant_cap:
            self.over_share += 1
            raise TooManyRequests(f"this VM's samples fill its share of the sample queue ({held} of {self.tenant_cap},"
                                  " store.ingest_share); retry later", field="samples",
                                  retry_after=max(1, round(self.interval_s)))
        if self._depth + self._inflight + n > self.max_queue:
            self.overloaded += 1
            raise Overloaded(f"sample queue full ({self._depth + self._inflight} of {self.max_queue}); retry later",
                             field="samples", retry_after=max(1, round(self.interval_s)))

    # -- flushing ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background flusher."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sample-ingestor")

    async def _run(self) -> None:
        backoff = self.interval_s
        while True:
            try:
                async with asyncio.timeout(self.interval_s):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                while self._depth:
                    await self._flush_once()
                    if self._depth < self.batch:
                        break  # less than a batch left: wait for more or for the interval
                backoff = self.interval_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the queue kept the samples; try again later
                self.errors += 1
                log.warning("sample flush failed, retrying in %.1f s: %s", backoff, exc)
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)

    async def flush(self) -> int:
        """Write everything queued now, and wait until the store's rollups include it; returns how many samples
        were written."""
        total = 0
        while self._depth:
            total += await self._flush_once()
        # An empty batch is the flush marker: a store that rolls up in the background (UsageStore.write_samples)
        # returns from it once its rollups include everything written before, so reads after a flush are exact.
        await asyncio.get_running_loop().run_in_executor(self._executor, self._write, [])
        return total

    async def _flush_once(self) -> int:
        async with self._lock:
            groups: list[list[Sample]] = []
            owners: list[str] = []
            since: list[float] = []
            n = 0
            while self._groups and n < self.batch:
                g = self._groups.popleft()
                groups.append(g)
                owners.append(self._owners.popleft())
                since.append(self._since.popleft())
                n += len(g)
            if since:
                self._inflight_since = since[0]
            if not groups:
                return 0
            self._depth -= n
            self._inflight += n
            try:
                written = await self._write_groups(groups)
            except BaseException:
                self._groups.extendleft(reversed(groups))  # back at the front, in order
                self._owners.extendleft(reversed(owners))
                self._since.extendleft(reversed(since))
                self._depth += n
                raise
            finally:
                self._inflight -= n
                self._inflight_since = None
            self._settled(owners, groups)
            return written

    async def _write_groups(self, groups: list[list[Sample]]) -> int:
        loop = asyncio.get_running_loop()
        rows = [s for g in groups for s in g]
        try:
            await loop.run_in_executor(self._executor, self._write, rows)
        except (InvalidInput, NotFound):
            # One request's samples must not sink everyone else's: retry request by request, drop the bad ones.
            written = 0
            for g in groups:
                try:
                    await loop.run_in_executor(self._executor, self._write, g)
                    written += len(g)
                except (InvalidInput, NotFound) as exc:
                    # (the agent's writer sets refused samples aside instead of raising: this is for other writers)
                    self.rejected += len(g)
                    self.dropped += len(g)
                    log.warning("dropped %d samples the store refused: %s", len(g), exc)
            self.flushed += written
            self.batches += 1
            return written
        self.flushed += len(rows)
        self.batches += 1
        return len(rows)

    async def close(self) -> None:
        """Stop accepting, drain the queue into the store, stop the flusher."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, HostAgentError):
                pass
            self._task = None
        try:
            await self.flush()
        except BaseException:
            # Nothing flushes a closed ingestor's queue (a failed write put its batch back): what it holds is lost.
            lost = self._depth
            if lost:
                self.dropped += lost
                self._groups.clear()
                self._owners.clear()
                self._since.clear()
                self.by_tenant.clear()
                self._depth = 0
                log.error("sample ingestion closed with %d accepted samples unwritten: they are lost", lost)
            raise

    # -- figures -------------------------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Samples queued, not yet handed to the store."""
        return self._depth + self._inflight

    def oldest_age_s(self) -> float:
        """How long the oldest sample not yet written has waited (0 when none waits)."""
        oldest = self._inflight_since if self._inflight_since is not None else (self._since[0] if self._since else None)
        return max(0.0, time.monotonic() - oldest) if oldest is not None else 0.0

    def figures(self) -> dict[str, int]:
        """Queue depth, flushed, dropped (accepted samples that will never be written), and refusals."""
        return {"queue_depth": self.depth, "queue_max": self.max_queue, "flushed": self.flushed,
                "batches": self.batches, "dropped": self.dropped, "rejected": self.rejected,
                "overloaded": self.overloaded, "over_share": self.over_share, "errors": self.errors}
