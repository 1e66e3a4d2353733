"""The composition root: settings -> adapters -> services -> web app, with one lifecycle per resource."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from hostagent.config import Settings
from hostagent.domain.admission import TokenBucket
from hostagent.domain.errors import ConfigError, HostAgentError, InvalidInput, TooManyRequests
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import Lease, LeaseState
from hostagent.host.adapter import SysfsHost
from hostagent.host.discovery import Inventory, numa_cells
from hostagent.host.interrupts import irq_bypass
from hostagent.domain.placement import Exploration
from hostagent.services.grant_path import gpu_capabilities
from hostagent.services.fleet import publisher_for
from hostagent.services.lease_types import all_drivers
from hostagent.services.leases import LeaseManager, lease_view
from hostagent.services.out_of_band import OutOfBandWatcher
from hostagent.services.model_follow import START, ModelFollower
from hostagent.services.placement import Placer
from hostagent.services.retraining import Retrainer
from hostagent.services.reaper import Reaper, host_signal_untrusted, reaper_settings
from hostagent.services.reconcile import (  # noqa: F401 (MISSED_WHILE_AWAY: re-exported)
    MISSED_WHILE_AWAY,
    Reconciler,
    Repair,
    reread_domains,
)
from hostagent.adapters import discover_host, open_hypervisor, open_kernel, open_uevents
from hostagent.policy import lease_policy
from hostagent.store.journal import Journal, read_boot_id
from hostagent.web.auth import Identity, TokenBook

log = logging.getLogger("hostagent.runtime")
MIRROR_MAX_DEFER_S = 1.0  # the store mirror waits for a quiet moment at most this long (see LeaseManager.quiet)
MIRROR_SETTLE_S = 0.002  # ... and a moment counts once it has lasted this long
SET_ASIDE_KIND = "store-set-aside"  # journal event: the usage store refused a write, kept for `hostagent db rejected`
RECLAIM_KINDS = frozenset({"strike-one", "strike-two", "strike-cleared", "reclaim", "reclaim-outcome"})
REREAD_RETRY_S = 5.0  # a domain whose state could not be re-read after a reconnect is read again after this long...
DRIVERS_MAX_AGE_S = 5.0  # the views' function drivers are re-read at least this often (a change made outside the agent)
REREAD_RETRY_MAX_S = 60.0  # ... doubling up to this, until it answers or a newer reconnect re-reads everything
SAMPLE_BURST_S = 60.0  # a lease may send this many seconds of store.samples_per_lease_per_s at once


def _schema_at_head(url: str) -> None:
    """With store.auto_upgrade off, refuse to start on a store whose schema is missing or older than this agent's,
    saying what to run, rather than failing at the first write with the database's own error. A store that cannot
    be reached is left to the degraded start (writes spool until it is back)."""
    from hostagent.store.migrate import current_revision, head_revision

    try:
        have = current_revision(url)
    except Exception as exc:  # noqa: BLE001 - unreachable: the store opens degraded and says so
        log.warning("cannot read the usage store's schema revision: %s", exc)
        return
    want = head_revision()
    if have != want:
        raise ConfigError(f"store.auto_upgrade is false and the usage store's schema is at {have or 'nothing (empty)'}"
                          f", this agent needs {want}: run `hostagent db upgrade` (or set store.auto_upgrade = true)",
                          field="store.auto_upgrade")


@dataclass
class Runtime:
    """Everything a running agent holds. Built by `build_runtime`, started by the web app's cleanup context."""

    settings: Settings
    inventory: Inventory
    host: SysfsHost
    hypervisor: Any
    journal: Journal
    manager: LeaseManager
    tokens: TokenBook
    store: Any = None
    ingestor: Any = None
    reaper: Any = None
    clock: Callable[[], float] = time.time
    repairs: list[Repair] = field(default_factory=list)
    started: bool = False
    hypervisor_ok: bool = False
    recent_samples: dict[str, collections.deque[dict[str, Any]]] = field(default_factory=dict)
    last_heartbeat: dict[str, float] = field(default_factory=dict)
    sample_buckets: dict[str, TokenBucket] = field(default_factory=dict)  # lease -> its heartbeat sample rate
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    _unsubscribe: Callable[[], None] | None = None  # from the hypervisor's subscribe, while started
    use_store: bool = True
    placer: Any = None
    models: Any = None  # the ModelFollower: the placer follows the store's active model version
    retrainer: Any = None  # the Retrainer: every placement.retrain_interval_s and as the records grow
    fleet: Any = None  # the FleetPublisher: this host's live state to the shared store (services.fleet)
    watcher: Any = None  # the OutOfBandWatcher: the kernel's uevents for changes the agent did not make
    reread_retry_s: float = REREAD_RETRY_S
    _reconnects: int = 0
    _mirror_lock: threading.Lock = field(default_factory=threading.Lock)
    mirror_backlog: tuple[int, float | None] = (0, None)  # journal events not yet in the store; the oldest's time
    mirror_error: str | None = None  # why the last mirror batch failed (None once one succeeds)
    drivers_read: tuple[Any, float, dict[str, str | None]] | None = None  # (change key, when, address -> driver)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a blocking call in a worker thread."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    @property
    def model_version(self) -> str | None:
        """The placement model version placing leases now (None: no model loaded); /metrics and /ui/model."""
        return self.placer.model_version if self.placer is not None else None

    @property
    def placement_rule(self) -> str:
        """What decides placements now: "model" or "cold-start"."""
        return str(self.placer.rule) if self.placer is not None else "cold-start"

    # -- views ---------------------------------------------------------------------------------------------------
    async def refresh_drivers(self, gpu_id: str | None = None) -> None:
        """Read every GPU function's driver from sysfs (a worker thread) when the agent changed anything since the
        last reading (a journaled step, a quarantine, an attention mark), or DRIVERS_MAX_AGE_S ago for a change made
        outside the agent; the views then show the drivers as they are, not as discovery found them at start.
        With `gpu_id` (one GPU's page: cheap), that GPU's are read now whatever the age (a hung write may have
        returned since)."""
        m = self.manager
        key = (m.step_count, len(m.quarantined), len(m.attention))
        cached = self.drivers_read
        if cached is not None and cached[0] == key and time.monotonic() - cached[1] < DRIVERS_MAX_AGE_S:
            if gpu_id is not None:
                cached[2].update(await self.run(self.host.current_drivers, m.gpus[gpu_id]))
            return
        drivers = await self.run(all_drivers, m)
        self.drivers_read = (key, time.monotonic(), drivers)

    def drivers_changed(self) -> None:
        """The kernel said a function's driver changed (services.out_of_band): the views read sysfs again at their
        next refresh. The last reading stays what they show until then: dropping it made a view built between the
        uevent and that refresh show the drivers discovery found at start (a CI run of test_hung_unbind saw it)."""
        if self.drivers_read is not None:
            self.drivers_read = (None, float("-inf"), self.drivers_read[2])

    def gpu_view_for(self, gpu_id: str, identity: Identity | None) -> dict[str, Any]:
        """A GPU as a caller may see it: another VM's lease shows only its state, never its id or VM."""
        body = self.gpu_view(gpu_id)
        lease = self.manager.lease_of(gpu_id)
        if lease is not None and not (identity is not None and (identity.is_operator
                                                               or identity.domain_uuid == lease.domain_uuid)):
            body["lease"] = {"state": lease.state.value}
        return body

    def gpu_view(self, gpu_id: str) -> dict[str, Any]:
        """The API's JSON for a GPU (operator's view)."""
        g: Gpu = self.manager.gpus[gpu_id]
        lease = self.manager.lease_of(gpu_id)
        body = g.to_dict()
        if self.drivers_read is not None:  # as sysfs said at the last refresh_drivers, not discovery's
            live = self.drivers_read[2]
            for f in body["functions"]:
                f["driver"] = live.get(f["address"], f["driver"])
        return {
            **body,
            "state": self.manager.gpu_state(gpu_id).value,
            "capabilities": gpu_capabilities(self.manager, g).to_dict(),
            "quarantine_reason": self.manager.quarantined.get(gpu_id),
            "attention": self.manager.attention.get(gpu_id),
            "missing_functions": [f["address"] for f in body["functions"] if f["address"] in self.manager.missing],
            "lease": None if lease is None else {"id": lease.id, "domain": lease.domain_name, "state": lease.state.value},
        }

    async def gpu_detail(self, gpu_id: str, identity: Identity | None) -> dict[str, Any]:
        """GPU view plus history summary (operators also get recent events)."""
        await self.refresh_drivers(gpu_id)
        body = self.gpu_view_for(gpu_id, identity)
        # the GPU's own index rows, however long the journal: the counts and the newest lease's id
        history = await self.run(self.journal.gpu_history, gpu_id)
        last_id = history.pop("last_lease_id")
        body["history"] = history
        if identity is not None and identity.is_operator:
            events = await self.run(self.journal.events, gpu_id=gpu_id, limit=50)
            body["events"] = [e.to_dict() for e in events]
            last = await self.run(self.journal.get, last_id) if last_id is not None else None
            if last is not None and last.placement:
                body["last_placement"] = {"lease_id": last.id, **dict(last.placement)}
        return body

    async def lease_usage(self, lease_id: str) -> dict[str, Any]:
        """Usage so far: from the store when present, else the in-memory window."""
        window = list(self.recent_samples.get(lease_id, ()))
        live = self.manager.leases.get(lease_id)
        if live is not None and live.state in (LeaseState.REQUESTED, LeaseState.QUEUED, LeaseState.BOOKED):
            return {"samples": 0}  # nothing to ask the store for yet (guests poll queued leases often)
        if self.store is not None:
            with contextlib.suppress(HostAgentError):
                summary = await self.store.lease_usage_summary(lease_id)
                # samples still queued for the store are counted from the in-memory window
                return {"samples": max(summary["total"]["n"], len(window)), **summary}
        if not window:
            return {"samples": 0}
        return {"samples": len(window),
                "mean_util_pct": sum(s["util_pct"] for s in window) / len(window),
                "max_mem_used_bytes": max(s["mem_used_bytes"] for s in window),
                "last_ts": max(s["ts"] for s in window)}

    async def accept_samples(self, lease: Lease, samples: list[dict[str, Any]]) -> int:
        """Queue samples for the store and keep a window for the reaper. A lease sends at most
        store.samples_per_lease_per_s (in bursts of SAMPLE_BURST_S of it) and its VM fills at most its share of the
        store's queue: past either, TooManyRequests (429) for it alone; Overloaded (503) when the queue is full."""
        if samples:
            self._take_sample_rate(lease, len(samples))
        try:
            if self.ingestor is not None and samples:
                self.ingestor.submit([dict(s, source="guest") for s in samples], lease_id=lease.id,
                                     tenant=lease.domain_uuid)
        except BaseException:
            self.sample_buckets[lease.id].give_back(len(samples))
            raise
        window = self.recent_samples.setdefault(lease.id, collections.deque(maxlen=4096))
        window.extend(samples)
        self.last_heartbeat[lease.id] = self.clock()
        if self.reaper is not None and lease.strike_at is not None:
            pol = self.reaper.settings.policy
            busy = [s for s in samples if s["util_pct"] > pol.idle_util_pct
                    or (pol.memory_counts_busy and s["mem_used_bytes"] > pol.memory_busy_bytes)]
            if busy:
                await self.reaper.activity_seen(lease.id, f"heartbeat with {len(busy)} busy sample(s)")
        return len(samples)

    def samples_refused_for(self, lease: Lease) -> float:
        """Seconds this lease must still wait after its last heartbeat was refused for its sample rate: a heartbeat
        sooner is answered 429 before its body is read or parsed (a flood of refused 1,000-sample heartbeats cost
        3.4 ms of parsing each)."""
        bucket = self.sample_buckets.get(lease.id)
        return bucket.refused_for(self.clock()) if bucket is not None else 0.0

    def _take_sample_rate(self, lease: Lease, n: int) -> None:
        rate = self.settings.store.samples_per_lease_per_s
        bucket = self.sample_buckets.get(lease.id)
        if bucket is None:
            bucket = self.sample_buckets[lease.id] = TokenBucket(rate, max(1.0, rate * SAMPLE_BURST_S), self.clock())
        if n > bucket.capacity:
            raise InvalidInput(f"{n} samples in one heartbeat; this agent takes at most {bucket.capacity:.0f} "
                               f"(store.samples_per_lease_per_s x {SAMPLE_BURST_S:.0f} s)", field="samples")
        wait = bucket.take(n, self.clock())
        if wait:
            raise TooManyRequests(f"this lease sends samples faster than store.samples_per_lease_per_s ({rate:g}/s); "
                                  f"send these {n} in {wait:.0f} s, or fewer", field="samples", retry_after=wait)

    def _forget_ended(self, lease: Lease | None, detail: str | None) -> None:
        """Drop per-lease memory once a lease has ended (its samples are in the store)."""
        if lease is not None and lease.state.terminal:
            self.recent_samples.pop(lease.id, None)
            self.last_heartbeat.pop(lease.id, None)
            self.sample_buckets.pop(lease.id, None)
            if self.reaper is not None:
                self.reaper.last_verdicts.pop(lease.id, None)
                self.reaper.disputed.pop(lease.id, None)

    def samples_since(self, lease_id: str, since: float) -> list[dict[str, Any]]:
        """Guest samples of a lease newer than `since` (the reaper's window)."""
        return [s for s in self.recent_samples.get(lease_id, ()) if s["ts"] > since]

    def readiness(self) -> dict[str, dict[str, Any]]:
        """Checks behind /readyz."""
        checks: dict[str, dict[str, Any]] = {
            "reconciled": {"ok": self.started, "repairs": len(self.repairs)},
            "hypervisor": {"ok": self.hypervisor_ok},
        }
        if self.watcher is not None:  # not required: without uevents the views still re-read sysfs
            checks["uevents"] = {"ok": self.watcher.watching, "required": False, **self.watcher.status()}
        if self.store is not None:
            checks["store"] = self.store_health()
        return checks

    def store_health(self) -> dict[str, Any]:
        """Whether the usage store is taking everything the agent records, in time, and what is behind: the
        mirror's backlog and lag, samples waiting, writes spooled during an outage and writes the store refused
        (set aside). ``ok`` is false, with each reason in ``problems``, when the store is unreachable, replays a
        spool, has writes set aside, the mirror's last batch failed, or anything waits longer than store.max_lag_s.
        Read on the event loop: no I/O (the mirror measures its backlog after each batch)."""
        st = self.store.status()
        aside = st["spool_dead"]
        bound = self.settings.store.max_lag_s
        pending, oldest = self.mirror_backlog
        lag = max(0.0, self.clock() - oldest) if oldest is not None else 0.0
        waiting = self.ingestor.depth if self.ingestor is not None else 0
        waited = self.ingestor.oldest_age_s() if self.ingestor is not None else 0.0
        problems = []
        if not st["reachable"]:
            problems.append("unreachable: writes go to the local spool")
        elif st["spool_depth"]:
            problems.append(f"{st['spool_depth']} spooled write(s) waiting for replay")
        if aside:
            problems.append(f"{aside} write(s) refused by the store are set aside (hostagent db rejected)")
        if self.mirror_error:
            problems.append(f"the journal mirror is failing: {self.mirror_error}")
        if lag > bound:
            problems.append(f"the journal mirror is {lag:.0f} s behind (store.max_lag_s {bound:g})")
        if waited > bound:
            problems.append(f"heartbeat samples have waited {waited:.0f} s to be written (store.max_lag_s {bound:g})")
        return {"ok": not problems, "required": False, "reachable": st["reachable"], "problems": problems,
                "spool_depth": st["spool_depth"], "set_aside": aside, "rows_lost": st["rows_lost"],
                "unmirrored_events": pending, "mirror_lag_s": round(lag, 3), "samples_waiting": waiting,
                "samples_oldest_s": round(waited, 3), "max_lag_s": bound}

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Reconcile, subscribe to events, start background jobs."""
        boot = read_boot_id(self.settings.proc_root)
        previous = await self.run(self.journal.swap_boot_id, boot)
        if previous is not None and previous != boot:
            await self.run(self.journal.event, "boot", actor="agent", detail=f"host rebooted ({previous} -> {boot})")
        try:
            await self.hypervisor.list_domains()
            self.hypervisor_ok = True
        except HostAgentError as exc:
            log.error("hypervisor unreachable at start: %s", exc.message)
        self._unsubscribe = self.hypervisor.subscribe(self._on_domain_event)
        self.repairs = await Reconciler(self.manager).run()
        if self.watcher is not None:
            await self.watcher.start()
        await self._open_store()
        loop_tasks = [self.manager.run_queue(), self._periodic(5.0, self.manager.expire_due),
                      self._periodic(max(5.0, self.settings.libvirt.detach_timeout_s), self.manager.retry_pending)]
        self.manager.listeners.append(self._forget_ended)
        if self.settings.leases.journal_retention_days > 0:
            loop_tasks.append(self._periodic(3600.0, self.prune_journal))
        if self.store is not None:
            # scikit-learn is a heavy import: load the model after readiness, the cold-start rule decides until then
            pl = self.settings.placement
            loop_tasks += [self._load_model(), self._mirror_loop(), self._periodic(3600.0, self._prune),
                           self._periodic(pl.retrain_interval_s, self.retrainer.scheduled),
                           self._periodic(pl.model_check_interval_s, self.models.check),
                           self._periodic(pl.model_check_interval_s, self.retrainer.if_grown),
                           self.fleet.run()]
        self.tasks.extend(asyncio.create_task(c) for c in loop_tasks)  # beside a re-read a reconnect may have begun
        self.manager._wake_queue.set()
        if self.reaper is not None:
            await self.reaper.start()
        if self.store is None and self.settings.agent.gc_freeze:
            settle_heap()  # with a store, once the model (scikit-learn and numpy) is loaded
        self.started = True

    async def _open_store(self) -> None:
        """Open the usage store (degraded, not failed, when MySQL is down) and the heartbeat ingestor."""
        if not self.use_store:
            return
        from hostagent.store.aio import AsyncUsageStore
        from hostagent.store.ingest import SampleIngestor

        st = self.settings.store
        url = self.settings.store_url
        if url.startswith("sqlite:///"):
            Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        if not st.auto_upgrade:
            await self.run(_schema_at_head, url)
        self.store = await AsyncUsageStore.open(url, self.settings.agent.host_id, spool_path=self.settings.spool_path,
                                                auto_upgrade=st.auto_upgrade)
        self.store.store.on_set_aside = self._note_set_aside
        self.mirror_backlog = await self.run(self.journal.backlog)
        with contextlib.suppress(HostAgentError):
            await self.store.upsert_gpus(list(self.manager.gpus.values()))
        self.ingestor = SampleIngestor(self._write_samples, max_queue=st.queue_max, batch=st.flush_batch,
                                       interval_s=st.flush_interval_s, tenant_share=st.ingest_share)
        self.ingestor.start()

    async def _mirror_loop(self) -> None:
        """Copy journal events (and the leases they concern) to the usage store, in order, exactly once."""
        while True:
            # Beside a lease step's attach or detach wait, or between requests; not beside the agent's own work on a
            # lease, which the batch (a worker thread in this interpreter) would slow; never more than a second late.
            await self._quiet_moment()
            try:
                moved = await self.run(self._mirror_batch)
            except Exception:
                log.exception("mirroring the journal to the usage store failed; will retry")
                moved = 0
            await asyncio.sleep(0.05 if moved else 0.5)

    async def _quiet_moment(self) -> None:
        """Until the lease driver has been quiet for MIRROR_SETTLE_S (a request that follows another at once is
        not left to collide with the batch), or MIRROR_MAX_DEFER_S have passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MIRROR_MAX_DEFER_S
        quiet = self.manager.quiet
        while loop.time() < deadline:
            # asyncio.timeout_at, not wait_for: on 3.11 wait_for can swallow a cancel that arrives as the event
            # is set, and stop() would wait for this task for ever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await quiet.wait()
            await asyncio.sleep(MIRROR_SETTLE_S)
            if quiet.is_set():
                return

    def _write_samples(self, samples: list[Any]) -> Any:
        """The ingestor's writer (worker thread): mirror pending lease records first, so a sample's lease is
        always in the store before the sample (the store refuses samples of unknown leases)."""
        while self._mirror_batch():
            pass
        return self.store.store.write_samples(samples, set_aside=True)

    def _mirror_batch(self) -> int:
        """One batch of the mirror (worker thread). Writes spool when MySQL is down and set aside what the store
        refuses, so this rarely fails; the backlog left is measured after every batch, failed or not."""
        moved = -1  # failed
        with self._mirror_lock:
            try:
                moved = self._mirror_batch_locked()
            except Exception as exc:
                self.mirror_error = f"{type(exc).__name__}: {exc}"[:300]
                raise
            else:
                self.mirror_error = None
                return moved
            finally:
                with contextlib.suppress(Exception):
                    # an idle batch found nothing unmirrored: no query (the loop runs one every 0.5 s)
                    self.mirror_backlog = (0, None) if moved == 0 else self.journal.backlog()
                    if self.store.store.spool.dead:
                        self.store.store.spool.refresh()  # `hostagent db replay` may have emptied it

    def _note_set_aside(self, op: str, payload: Any, rows: int, error: str) -> None:
        """The store refused a write and it was set aside: journal it (so the dashboard and the store's own event
        log show it), unless the refused write is itself such a note (no loop of notes the store refuses)."""
        events = payload.get("events", [payload]) if isinstance(payload, dict) else []
        if any(isinstance(e, dict) and e.get("kind") == SET_ASIDE_KIND for e in events):
            return
        self.journal.event(SET_ASIDE_KIND, actor="mirror",
                           detail=f"{rows} row(s) of a {op} write set aside (hostagent db rejected): {error}"[:1000])

    def _mirror_batch_locked(self) -> int:
        events = self.journal.unmirrored(200)
        if not events:
            return 0
        host = self.settings.agent.host_id
        # Each lease's document once (it is the current one for all its events), as stored, and all the events:
        # one store transaction for the batch (a lease's 8 transitions once cost sixteen). An event whose lease the
        # journal no longer holds goes in without its lease.
        docs = self.journal.docs(ev.lease_id for ev in events if ev.lease_id)
        rows = [ev.to_dict() | ({} if (ev.lease_id or "") in docs else {"lease_id": None}) for ev in events]
        reclaims = [{"action": ev.kind, "lease_id": ev.lease_id if ev.lease_id in docs else None,
                     "gpu_id": ev.gpu_id, "reason": ev.detail, "ts": ev.ts,
                     "uid": "r" + hashlib.sha256(f"{host}/{ev.seq}".encode()).hexdigest()[:31]}
                    for ev in events if ev.kind in RECLAIM_KINDS]
        # A row the store refuses is set aside (and journaled) and the rest written: nothing after it waits.
        self.store.store.mirror(list(docs.values()), rows, reclaims=reclaims, set_aside=True)
        self.journal.mark_mirrored(ev.seq for ev in events)
        return len(events)

    async def _load_model(self, how: str = START) -> None:
        """Use the store's active placement model, if any (else the cold-start rule decides): services.model_follow,
        which also follows it every placement.model_check_interval_s (scikit-learn is imported only for a model).
        At the start, the retraining then counts the records it grows from (services.retraining)."""
        if not await self.models.check(how) and self.settings.agent.gc_freeze:
            settle_heap()  # the follower settles it after a switch
        if how == START:
            await self.retrainer.start()

    async def _prune(self) -> None:
        st = self.settings.store
        await self.store.prune(st.raw_retention_days * 86400.0, st.minute_retention_days * 86400.0)

    async def prune_journal(self) -> tuple[int, int]:
        """Forget ended leases older than leases.journal_retention_days (only once mirrored, with a store), so the
        journal, and the dashboard's parsed copy of it, stop growing with every lease ever made."""
        before = self.clock() - self.settings.leases.journal_retention_days * 86400.0
        # With a store, only what the mirror has copied goes: a lease with an event still to copy stays.
        leases, events = await self.run(self.journal.prune, before, mirrored_only=self.store is not None)
        if leases or events:
            log.info("journal: forgot %d ended leases and %d events older than %d days", leases, events,
                     self.settings.leases.journal_retention_days)
        return leases, events

    async def stop(self) -> None:
        """Stop jobs, drain samples, close connections."""
        self.started = False
        if self._unsubscribe is not None:  # a stopped agent reacts to no event (its journal is about to close)
            self._unsubscribe()
            self._unsubscribe = None
        if self.reaper is not None:
            await self.reaper.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        tasks, self.tasks = self.tasks, []  # a re-read task leaves the list as it ends: never while it is walked
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.store is not None and self.fleet is not None:
            await self.fleet.stopping()  # others see this host stopped, not just silent
        if self.ingestor is not None:
            with contextlib.suppress(Exception):
                await self.ingestor.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.run(self._mirror_batch)
            with contextlib.suppress(Exception):
                await self.store.close()
        with contextlib.suppress(Exception):
            await self.hypervisor.close()
        self.journal.close()

    async def _periodic(self, every_s: float, fn: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await fn()
            except Exception:
                log.exception("periodic job %s failed", getattr(fn, "__name__", fn))

    def _on_domain_event(self, event: Any) -> None:
        kind = getattr(event, "kind", None)
        kind = getattr(kind, "value", kind)  # EventKind is a str enum; keep plain strings past this point
        if kind == "reconnected":
            self.hypervisor_ok = True
            self._reconnects += 1
            task = asyncio.ensure_future(self._after_reconnect())
            self.tasks.append(task)  # stop() cancels a re-read still retrying
            task.add_done_callback(self._drop_task)
            return
        if kind == "disconnected":
            self.hypervisor_ok = False
            return
        asyncio.ensure_future(self.manager.on_domain_event(kind, event.uuid, getattr(event, "detail", None)))

    def _drop_task(self, task: asyncio.Task[Any]) -> None:
        with contextlib.suppress(ValueError):
            self.tasks.remove(task)

    async def _after_reconnect(self) -> None:
        """libvirtd came back: re-read the domain of every ACTIVE lease, so a stop missed while away ends its lease.

        Only a definite answer counts: NotFound (the domain is gone) or a state. Any other error, the connection
        dropping again mid-read included, says nothing about the guest, which may still be running with the GPU:
        its lease is left as it is (never given back on a guess) and its domain read again after reread_retry_s,
        doubling, until libvirt answers. A newer reconnect re-reads everything itself, so this one then stops.
        """
        generation = self._reconnects
        pending = [x.id for x in self.manager.leases.values() if x.state is LeaseState.ACTIVE]
        delay = self.reread_retry_s
        while True:
            pending = await self._reread_domains(pending)
            if not pending:
                return
            log.warning("domain state of %d lease(s) unknown after the reconnect; leases kept, re-reading in %.1f s",
                        len(pending), delay)
            await asyncio.sleep(delay)
            if self._reconnects != generation:
                return
            delay = min(REREAD_RETRY_MAX_S, delay * 2)

    async def _reread_domains(self, lease_ids: list[str]) -> list[str]:
        """One pass of the re-read (services.reconcile.reread_domains); its repairs join the start-up ones."""
        unread, repairs = await reread_domains(self.manager, self.hypervisor, lease_ids)
        self.repairs.extend(repairs)
        return unread


def settle_heap() -> None:
    """Collect, then move every object alive now out of the collector's reach (gc.freeze): the full collections
    that a churning agent triggers every few seconds then walk only what was made since, about 2 ms instead of
    70-100 ms with scikit-learn, numpy and SQLAlchemy loaded, which the event loop would stall for. Called again
    after each model swap (unfreeze first) so that a replaced model's cycles are still collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _model_switched(manager: LeaseManager, gc_freeze: bool) -> None:
    """After the placer switched models: the queue decides again (a request waiting for a better GPU under the old
    model may not under the new one, and the reverse), and with agent.gc_freeze the heap is settled."""
    manager._wake_queue.set()
    if gc_freeze:
        settle_heap()


def build_runtime(settings: Settings, *, hypervisor: Any = None, clock: Callable[[], float] = time.time) -> Runtime:
    """Construct (but do not start) everything from settings; tests may inject the hypervisor and a clock."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    inventory = discover_host(settings)
    sysfs = open_kernel(settings)
    host = SysfsHost(sysfs, dev_root=settings.dev_root, proc_root=settings.proc_root,
                     step_timeout_s=settings.host.step_timeout_s, inventory=inventory,
                     allow_boot_vga=settings.host.allow_boot_vga, no_reset=settings.host.no_reset)
    hypervisor = hypervisor if hypervisor is not None else open_hypervisor(settings)
    journal = Journal(settings.state_dir / "journal.sqlite3", clock=clock)
    holder: dict[str, LeaseManager] = {}
    pl = settings.placement
    placer = Placer(lambda: list(holder["m"].gpus.values()), quarantined=lambda: holder["m"].quarantined,
                    exploration=Exploration(epsilon=pl.explore_epsilon, max_priority=pl.explore_max_priority),
                    cold_exploration=Exploration(epsilon=pl.cold_explore_epsilon, max_priority=pl.explore_max_priority),
                    default_numa_policy=settings.leases.numa_policy, measured=lambda g: holder["m"].measured.get(g))
    manager = LeaseManager(gpus=inventory.gpus, host=host, hypervisor=hypervisor, journal=journal,
                           policy=lease_policy(settings), clock=clock, place=placer)
    holder["m"] = manager
    manager.scaling, manager.predict_rates, manager.numa_cells = placer.scaling, placer.predict_rates, numa_cells(sysfs)
    manager.relative_rates, manager.typical_run_s = placer.relative_rates, placer.typical_run_s
    manager.left_run_s = placer.left_run_s
    manager.rate_uncertainty, manager.rates_token = placer.rate_uncertainty, placer.rates_token
    manager.doubt = placer.doubt
    tokens = TokenBook(settings.auth.operator_token_sha256, journal.lookup_token)
    rt = Runtime(settings=settings, inventory=inventory, host=host, hypervisor=hypervisor, journal=journal,
                 manager=manager, tokens=tokens, clock=clock, placer=placer)
    rt.models = ModelFollower(placer, lambda: rt.store.store, journal=journal, clock=clock,
                              after_switch=functools.partial(_model_switched, manager, settings.agent.gc_freeze))
    rt.retrainer = Retrainer(pl, lambda: rt.store, load=rt._load_model, in_use=lambda: placer.model_version is not None)
    untrusted = host_signal_untrusted(settings.reclaim, lambda: irq_bypass(settings.host.sysfs_root))
    if untrusted:
        log.info("idle reclaim: vfio interrupt counters are not trusted to show a busy GPU (%s); with no guest "
                 "heartbeats a lease is never judged idle", untrusted)
    rt.reaper = Reaper(manager, reaper_settings(settings.reclaim, untrusted), samples_since=rt.samples_since,
                       read_interrupts=host.vfio_interrupts)
    rt.fleet = publisher_for(rt)
    rt.watcher = OutOfBandWatcher(manager, open_uevents(settings), own=host.own,
                                  rediscover=lambda: discover_host(settings).gpus,
                                  on_change=rt.drivers_changed, clock=clock)
    return rt


def make_app(runtime: Runtime, *, probe_runners: list[Any] | None = None,
             probe_settings: Any = None) -> web.Application:
    """The aiohttp application with the runtime's lifecycle attached. `probe_runners`, `probe_settings`: the probe
    service's runners to choose from and its settings (default: every runner over the host's sysfs, default
    settings); the rest is composed as the agent runs it."""
    from hostagent.web import dashboard, metrics
    from hostagent.web.app import add_api_routes, auth_middleware, error_middleware
    from hostagent.web.keys import RUNTIME, SERVED

    app = web.Application(middlewares=[metrics.metrics_middleware, error_middleware, auth_middleware],
                          client_max_size=runtime.settings.agent.max_body_bytes)
    app[RUNTIME] = runtime
    app[SERVED] = runtime.fleet.served if runtime.fleet is not None else (lambda url: None)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await runtime.start()
        yield
        await runtime.stop()

    app.cleanup_ctx.append(lifecycle)
    add_api_routes(app)
    metrics.install(app, runtime)
    from hostagent.web import topology

    parts = topology.install(app, runtime, scorer=lambda: runtime.placer.scorer, runners=probe_runners,
                             probe_settings=probe_settings)
    runtime.placer.topology_place = parts.placer  # the learned placer picks sets through the topology placer
    dashboard.install(app, runtime)
    return app


def serve(settings: Settings, *, banner: str | None = None,
          on_serving: Callable[[str], Awaitable[None]] | None = None) -> int:
    """Build the agent from settings and serve it until SIGTERM/SIGINT (``hostagent serve``, the demo; the demo's
    guests run as `on_serving(url)`)."""
    from hostagent.web import serve as server

    return server.serve(settings, lambda: make_app(build_runtime(settings)), banner=banner, on_serving=on_serving)


__all__ = ["Runtime", "build_runtime", "lease_view", "make_app", "serve"]
