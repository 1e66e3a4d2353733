"""Watching the kernel for changes the agent did not make (issue #19): a leased function unbound or rebound by
someone else, a free GPU's function handed to vfio-pci by hand, a GPU removed from the bus or hot-added.

`OutOfBandWatcher` takes the kernel's PCI uevents (host.uevents for the running kernel, the fake kernel's own for
its trees) in the event loop. The uevents of the agent's own writes are claimed from `own` (host.uevents.OwnChanges,
exact: by count) and only refresh what the views show; every other one is noted against its function, and the GPU
is looked at at once: its IOMMU group's lock held (so none of the agent's own steps on it is half done), its
drivers read from sysfs, then `domain.out_of_band.judge` says what it means. A finding is acted on within the
second: the GPU quarantined or marked for attention with the reason (out of placement until an operator clears
it), the lease that held it marked (its `error`), an `out-of-band` journal event, a count per change for
/metrics, and the operator's views re-read the drivers.

Removal and return: a function's `remove` puts it in `missing` (the GPU's view lists it; a quarantine cannot be
cleared while it is gone) and its `add` takes it out again; a function the inventory does not know appearing on the
bus (a hot-add) has the host discovered again, and a GPU found then joins the inventory without a restart.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from hostagent.domain.inventory import Gpu
from hostagent.domain.out_of_band import Finding, Touch, judge
from hostagent.services.lease_types import LeaseCore, all_drivers
from hostagent.services.quarantine import mark_attention, quarantine_gpu

log = logging.getLogger("hostagent.out_of_band")
EVENT = "out-of-band"  # the journal event's kind
SETTLE_S = 0.05  # a change by hand is several writes (unbind, override, probe): look once they have all arrived
ADD_SETTLE_S = 0.2  # a rescan adds a batch of functions: discover once they have all arrived
KEEP_FINDINGS = 100
KEEP_CLAIMED = 256  # the agent's own uevents remembered (as things stood) in case one turns out someone else's


class OutOfBandWatcher:
    """Follows a uevent source (`start(deliver)`, `stop()`) for the GPUs of a lease manager."""

    ACTOR = "kernel"

    def __init__(self, m: LeaseCore, source: Any, *, own: Any = None,
                 rediscover: Callable[[], Sequence[Gpu]] | None = None, on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.m = m
        self.source = source
        self.own = own  # host.uevents.OwnChanges: claim(address, action) -> True for the agent's own changes
        self.rediscover = rediscover
        self.on_change = on_change
        self.clock = clock
        self.counts: collections.Counter[str] = collections.Counter()  # change -> how many (/metrics)
        self.uevents = 0  # every PCI uevent received
        self.own_uevents = 0  # ... of which the agent's own writes caused
        self.findings: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_FINDINGS)
        self.error: str | None = None  # why the source could not start (None: watching, or not started)
        self.watching = False
        self._touched: dict[str, dict[str, Touch]] = {}
        self.added_listeners: list[Callable[[list[Gpu]], None]] = []  # told of GPUs that joined (the topology)
        self._marked: dict[str, str] = {}  # gpu_id -> the attention reason this watcher set (a newer one replaces it)
        self._unknown_added: set[str] = set()
        self._held_until: dict[str, tuple[str, float]] = {}  # gpu_id -> the last lease that held it, until when
        # (address, action, at) of a uevent taken for the agent's own -> (the driver before, the lease then)
        self._claimed: dict[tuple[str, str, float | None], tuple[str | None, str | None]] = {}
        self._last_driver: dict[str, str | None] = {}
        self._by_address: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Know every function's driver now, open the source, and start handling what it says. A source that
        cannot open is logged and kept in `error` (the agent runs on; the views say it is not watching)."""
        self._index()
        self._last_driver = await self.m._run(all_drivers, self.m)
        self._loop = asyncio.get_running_loop()
        self.m.listeners.append(self._on_lease)
        if self.own is not None:
            self.own.on_misclaimed = self._misclaimed
        try:
            self.source.start(self._from_thread)
        except Exception as exc:  # UeventsUnavailable, or any failure of a source to open
            self.error = str(exc)
            log.warning("not watching for out-of-band changes: %s", exc)
            return
        self.watching = True
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop the source and the handler."""
        if self.watching:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.source.stop)
        self.watching = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def status(self) -> dict[str, Any]:
        """For readiness and the views: watching what, and what it has seen."""
        return {"watching": self.watching, "source": getattr(self.source, "description", type(self.source).__name__),
                "error": self.error, "uevents": self.uevents, "own_uevents": self.own_uevents,
                "changes": dict(self.counts),
                "missing": sorted(self.m.missing)}

    # -- events --------------------------------------------------------------------------------------------------
    def _from_thread(self, action: str, address: str, driver: str | None, at: float | None = None) -> None:
        self._post(functools.partial(self.deliver, action, address, driver, at))

    def _misclaimed(self, address: str, action: str, driver: str | None, at: float | None) -> None:
        """A uevent taken for one of the agent's writes that sent none (from the writer's thread): someone else's."""
        self._post(functools.partial(self.deliver, action, address, driver, at, mine=False))

    def _post(self, call: Callable[[], None]) -> None:
        """Run `call` in the event loop (from a source's or a writer's thread), unless the loop has gone."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(call)

    def deliver(self, action: str, address: str, driver: str | None, at: float | None = None, *,
                mine: bool | None = None) -> None:
        """One uevent, in the event loop (`at`: when it was sent, time.monotonic()): note it, wake the handler.
        `mine`: False for a uevent taken for the agent's own at first, known now to be someone else's (None: ask
        `own`)."""
        if mine is None:
            self.uevents += 1
        else:
            self.own_uevents -= 1
        gpu_id = self._by_address.get(address)
        if gpu_id is None:
            if action == "add" and self.rediscover is not None:
                self._unknown_added.add(address)
                self._wake.set()
            return
        was = self._last_driver.get(address)
        then = self._lease_of(gpu_id)
        if then is None and at is not None and gpu_id in self._held_until:
            lease_id, until = self._held_until[gpu_id]
            if until >= at:  # sent while a lease that has ended since held the GPU
                then = lease_id
        if mine is None:
            self._last_driver[address] = driver if action == "bind" else None
        else:  # as things stood when it arrived
            was, then = self._claimed.pop((address, action, at), (was, then))
        if (mine is None and action in ("bind", "unbind") and self.own is not None
                and self.own.claim(address, action, at, driver)):
            self.own_uevents += 1
            self._claimed[(address, action, at)] = (was, then)
            while len(self._claimed) > KEEP_CLAIMED:
                self._claimed.pop(next(iter(self._claimed)))
            self.on_change()
            return
        touched = self._touched.setdefault(gpu_id, {})
        before = touched.get(address)
        held_by = before.held_by if before is not None else None
        if held_by is None and action in ("bind", "unbind"):
            held_by = then
        if before is not None and before.action in ("add", "remove") and action in ("bind", "unbind"):
            action = before.action  # the return (or the removal) is the news; the probe's bind that follows is not
        touched[address] = Touch(action, before.was if before is not None else was, held_by,
                                 driver if action == "bind" else None)
        if action == "remove":
            self.m.missing[address] = self.clock()  # at once: a clear or a grant sees it before the handler runs
        elif action == "add":
            self.m.missing.pop(address, None)
        self.on_change()
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(SETTLE_S)
            self._wake.clear()
            try:
                await self.drain()
            except Exception:
                log.exception("handling out-of-band changes failed")

    async def drain(self) -> list[Finding]:
        """Look at every touched GPU now (and discover the host again for functions it did not know)."""
        found: list[Finding] = []
        while self._touched:
            gpu_id = next(iter(self._touched))
            found += await self._look(gpu_id, self._touched.pop(gpu_id))
        if self._unknown_added:  # only ever noted when there is a rediscovery
            await asyncio.sleep(ADD_SETTLE_S)
            self._unknown_added.clear()
            await self._discover()
        return found

    async def _look(self, gpu_id: str, touched: dict[str, Touch]) -> list[Finding]:
        m = self.m
        gpu = m.gpus.get(gpu_id)
        if gpu is None:
            return []
        async with m._group_lock(gpu.iommu_group if gpu.iommu_group is not None else -1):
            lease_id = self._lease_of(gpu_id)
            drivers = await m._run(m.host.current_drivers, gpu)
            missing = frozenset(a for a in drivers if a in m.missing)
        for address, driver in drivers.items():
            if address not in missing:
                self._last_driver[address] = driver
        findings = judge(gpu_id, touched, drivers, missing, lease_id=lease_id, pinned=frozenset(m.policy.pinned))
        for f in findings:
            await self._act(f)
        self.on_change()
        return findings

    def _on_lease(self, lease: Any, detail: str | None) -> None:
        """Lease listener: when a lease ends, remember until when it held its GPUs (time.monotonic(), the uevents'
        clock), so a uevent sent before its end and read after is still judged as the lease's."""
        if lease is not None and lease.state.terminal:
            now = time.monotonic()
            for gpu_id in lease.gpu_ids:
                self._held_until[gpu_id] = (lease.id, now)

    def _lease_of(self, gpu_id: str) -> str | None:
        """The live lease holding the GPU now (a probe's claim is none)."""
        claim = self.m.claims.get(gpu_id)
        return claim if claim is not None and claim in self.m.leases else None

    async def _act(self, f: Finding) -> None:
        """Quarantine or mark the GPU, mark the lease, journal, count."""
        m = self.m
        log.warning("out-of-band change: %s", f.reason, extra={"gpu_id": f.gpu_id, "lease_id": f.lease_id})
        await m._run(m.journal.event, EVENT, actor=self.ACTOR, lease_id=f.lease_id, gpu_id=f.gpu_id,
                     detail=f"{f.change}: {f.reason}")
        if f.mark == "quarantine" and f.gpu_id not in m.quarantined:
            await quarantine_gpu(m, f.gpu_id, f.reason, self.ACTOR)
        elif f.mark == "attention" and f.gpu_id not in m.quarantined and (
                f.gpu_id not in m.attention or m.attention[f.gpu_id] == self._marked.get(f.gpu_id)):
            self._marked[f.gpu_id] = f.reason
            await mark_attention(m, f.gpu_id, f.reason, self.ACTOR, lease_id=f.lease_id)
        if f.lease_id is not None and f.mark:
            async with m.lease_lock(f.lease_id):
                lease = m.leases.get(f.lease_id)
                if lease is not None and not lease.state.terminal:
                    await m._write(lease.with_changes(error=f"out of band: {f.reason}"), lease.state, self.ACTOR,
                                   f"out of band: {f.reason}")
        # counted once acted on: whoever reads a count sees the GPU's mark and the lease's already
        self.counts[f.change] += 1
        self.findings.append({**f.to_dict(), "at": self.clock()})

    async def _discover(self) -> None:
        """Functions the inventory did not know arrived: discover the host and take in the GPUs that are new."""
        assert self.rediscover is not None
        try:
            gpus = await self.m._run(self.rediscover)
        except Exception as exc:
            log.warning("discovering the host after a hot-add failed: %s", exc)
            return
        added = [g for g in gpus if g.id not in self.m.gpus]
        for g in added:
            # the finding is journaled and counted before the GPU joins the inventory: whoever sees the GPU
            # listed sees why it is there
            f = Finding("added", g.id, str(g.address), "",
                        f"GPU {g.id} ({g.model}) at {g.address} appeared on the PCI bus; added to the inventory")
            await self._act(f)
            self.m.gpus[g.id] = g
            for fn in g.functions:
                self._last_driver[str(fn.address)] = fn.driver
        if added:
            self._index()
            for listener in self.added_listeners:
                try:
                    listener(added)
                except Exception:
                    log.exception("a listener of added GPUs failed")
            self.m._wake_queue.set()
            self.on_change()

    # -- helpers -------------------------------------------------------------------------------------------------
    def _index(self) -> None:
        self._by_address = {str(fn.address): g.id for g in self.m.gpus.values() for fn in g.functions}


__all__ = ["EVENT", "OutOfBandWatcher"]
