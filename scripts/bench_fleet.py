#!/usr/bin/env python3
"""Fleet-scale store: many simulated hosts, each with its own UsageStore, write to one MariaDB at once (issue #20).

Every simulated host is what an agent with a store runs, minus libvirt and HTTP: its own ``UsageStore`` (own host
id, own connections, own spool), its GPU and host rows, leases starting and ending (the agent's journal mirror:
``Runtime._mirror_batch`` borrowed from the agent, writing lease documents, lease events and reclaim events with
``UsageStore.mirror``), heartbeat samples through a ``SampleIngestor`` whose writer is the agent's
``Runtime._write_samples`` (mirror first, then ``write_samples(set_aside=True)``; rollups in the store's roller
thread), and the fleet publish (the agent's ``FleetPublisher`` every 15 s). Hosts are spread over ``--procs``
worker processes (one event loop each; every host has its own writer threads, as an agent does).

Phase 1 paces every GPU at 1 sample per second (200 hosts x 8 GPUs = 1600 samples/s): does the fleet keep up, the
write latency of each flush per host, the delay from a sample's instant to its commit, the rollup lag
(``rollup_pending`` per host every few seconds). Phase 2 floods: every host keeps its ingestor a batch ahead of
its writer; samples/s inserted and rolled up in a fixed window, against raw PyMySQL ``executemany`` of the same
rows into an identical table from the same number of writers (one thread and connection per host, in the same
processes), alternating which goes first. Then: every sample stored exactly once per host (counted per host
against what was sent, and in both rollups), every lease and event mirrored; the fleet page over all hosts
(``read_fleet`` + ``fleet_view`` in-process, and GET /ui/fleet of a real agent app on the same database) under
the paced load and after it; server and client CPU, statements and lock waits per phase; deadlocks and timeouts
that made a store spool, and how long its replay took; the server's CPU per row measured alone (inserts, rollup
steps of 8, 1000 and 50,000 rows); a projection to 10,000 hosts from these figures.

With no --db a temporary database is made on 127.0.0.1:3306 and dropped (unless --keep). The run needs about five
connections per host: a server whose max_connections is lower gets it raised for the run (SET GLOBAL) and put back.
The figures so far are written after every phase to bench_fleet_last.json in the temporary directory (/tmp).

    python scripts/bench_fleet.py [--hosts 200] [--gpus 8] [--procs 2] [--paced-s 60] [--flood-s 30] [--json [FILE]]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import math
import multiprocessing as mp
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pymysql

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

from bench_ingest import COLUMNS, database, pymysql_conn  # noqa: E402  (the raw baseline, the temporary database)

from hostagent import __version__  # noqa: E402
from hostagent.bench.agentproc import read_cpu_s  # noqa: E402
from hostagent.bench.machine import header_line  # noqa: E402
from hostagent.bench.stats import percentile  # noqa: E402
from hostagent.domain.errors import Overloaded, TooManyRequests  # noqa: E402
from hostagent.domain.inventory import GpuState  # noqa: E402
from hostagent.domain.lease import Lease, LeaseDevice, LeaseRequest, LeaseState, new_lease  # noqa: E402
from hostagent.store.journal import JournalEvent  # noqa: E402
from hostagent.store.sample_repo import ROLL_AFTER_S  # noqa: E402

S = LeaseState
TASKS = ("training", "inference", "notebook", "batch")
SIZES = ((1, 0.4), (2, 0.3), (4, 0.2), (8, 0.1))  # GPUs per lease, weight
RECLAIMED = 0.1  # the share of leases that end in an idle reclaim (strikes and the reclaim journaled first)
RAW_TABLE = "usage_samples_raw"
RECOVER_NOTE = "the time allowed (--recover-s)"
STATUS = ("Questions", "Com_insert", "Com_insert_select", "Com_update", "Com_select", "Com_commit",
          "Innodb_row_lock_waits", "Innodb_row_lock_time", "Innodb_deadlocks", "Innodb_buffer_pool_reads",
          "Innodb_data_fsyncs", "Innodb_log_waits", "Bytes_received")
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass(frozen=True)
class Plan:
    """What one run does (the command line's figures)."""

    url: str
    hosts: int = 200
    gpus: int = 8
    procs: int = 2
    paced_s: float = 60.0
    flood_s: float = 30.0
    warmup_s: float = 5.0
    repeat: int = 3
    lease_s: float = 30.0
    publish_s: float = 15.0
    batch: int = 1000
    flush_s: float = 1.0
    queue_max: int = 20_000
    lag_every_s: float = 5.0
    page_repeat: int = 30
    seed: int = 20
    flood_sets: tuple[int, ...] = (200, 20)  # writers of each flood (the first hosts), all hosts first
    recover_s: float = 60.0  # how long a phase waits for the stores to replay their spools (outages) after it
    roll_after_s: float | None = None  # what-if: the store's ROLL_AFTER_S / ROLL_EVERY_WRITES, patched in the workers
    roll_every_writes: int | None = None


# -- the agent's journal, in memory ---------------------------------------------------------------------------------
class MemJournal:
    """What the agent's journal mirror reads (``unmirrored``, ``docs``, ``mark_mirrored``, ``backlog``), kept in
    memory: the store is measured here, not each agent's own SQLite journal (on its own machine in a fleet). Events
    are the journal's ``JournalEvent``s and documents its ``Lease.to_dict()`` form, so the store gets what it would."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: collections.deque[JournalEvent] = collections.deque()
        self._docs: dict[str, dict[str, Any]] = {}
        self._seq = 0
        self.events = 0  # journaled, all kinds
        self.reclaim_events = 0

    def _add(self, lease_id: str | None, gpu_id: str | None, kind: str, frm: str | None, to: str | None,
             actor: str, detail: str | None) -> None:
        self._seq += 1
        self._events.append(JournalEvent(self._seq, lease_id, gpu_id, time.time(), kind, frm, to, actor, detail, None))
        self.events += 1

    def record(self, lease: Lease, *, from_state: LeaseState | None, actor: str, detail: str | None = None) -> None:
        """A lease's new document and its transition event (``Journal.record``)."""
        with self._lock:
            self._docs[lease.id] = lease.to_dict()
            self._add(lease.id, ",".join(lease.gpu_ids) or None, "transition",
                      from_state.value if from_state else None, lease.state.value, actor, detail)

    def event(self, kind: str, *, actor: str, lease_id: str | None = None, gpu_id: str | None = None,
              detail: str | None = None) -> None:
        """A non-transition event (``Journal.event``): the reaper's strikes and reclaims here."""
        with self._lock:
            self._add(lease_id, gpu_id, kind, None, None, actor, detail)
            self.reclaim_events += 1

    def unmirrored(self, limit: int = 500) -> list[JournalEvent]:
        with self._lock:
            return [self._events[i] for i in range(min(limit, len(self._events)))]

    def docs(self, lease_ids: Any) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {x: self._docs[x] for x in dict.fromkeys(lease_ids) if x in self._docs}

    def mark_mirrored(self, seqs: Any) -> None:
        done = set(seqs)
        with self._lock:
            while self._events and self._events[0].seq in done:
                ev = self._events.popleft()
                doc = self._docs.get(ev.lease_id or "")
                if doc is not None and doc["state"] == S.RELEASED.value and ev.to_state == S.RELEASED.value:
                    del self._docs[ev.lease_id]  # an ended lease's last event is in the store: forget it

    def backlog(self) -> tuple[int, float | None]:
        with self._lock:
            return len(self._events), (self._events[0].ts if self._events else None)


def agent_shim_class() -> type:
    """A class whose sample writer and journal mirror ARE the agent's (``Runtime``'s methods, borrowed), over one
    simulated host's store and journal."""
    from hostagent.runtime import Runtime

    class AgentShim:
        _write_samples = Runtime._write_samples
        _mirror_batch = Runtime._mirror_batch
        _mirror_batch_locked = Runtime._mirror_batch_locked

        def __init__(self, store: Any, journal: MemJournal, host_id: str) -> None:
            self.store = store  # the AsyncUsageStore facade, as on the runtime (.store is the UsageStore)
            self.journal = journal
            self.settings = SimpleNamespace(agent=SimpleNamespace(host_id=host_id))
            self._mirror_lock = threading.Lock()
            self.mirror_backlog: tuple[int, float | None] = (0, None)
            self.mirror_error: str | None = None

    return AgentShim


class SimManager:
    """The lease manager as the fleet publisher reads it: GPUs, their holders, the queue (empty)."""

    def __init__(self, gpus: list[str]) -> None:
        self.gpus = dict.fromkeys(gpus)
        self.holder: dict[str, str] = {}
        self.leases: dict[str, Lease] = {}

    def gpu_state(self, gid: str) -> GpuState:
        return GpuState.LEASED if gid in self.holder else GpuState.FREE

    def lease_of(self, gid: str) -> Lease | None:
        lid = self.holder.get(gid)
        return self.leases.get(lid) if lid else None

    def queue(self) -> list[Any]:
        return []


# -- one simulated host --------------------------------------------------------------------------------------------
class SimHost:
    """One agent's store traffic: its UsageStore, ingestor, journal mirror, fleet publisher and guests' leases."""

    def __init__(self, index: int, plan: Plan, tmp: Path) -> None:
        self.plan = plan
        self.index = index
        self.host_id = f"fleet-{index:04d}"
        self.gpus = [f"gpu-{j}" for j in range(plan.gpus)]
        self.rng = random.Random(plan.seed * 100_003 + index)
        self.tmp = tmp
        self.journal = MemJournal()
        self.manager = SimManager(self.gpus)
        self.end_at: dict[str, float] = {}
        self.profile: dict[str, tuple[float, int]] = {}  # lease -> (mean util, memory in use)
        self.recent: dict[str, collections.deque[dict[str, Any]]] = {}
        self.offset = self.rng.random()  # where in each second this host's guests heartbeat
        self.flood_ts = 0  # seconds past the flood's base instant (every GPU one sample per instant)
        self.raw_ts = 0
        self.sent = 0
        self.leases_started = 0
        self.lat: list[float] = []
        self.delay: list[float] = []
        self.track_delay = False
        self.open_s = 0.0
        self.store: Any = None

    # setup (a worker thread) and start (the loop)
    def open(self) -> None:
        from hostagent.store.repo import UsageStore

        t0 = time.perf_counter()
        self.store = UsageStore(self.plan.url, self.host_id, spool_path=self.tmp / f"{self.host_id}.spool.sqlite3",
                                hostname=f"{self.host_id}.bench", agent_version=__version__)
        self.store.upsert_gpus([{"gpu_id": g, "address": f"0000:{16 + j:02x}:00.0", "vendor": "nvidia",
                                 "model": "H100 80GB HBM3", "memory_bytes": 80 << 30,
                                 "numa_node": j * 2 // len(self.gpus),
                                 "iommu_group": 16 + j} for j, g in enumerate(self.gpus)])
        self.open_s = time.perf_counter() - t0
        self._time_store_parts()

    def _time_store_parts(self) -> None:
        """Time two parts of the store's work on this instance (the code is the store's, only wrapped): the sample
        INSERT statement (``_apply_samples``, inside the writer's transaction) and the roller's steps."""
        store = self.store
        self.insert_s: list[float] = []
        self.steps: list[tuple[float, int]] = []
        self.cpu = {"writer": 0.0, "roller": 0.0}  # client CPU (this thread's) in the ingestor's writes, the steps
        apply_samples, roll_steps = store._apply_samples, store._roll_up_steps

        def timed_apply(conn: Any, rows: Any) -> int:
            t0 = time.perf_counter()
            try:
                return int(apply_samples(conn, rows))
            finally:
                self.insert_s.append(time.perf_counter() - t0)

        def timed_steps() -> int | None:
            t0, c0 = time.perf_counter(), time.thread_time()
            n = roll_steps()
            self.cpu["roller"] += time.thread_time() - c0
            if n:
                self.steps.append((time.perf_counter() - t0, n))
            return n

        store._apply_samples = timed_apply
        store._roll_up_steps = timed_steps

    async def start(self, shim_cls: type) -> None:
        from hostagent.services.fleet import FleetPublisher
        from hostagent.store.aio import AsyncUsageStore
        from hostagent.store.ingest import SampleIngestor

        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=self.host_id)
        self.astore = AsyncUsageStore(self.store)
        self.astore.start()
        self.shim = shim_cls(self.astore, self.journal, self.host_id)
        self.ingestor = SampleIngestor(self._write, max_queue=self.plan.queue_max, batch=self.plan.batch,
                                       interval_s=self.plan.flush_s, executor=self.executor, tenant_share=0.25)
        self.ingestor.start()
        self.publisher = FleetPublisher(
            self.manager, interval_s=self.plan.publish_s,
            write=lambda info, states: self.astore.publish_fleet(info, states, agent_version=__version__),
            degraded=lambda: self.astore.degraded, url=lambda: f"http://{self.host_id}.bench.invalid:8470",
            model=lambda: (None, "cold-start"), samples=lambda: self.recent, reaper=None, clock=time.time,
            util_window_s=60.0, version=__version__)
        self.churn(time.time())
        self.tasks = [asyncio.create_task(self._mirror_loop()), asyncio.create_task(self._publish_loop())]

    async def _mirror_loop(self) -> None:
        """The agent's ``_mirror_loop``: a batch every 0.5 s, at once again while there is more."""
        loop = asyncio.get_running_loop()
        while True:
            moved = await loop.run_in_executor(self.executor, self.shim._mirror_batch)
            await asyncio.sleep(0.05 if moved else 0.5)

    async def _publish_loop(self) -> None:
        await asyncio.sleep(self.rng.uniform(0, self.plan.publish_s))  # agents do not start in step
        await self.publisher.run()

    def _write(self, samples: list[Any]) -> Any:
        """The ingestor's writer: the agent's own (mirror, then the samples), timed."""
        t0, c0 = time.perf_counter(), time.thread_time()
        n = self.shim._write_samples(samples)
        self.cpu["writer"] += time.thread_time() - c0
        if samples:
            self.lat.append(time.perf_counter() - t0)
            if self.track_delay:
                self.delay.append(time.time() - min(s.ts_ms for s in samples) / 1000.0)
        return n

    # guests: leases and their heartbeats
    def churn(self, now: float) -> None:
        """End the leases past their end (one in ten reclaimed as idle), lease every free GPU again."""
        for lid in [x for x, end in self.end_at.items() if end <= now]:
            self._end(self.manager.leases[lid], now)
        free = [g for g in self.gpus if g not in self.manager.holder]
        while free:
            fits = [(n, w) for n, w in SIZES if n <= len(free)]
            n = self.rng.choices([x for x, _ in fits], [w for _, w in fits])[0]
            self._start(free[:n], now)
            free = free[n:]

    def _start(self, gpus: list[str], now: float) -> None:
        self.leases_started += 1
        lid = f"l-{uuid.uuid4().hex[:16]}"
        vm = self.rng.randrange(64)
        req = LeaseRequest(gpus=len(gpus), task_type=self.rng.choice(TASKS), priority=self.rng.randint(0, 9),
                           accept_deferred=True)
        lease = new_lease(lid, f"{self.host_id}-vm-{vm:02d}", f"vm-{vm:02d}", req, now)
        self.journal.record(lease, from_state=None, actor="guest")
        devices = tuple(LeaseDevice(g, (f"0000:{16 + self.gpus.index(g):02x}:00.0",), ("nvidia",),
                                    16 + self.gpus.index(g)) for g in gpus)
        for target, changes in ((S.BINDING, {"devices": devices, "granted_gpus": len(gpus),
                                             "reasons": ("bench", f"chose {','.join(gpus)}")}),
                                (S.ATTACHING, {}), (S.ACTIVE, {"granted_at": now, "expires_at": now + 86400})):
            prev = lease.state
            lease = lease.transition(target, **changes)
            self.journal.record(lease, from_state=prev, actor="agent")
        self.manager.leases[lid] = lease
        for g in gpus:
            self.manager.holder[g] = lid
        self.end_at[lid] = now + max(2.0, self.rng.expovariate(1.0 / self.plan.lease_s))
        self.profile[lid] = (self.rng.uniform(2, 98), self.rng.randrange(1, 80) << 30)
        self.recent[lid] = collections.deque(maxlen=512)  # the agent keeps 4096: memory, with 100 hosts a process

    def _end(self, lease: Lease, now: float) -> None:
        reclaimed = self.rng.random() < RECLAIMED
        gpus = ",".join(lease.gpu_ids)
        if reclaimed:
            for kind in ("strike-one", "strike-two", "reclaim"):
                self.journal.event(kind, actor="reaper", lease_id=lease.id, gpu_id=gpus, detail="idle (bench)")
        reason = "reclaimed: idle" if reclaimed else "released by guest"
        for target, changes in ((S.RELEASING, {"end_reason": reason}), (S.DETACHING, {}), (S.REBINDING, {}),
                                (S.RELEASED, {"ended_at": now})):
            prev = lease.state
            lease = lease.transition(target, **changes)
            self.journal.record(lease, from_state=prev, actor="reaper" if reclaimed else "guest")
        del self.manager.leases[lease.id], self.end_at[lease.id], self.profile[lease.id], self.recent[lease.id]
        for g in lease.gpu_ids:
            del self.manager.holder[g]

    def heartbeat(self, instants: list[float]) -> int:
        """Each lease's guest sends one heartbeat with a sample per GPU per instant, as ``accept_samples`` queues
        it; returns samples accepted (Overloaded / TooManyRequests propagate: the guest retries later)."""
        n = 0
        for lid, lease in list(self.manager.leases.items()):
            util, mem = self.profile[lid]
            gpus = lease.gpu_ids  # (a property that builds its tuple: once per lease, not per sample)
            samples = []
            for k, ts in enumerate(instants):
                u = min(100.0, max(0.0, util + 10.0 * math.sin(ts / 7.0 + k)))
                for g in gpus:
                    samples.append({"gpu_id": g, "ts": ts, "util_pct": u, "mem_used_bytes": mem,
                                    "work_rate": u * 3.0, "vfio_irq_rate": 300.0 + u, "source": "guest"})
            k = self.ingestor.submit(samples, lease_id=lid, tenant=lease.domain_uuid)
            self.sent += k  # counted as accepted: a refusal below leaves these in
            n += k
            self.recent[lid].extend(samples[-len(gpus):])
        return n

    async def close(self) -> dict[str, Any]:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.ingestor.close()
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(self.executor, self.shim._mirror_batch):
            pass
        fig = self.ingestor.figures()
        await self.astore.close()
        self.executor.shutdown(wait=True)
        return {"host": self.host_id, "sent": self.sent, "raw_sent": 0, "leases": self.leases_started,
                "events": self.journal.events, "reclaim_events": self.journal.reclaim_events,
                "unmirrored": self.journal.backlog()[0], "published": self.publisher.published,
                "ingestor": fig, "store": dict(self.store.figures), "spool_depth": self.store.spool_depth}


# -- a worker process: some of the hosts, one event loop -------------------------------------------------------------
class OutageLog(logging.Handler):
    """Counts the store's "unreachable, spooling" warnings by the statement that failed and its error number,
    instead of printing thousands of them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "spooling writes" not in text:
            if record.levelno >= logging.ERROR:
                self.counts[text.split("\n", 1)[0][:200]] += 1
            return
        code = re.search(r"\((\d{4}), '", text)
        sql = re.search(r"\[SQL: (\w+(?: IGNORE)? (?:INTO )?\w+|\w+ \w+)", text)
        self.counts[f"{code.group(1) if code else '?'} on {sql.group(1) if sql else '?'}"] += 1


OUTAGES = OutageLog()


def worker_main(conn: Any, wid: int, indexes: list[int], plan: Plan, tmp: str) -> None:
    """Entry of a worker process: answer the coordinator's commands, one at a time, until 'exit'."""
    log = logging.getLogger("hostagent")
    log.addHandler(OUTAGES)
    log.propagate = False
    log.setLevel(logging.WARNING)
    from hostagent.store import sample_repo

    if plan.roll_after_s is not None:
        sample_repo.ROLL_AFTER_S = plan.roll_after_s  # type: ignore[misc]
    if plan.roll_every_writes is not None:
        sample_repo.ROLL_EVERY_WRITES = plan.roll_every_writes  # type: ignore[misc]
    try:
        asyncio.run(Worker(conn, wid, indexes, plan, Path(tmp)).serve())
    except BaseException as exc:  # the coordinator shows it and stops
        import traceback
        conn.send({"error": f"worker {wid}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"})
        raise


class Worker:
    def __init__(self, conn: Any, wid: int, indexes: list[int], plan: Plan, tmp: Path) -> None:
        self.conn, self.wid, self.plan, self.tmp = conn, wid, plan, tmp
        self.hosts = [SimHost(i, plan, tmp) for i in indexes]

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=32))
        while True:
            cmd, args = await loop.run_in_executor(None, self.conn.recv)
            if cmd == "exit":
                self.conn.send({"ok": True})
                return
            cpu0, loop0 = time.process_time(), time.thread_time()
            for h in self.hosts:
                h.cpu = dict.fromkeys(h.cpu, 0.0) if hasattr(h, "cpu") else {}
            out = await getattr(self, f"cmd_{cmd}")(**args)
            out["cpu_s"] = time.process_time() - cpu0
            out["cpu_parts"] = {"event loop": time.thread_time() - loop0,
                                "sample writes + mirror": sum(h.cpu.get("writer", 0.0) for h in self.hosts),
                                "roller": sum(h.cpu.get("roller", 0.0) for h in self.hosts)}
            self.conn.send(out)

    async def cmd_open(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, h.open) for h in self.hosts))
        shim = agent_shim_class()
        for h in self.hosts:
            await h.start(shim)
        from hostagent.runtime import settle_heap

        settle_heap()  # as an agent does after its start: full collections then skip the heap of SQLAlchemy & co
        return {"open_s": [h.open_s for h in self.hosts]}

    async def _lag_monitor(self, t0: float, out: list[tuple[float, str, int]],
                           every: float | None = None) -> None:
        """Every lag_every_s: each host's ``rollup_pending()`` (stored samples not yet in its rollups)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every or self.plan.lag_every_s)
            now = time.time() - t0
            # on the process's own pool, not the hosts' writer threads: a check must not queue behind the writes
            counts = await asyncio.gather(*(loop.run_in_executor(None, h.store.rollup_pending) for h in self.hosts))
            out.extend((now, h.host_id, n) for h, n in zip(self.hosts, counts))

    async def _drain(self) -> float:
        """Every host's queue written and its rollups settled (the ingestor's flush); seconds."""
        t0 = time.perf_counter()
        await asyncio.gather(*(h.ingestor.flush() for h in self.hosts))
        return time.perf_counter() - t0

    async def _recover(self, limit_s: float) -> dict[str, Any]:
        """After a phase: wait (at most limit_s) until no host is degraded and every spool is replayed by the
        stores' own replay loops, as in the agent. Hosts still degraded then are replayed one at a time (the next
        phase must not run into this one's backlog). Then every host's rollups settled."""
        t0 = time.perf_counter()
        while any(h.store.degraded for h in self.hosts) and time.perf_counter() - t0 < limit_s:
            await asyncio.sleep(0.5)
        natural = time.perf_counter() - t0
        stuck = [h for h in self.hosts if h.store.degraded]
        left = sum(h.store.spool_depth for h in stuck)
        # Their replay loops stop meanwhile: every stuck host replaying at once is what keeps them stuck.
        for h in stuck:
            if h.astore._task is not None:
                h.astore._task.cancel()
                await asyncio.gather(h.astore._task, return_exceptions=True)
                h.astore._task = None
        for h in stuck:
            while h.store.degraded and time.perf_counter() - t0 < limit_s + 1800:
                if not await asyncio.to_thread(h.store.replay_spool, 1000):
                    await asyncio.sleep(0.5)
        for h in stuck:
            h.astore.start()
        await self._drain()
        return {"recover_s": natural if not stuck else None, "spool_left": left, "degraded_hosts": len(stuck),
                "one_by_one_s": time.perf_counter() - t0 - natural if stuck else 0.0}

    def _figs(self) -> tuple[dict[str, int], collections.Counter[str]]:
        keys = ("outages", "ops_spooled", "ops_replayed", "samples_duplicate")
        return {k: sum(h.store.figures[k] for h in self.hosts) for k in keys}, collections.Counter(OUTAGES.counts)

    def _since(self, mark: tuple[dict[str, int], collections.Counter[str]]) -> dict[str, Any]:
        now, log = self._figs()
        return {"store": {k: now[k] - mark[0][k] for k in now}, "log": dict(log - mark[1])}

    def _reset(self, delay: bool) -> None:
        for h in self.hosts:
            h.lat, h.delay, h.track_delay = [], [], delay
            h.insert_s.clear()
            h.steps.clear()

    def _parts(self) -> dict[str, Any]:
        return {"insert_s": [x for h in self.hosts for x in h.insert_s],
                "steps": [x for h in self.hosts for x in h.steps]}

    async def cmd_paced(self, t0: float, duration: float) -> dict[str, Any]:
        """1 sample per GPU per second: each host's guests heartbeat at its own offset in the second."""
        self._reset(True)
        end = t0 + duration
        lags: list[tuple[float, str, int]] = []
        late: list[float] = []
        depth_max = [0]
        refused = [0]

        async def run(h: SimHost) -> None:
            nxt = t0 + h.offset
            while nxt < end:
                await asyncio.sleep(max(0.0, nxt - time.time()))
                now = time.time()
                late.append(now - nxt)
                h.churn(now)
                try:
                    h.heartbeat([round(nxt, 3)])
                except (Overloaded, TooManyRequests):
                    refused[0] += 1
                depth_max[0] = max(depth_max[0], h.ingestor.depth)
                nxt += 1.0

        sent0 = sum(h.sent for h in self.hosts)
        mark = self._figs()
        await asyncio.sleep(max(0.0, t0 - time.time()))
        mon = asyncio.create_task(self._lag_monitor(t0, lags))
        await asyncio.gather(*(run(h) for h in self.hosts))
        mon.cancel()
        drain = await self._drain()
        rec = await self._recover(self.plan.recover_s)
        return {"sent": sum(h.sent for h in self.hosts) - sent0, "late": late, "refused": refused[0],
                "recover": rec, "trouble": self._since(mark),
                "depth_max": depth_max[0], "drain_s": drain, "lags": lags,
                "lat": {h.host_id: h.lat for h in self.hosts}, "delay": [d for h in self.hosts for d in h.delay],
                **self._parts()}

    async def cmd_flood(self, t0: float, warmup: float, duration: float, base: float, active: int) -> dict[str, Any]:
        """As fast as the store takes them: every host (of the first ``active``) keeps its ingestor a batch ahead
        of its writer."""
        self._reset(False)
        hosts = [h for h in self.hosts if h.index < active]
        end = t0 + duration
        batch = self.plan.batch
        per_beat = max(1, 200 // self.plan.gpus)  # instants per heartbeat (a guest that batches its samples)
        lags: list[tuple[float, str, int]] = []
        marks: dict[str, list[tuple[int, int]]] = {}

        async def run(h: SimHost) -> None:
            while time.time() < end:
                if h.ingestor.depth >= 2 * batch:
                    # a batch ahead already: look again a tenth of a write later (a fixed 5 ms poll woke each
                    # guest ~70 times a write, client CPU that the raw writers, blocked in their driver, never pay)
                    await asyncio.sleep(min(0.05, max(0.002, 0.1 * (h.lat[-1] if h.lat else 0.05))))
                    continue
                h.churn(time.time())
                instants = [base + h.flood_ts + k for k in range(per_beat)]
                h.flood_ts += per_beat  # refused or not: an instant is offered once (no duplicate to count)
                try:
                    h.heartbeat(instants)
                except (Overloaded, TooManyRequests):
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0)

        async def mark(at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.time()))
            for h in hosts:
                marks.setdefault(h.host_id, []).append((h.store.figures["samples_inserted"],
                                                        h.store.figures["samples_rolled_up"]))

        sent0 = sum(h.sent for h in self.hosts)
        fig0 = self._figs()
        writes0 = [(h.ingestor.flushed, h.ingestor.batches) for h in hosts]
        await asyncio.sleep(max(0.0, t0 - time.time()))
        mon = asyncio.create_task(self._lag_monitor(t0, lags, max(10.0, self.plan.lag_every_s)))
        await asyncio.gather(*(run(h) for h in hosts), mark(t0 + warmup), mark(end))
        mon.cancel()
        # samples per write while flooding: a batch each (the store never waited for its guests) or fewer
        writes = [(h.ingestor.flushed - f, h.ingestor.batches - b) for h, (f, b) in zip(hosts, writes0)]
        pending_end = sum(n for _, _, n in lags[-len(self.hosts):]) if lags else 0
        drain = await self._drain()
        rec = await self._recover(self.plan.recover_s)
        ins = sum(m[1][0] - m[0][0] for m in marks.values())
        rolled = sum(m[1][1] - m[0][1] for m in marks.values())
        return {"sent": sum(h.sent for h in self.hosts) - sent0, "inserted_window": ins, "rolled_window": rolled,
                "recover": rec, "trouble": self._since(fig0),
                "writes": [sum(n for n, _ in writes), sum(w for _, w in writes)],
                "drain_s": drain, "lags": lags, "pending_end": pending_end,
                "lat": {h.host_id: h.lat for h in self.hosts}, **self._parts()}

    async def cmd_raw(self, t0: float, warmup: float, duration: float, base: float, active: int) -> dict[str, Any]:
        """The baseline: per host (of the first ``active``) one thread and one PyMySQL connection, executemany +
        commit per batch of the same rows (the host's GPUs and current leases, 1 s apart), into an identical
        table."""
        hosts = [h for h in self.hosts if h.index < active]
        sql = (f"INSERT INTO {RAW_TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))})")
        end = t0 + duration
        batch = self.plan.batch
        commits: list[list[tuple[float, int]]] = [[] for _ in hosts]
        errors: list[str] = []

        def run(i: int, h: SimHost) -> None:
            try:
                conn = pymysql_conn(self.plan.url)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{h.host_id}: {exc}")
                return
            holders = [(g, h.manager.holder.get(g, "")) for g in h.gpus]
            try:
                with conn.cursor() as cur:
                    while time.time() < t0:
                        time.sleep(0.001)
                    while time.time() < end:
                        rows = []
                        while len(rows) < batch:
                            ts = base + h.raw_ts
                            h.raw_ts += 1
                            for g, lid in holders:
                                util, mem = h.profile.get(lid, (50.0, 1 << 30))
                                u = min(100.0, max(0.0, util + 10.0 * math.sin(ts / 7.0)))
                                rows.append((h.host_id, g, int(ts * 1000), lid, "guest", u, mem, u * 3.0, 300.0 + u))
                        cur.executemany(sql, rows)
                        conn.commit()
                        commits[i].append((time.time(), len(rows)))
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{h.host_id}: {type(exc).__name__}: {exc}")
            finally:
                conn.close()

        threads = [threading.Thread(target=run, args=(i, h), daemon=True) for i, h in enumerate(hosts)]
        for t in threads:
            t.start()
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        lo, hi = t0 + warmup, end
        window = sum(n for c in commits for (ts, n) in c if lo < ts <= hi)
        total = sum(n for c in commits for _, n in c)
        last = max((ts for c in commits for ts, _ in c), default=end)
        for h, c in zip(hosts, commits):
            h.raw_sent = getattr(h, "raw_sent", 0) + sum(n for _, n in c)
        lat = {h.host_id: [b - a for (a, _), (b, _) in zip(c, c[1:])] for h, c in zip(hosts, commits)}
        return {"inserted_window": window, "sent": total, "drain_s": max(0.0, last - end), "errors": errors,
                "lat": lat}

    async def cmd_close(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        left = sum(h.store.spool_depth for h in self.hosts)
        if left:
            # the stores' replay loops did not get through (see the phases' recovery): replay host by host, one
            # at a time, so that what the spools hold is in the store before it is counted
            for h in self.hosts:
                if h.astore._task is not None:
                    h.astore._task.cancel()
            for h in self.hosts:
                while h.store.spool_depth and time.perf_counter() - t0 < 1800:
                    if not await asyncio.to_thread(h.store.replay_spool, 1000):
                        await asyncio.sleep(0.2)
        sequential = {"spooled_before": left, "took_s": time.perf_counter() - t0}
        figs = []
        for h in self.hosts:
            f = await h.close()
            f["raw_sent"] = getattr(h, "raw_sent", 0)
            figs.append(f)
        return {"hosts": figs, "outage_log": dict(OUTAGES.counts), "sequential_replay": sequential}


# -- the coordinator -----------------------------------------------------------------------------------------------
class Server:
    """The MariaDB server seen from outside: its process's CPU, global status counters, max_connections."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = pymysql_conn(url)
        self.conn.autocommit(True)
        self.watch_conn = pymysql_conn(url)  # Threads_running, from a thread beside the loop's queries
        self.watch_conn.autocommit(True)
        self.pid = self._pid()
        self.threads_running: list[int] = []

    def _pid(self) -> int | None:
        with self.conn.cursor() as cur:
            cur.execute("SELECT @@pid_file")
            (path,) = cur.fetchone()
        try:
            return int(Path(path).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            for p in Path("/proc").iterdir():
                if p.name.isdigit() and (p / "comm").exists() and (p / "comm").read_text().strip() in (
                        "mariadbd", "mysqld"):
                    return int(p.name)
        return None

    def query(self, sql: str, conn: Any = None) -> list[tuple[Any, ...]]:
        with (conn or self.conn).cursor() as cur:
            cur.execute(sql)
            return list(cur.fetchall())

    def snapshot(self) -> dict[str, Any]:
        st = dict(self.query("SHOW GLOBAL STATUS WHERE Variable_name IN (%s)" % ",".join(f"'{s}'" for s in STATUS)))
        return {"t": time.perf_counter(), "server_cpu": read_cpu_s(self.pid) if self.pid else None,
                "machine": machine_jiffies(), "status": {k: int(v) for k, v in st.items()}}

    def variable(self, name: str) -> str:
        return str(self.query(f"SELECT @@GLOBAL.{name}")[0][0])

    async def watch_threads(self, stop: asyncio.Event) -> None:
        """Threads_running once a second (statements executing at once on the server)."""
        while not stop.is_set():
            try:
                rows = await asyncio.to_thread(self.query, "SHOW GLOBAL STATUS LIKE 'Threads_running'",
                                              self.watch_conn)
                self.threads_running.append(int(rows[0][1]))
            except Exception:  # noqa: BLE001
                pass
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return sum(parts) - idle, sum(parts)


def delta(a: dict[str, Any], b: dict[str, Any], client_cpu: float) -> dict[str, Any]:
    """What a phase cost: wall, server CPU, clients' CPU, the machine's busy share, status counter deltas."""
    wall = b["t"] - a["t"]
    busy = (b["machine"][0] - a["machine"][0]) / max(1, b["machine"][1] - a["machine"][1])
    srv = (b["server_cpu"] - a["server_cpu"]) if a["server_cpu"] is not None and b["server_cpu"] is not None else None
    return {"wall_s": wall, "server_cpu_s": srv, "client_cpu_s": client_cpu, "machine_busy": busy,
            "status": {k: b["status"].get(k, 0) - a["status"].get(k, 0) for k in STATUS}}


class Coordinator:
    def __init__(self, plan: Plan, tmp: Path) -> None:
        self.plan = plan
        self.tmp = tmp
        ctx = mp.get_context("spawn")
        self.pipes = []
        self.procs = []
        for w in range(plan.procs):
            idx = list(range(w, plan.hosts, plan.procs))
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, w, idx, plan, str(tmp)), daemon=True)
            p.start()
            self.pipes.append(parent)
            self.procs.append(p)

    async def all(self, cmd: str, timeout: float = 3600.0, **args: Any) -> list[dict[str, Any]]:
        """Send a command to every worker; their answers (RuntimeError when one failed or none came in time)."""
        for p in self.pipes:
            p.send((cmd, args))
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(p.recv) for p in self.pipes)), timeout)
        except TimeoutError:
            raise RuntimeError(f"the workers did not finish '{cmd}' within {timeout:.0f} s") from None
        for o in outs:
            if "error" in o:
                raise RuntimeError(o["error"])
        return list(outs)

    def stop(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# -- the fleet page ------------------------------------------------------------------------------------------------
class Viewer:
    """A real agent (demo host, simulated hardware) on the fleet's database, serving its app on loopback."""

    def __init__(self, url: str, state: Path) -> None:
        self.url, self.state = url, state

    async def start(self) -> None:
        from aiohttp import ClientSession, CookieJar
        from aiohttp.test_utils import TestServer

        from hostagent.demo import prepare_demo
        from hostagent.runtime import build_runtime, make_app

        settings, creds = prepare_demo(self.state, db=self.url, host_id="bench-viewer")
        self.rt = build_runtime(settings)
        self.server = TestServer(make_app(self.rt), host="127.0.0.1")
        await self.server.start_server()
        self.base = str(self.server.make_url("")).rstrip("/")
        self.http = ClientSession(cookie_jar=CookieJar(unsafe=True))
        text = await (await self.http.get(self.base + "/ui/login")).text()
        csrf = CSRF.search(text).group(1)  # type: ignore[union-attr]
        r = await self.http.post(self.base + "/ui/login", data={"token": creds["operator"]["token"], "csrf": csrf},
                                 allow_redirects=False)
        assert r.status == 303, r.status

    async def time_once(self) -> dict[str, float]:
        """One read_fleet + fleet_view in-process, one GET /ui/fleet and one GET /ui/api/fleet; seconds each."""
        from hostagent.services.fleet import read_fleet

        t0 = time.perf_counter()
        view = await read_fleet(self.rt.store, now=time.time(), this_host=self.rt.settings.agent.host_id,
                                interval_s=self.rt.settings.store.fleet_publish_interval_s)
        t1 = time.perf_counter()
        r = await self.http.get(self.base + "/ui/fleet")
        page = await r.text()
        t2 = time.perf_counter()
        assert r.status == 200, (r.status, page[:300])
        r = await self.http.get(self.base + "/ui/api/fleet")
        await r.read()
        t3 = time.perf_counter()
        self.hosts_seen = (view["totals"]["hosts"], page.count("<tr data-host="))
        return {"read_fleet": t1 - t0, "GET /ui/fleet": t2 - t1, "GET /ui/api/fleet": t3 - t2}

    async def measure(self, repeat: int, until: float | None = None) -> dict[str, list[float]]:
        await self.time_once()  # warm
        out: dict[str, list[float]] = {}
        for _ in range(repeat):
            if until is not None and time.time() >= until:
                break
            for k, v in (await self.time_once()).items():
                out.setdefault(k, []).append(v)
            if until is not None:
                await asyncio.sleep(0.2)
        return out

    async def stop(self) -> None:
        await self.http.close()
        await self.server.close()


# -- figures -------------------------------------------------------------------------------------------------------
def pcts(xs: list[float], scale: float = 1000.0) -> dict[str, float]:
    return {"n": len(xs), "p50": percentile(xs, 50) * scale, "p95": percentile(xs, 95) * scale,
            "p99": percentile(xs, 99) * scale, "max": (max(xs) if xs else math.nan) * scale}


def merge(outs: list[dict[str, Any]], key: str) -> Any:
    first = outs[0][key]
    if isinstance(first, dict):
        return {k: v for o in outs for k, v in o[key].items()}
    if isinstance(first, list):
        return [x for o in outs for x in o[key]]
    return sum(o[key] for o in outs)


def overloaded(store: dict[str, Any], raw: dict[str, Any]) -> bool:
    """Past the server's knee: statements outlived the store's 30 s I/O timeout (the store saw the connection
    lost and spooled), a store needed its spool replayed host by host, or a write took over 30 s on either path."""
    t = store["trouble"]
    return (any(k.startswith(("2013", "1205")) for k in t["log"]) or t["recover_s"] is None
            or max(store["write"]["p99"], raw["write"]["p99"]) > 30_000)


def trouble(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """Outages (deadlocks and timeouts read as outages by the store), spooled and replayed writes, and the recovery
    after a phase, over every worker."""
    recs = [o["recover"] for o in outs]
    log: collections.Counter[str] = collections.Counter()
    store: collections.Counter[str] = collections.Counter()
    for o in outs:
        log.update(o["trouble"]["log"])
        store.update(o["trouble"]["store"])
    return {"recover_s": None if any(r["recover_s"] is None for r in recs) else max(r["recover_s"] for r in recs),
            "one_by_one_s": max(r["one_by_one_s"] for r in recs),
            "spool_left": sum(r["spool_left"] for r in recs), "degraded_hosts": sum(r["degraded_hosts"] for r in recs),
            "store": dict(store), "log": dict(log.most_common())}


def trouble_lines(t: dict[str, Any], indent: str) -> list[str]:
    st = t["store"]
    if not st.get("outages") and not st.get("ops_spooled") and not t["spool_left"]:
        return [f"{indent}store outages: none (no deadlock or timeout made a store spool)"]
    rec = (f"all replayed {t['recover_s']:.1f} s after the phase" if t["recover_s"] is not None else
           f"NOT recovered by the stores' own replays in {RECOVER_NOTE}: {t['degraded_hosts']} hosts still degraded, "
           f"{t['spool_left']} writes in spools, then replayed one host at a time")
    if t["recover_s"] is None:
        rec += f" ({t['one_by_one_s']:.0f} s)"
    out = [f"{indent}store outages: {st.get('outages', 0)} (writes spooled {st.get('ops_spooled', 0)}, replayed "
           f"{st.get('ops_replayed', 0)}, samples skipped as already stored {st.get('samples_duplicate', 0)}); {rec}"]
    out += [f"{indent}  {n:>6} x {what}" for what, n in list(t["log"].items())[:5]]
    return out


def cpu_parts(outs: list[dict[str, Any]]) -> dict[str, float]:
    """The clients' CPU seconds by where they went (the rest: other threads, publishes, lag checks, the kernel)."""
    total = sum(o["cpu_s"] for o in outs)
    out = {k: sum(o["cpu_parts"][k] for o in outs) for k in outs[0]["cpu_parts"]}
    out["other"] = max(0.0, total - sum(out.values()))
    return out


def parts(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The sample INSERT statements' time and the roller's steps (time, rows) of a phase."""
    steps = merge(outs, "steps")
    return {"insert": pcts(merge(outs, "insert_s")), "step": pcts([t for t, _ in steps]),
            "step_rows": statistics.mean([n for _, n in steps]) if steps else 0.0,
            "step_s_total": sum(t for t, _ in steps), "insert_s_total": sum(merge(outs, "insert_s"))}


def lag_figures(lags: list[tuple[float, str, int]], rate_per_host: float) -> dict[str, Any]:
    pend = [n for _, _, n in lags]
    by_check: dict[float, int] = collections.defaultdict(int)
    for t, _, n in lags:
        by_check[round(t)] += n
    return {"checks": len(by_check), "host_p50": percentile(pend, 50), "host_p95": percentile(pend, 95),
            "host_max": max(pend) if pend else 0, "fleet_max": max(by_check.values()) if by_check else 0,
            "host_max_s": (max(pend) / rate_per_host) if pend and rate_per_host else None}


def unit_costs(server: Server, url: str, tmp: Path, rows: int = 40_000) -> dict[str, Any]:
    """Server CPU per row, measured alone (no other bench traffic): inserting samples in batches of 1000 (raw
    executemany), and folding them into the rollups (``rollup.roll_up_step``, the roller's step) in steps of 8 rows
    (one 1 Hz flush of 8 GPUs: the paced regime), 1000 and 50,000 rows. Best of three each; µs per row."""
    from hostagent.store.repo import UsageStore
    from hostagent.store.rollup import roll_up_step

    host = "fleet-unit-costs"
    store = UsageStore(url, host, spool_path=tmp / "unit-costs.spool.sqlite3")
    sql = f"INSERT INTO usage_samples ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))})"
    conn = pymysql_conn(url)
    base = 1_000_000_000_000  # ms, far from every other row of the run
    out: dict[str, Any] = {}
    try:
        for name, step, n in (("rollup_step_8", 8, 8000), ("rollup_step_1000", 1000, rows),
                              ("rollup_step_50000", 50_000, rows)):
            best_ins = best_roll = math.inf
            for _ in range(3):
                data = [(host, f"gpu-{i % 8}", base + i // 8 * 1000, "", "guest", 50.0, 1 << 30, 1.5, 300.0)
                        for i in range(n)]
                base += n * 1000
                c0 = read_cpu_s(server.pid) if server.pid else 0.0
                with conn.cursor() as cur:
                    for i in range(0, n, 1000):
                        cur.executemany(sql, data[i:i + 1000])
                        conn.commit()
                c1 = read_cpu_s(server.pid) if server.pid else 0.0
                more = True
                while more:
                    with store._roller_conn.begin() as rc:
                        _, more = roll_up_step(rc, host, now=time.time(), limit=step)
                c2 = read_cpu_s(server.pid) if server.pid else 0.0
                best_ins = min(best_ins, (c1 - c0) / n * 1e6)
                best_roll = min(best_roll, (c2 - c1) / n * 1e6)
            out[name] = best_roll
            out["insert_batch_1000"] = min(out.get("insert_batch_1000", math.inf), best_ins)
        best = math.inf
        for _ in range(3):  # the paced regime's insert: 8 rows (one per GPU) and a commit
            data = [(host, f"gpu-{i % 8}", base + i // 8 * 1000, "", "guest", 50.0, 1 << 30, 1.5, 300.0)
                    for i in range(4000)]
            base += 4000 * 1000
            c0 = read_cpu_s(server.pid) if server.pid else 0.0
            with conn.cursor() as cur:
                for i in range(0, 4000, 8):
                    cur.executemany(sql, data[i:i + 8])
                    conn.commit()
            best = min(best, ((read_cpu_s(server.pid) if server.pid else 0.0) - c0) / 500 * 1e6)
        out["insert_8_and_commit_us"] = best
    finally:
        conn.close()
        store.close()
    return out


def latest_deadlock(server: Server) -> list[str]:
    """The two transactions' statements and waits of InnoDB's latest detected deadlock (if any), shortened."""
    text = server.query("SHOW ENGINE INNODB STATUS")[0][2]
    m = re.search(r"LATEST DETECTED DEADLOCK\n-+\n(.*?)\n-{5,}\n", text, re.S)
    if not m:
        return []
    keep = []
    for line in m.group(1).splitlines():
        line = line.strip()
        if re.match(r"(INSERT|DELETE|UPDATE|SELECT|REPLACE)\b", line, re.I):
            keep.append(line[:160])
        elif "WAITING FOR THIS LOCK" in line or "HOLDS THE LOCK" in line or line.startswith("*** WE ROLL BACK"):
            keep.append(line[:160])
        elif line.startswith("RECORD LOCKS") and "index" in line:
            keep.append(re.sub(r"space id \d+ page no \d+ n bits \d+ ", "", line)[:160])
    return keep


def verify(server: Server, hosts: list[dict[str, Any]]) -> dict[str, Any]:
    """Stored vs sent, per host: samples (and distinct (GPU, instant) pairs: duplicates), both rollups, leases,
    events, reclaim events, the raw table."""
    q = server.query
    per: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for h, n, d in q("SELECT host_id, COUNT(*), COUNT(DISTINCT gpu_id, ts_ms) FROM usage_samples GROUP BY host_id"):
        per[h]["samples"], per[h]["distinct"] = int(n), int(d)
    for h, res, n in q("SELECT host_id, resolution, SUM(n) FROM usage_rollups GROUP BY host_id, resolution"):
        per[h][f"rolled_{res}"] = int(n)
    for table, key in (("leases", "leases"), ("lease_events", "events"), ("reclaim_events", "reclaim_events"),
                       (RAW_TABLE, "raw")):
        for h, n in q(f"SELECT host_id, COUNT(*) FROM {table} GROUP BY host_id"):
            per[h][key] = int(n)
    bad = []
    for f in hosts:
        got = per.get(f["host"], {})
        want = {"samples": f["sent"], "distinct": f["sent"], "rolled_60": f["sent"], "rolled_3600": f["sent"],
                "leases": f["leases"], "events": f["events"], "reclaim_events": f["reclaim_events"],
                "raw": f["raw_sent"]}
        for k, v in want.items():
            if got.get(k, 0) != v:
                bad.append(f"{f['host']} {k}: stored {got.get(k, 0)}, sent {v}")
        for k in ("dropped", "rejected"):
            if f["ingestor"][k]:
                bad.append(f"{f['host']} ingestor {k} {f['ingestor'][k]}")
        for k in ("rows_set_aside", "rows_lost", "rollup_errors"):
            if f["store"][k]:
                bad.append(f"{f['host']} store {k} {f['store'][k]}")
        if f["spool_depth"]:
            bad.append(f"{f['host']} {f['spool_depth']} writes still in its spool")
    sent = sum(f["sent"] for f in hosts)
    stored = sum(per[f["host"]].get("samples", 0) for f in hosts)
    return {"sent": sent, "stored": stored, "distinct": sum(per[f["host"]].get("distinct", 0) for f in hosts),
            "rolled_minute": sum(per[f["host"]].get("rolled_60", 0) for f in hosts),
            "rolled_hour": sum(per[f["host"]].get("rolled_3600", 0) for f in hosts),
            "leases": sum(f["leases"] for f in hosts), "events": sum(f["events"] for f in hosts),
            "raw_sent": sum(f["raw_sent"] for f in hosts), "problems": bad, "ok": not bad,
            # a deadlock reads as an outage to the store (engine._MYSQL_GONE): it spools, then replays
            "outages": sum(f["store"]["outages"] for f in hosts),
            "hosts_with_outages": sum(1 for f in hosts if f["store"]["outages"]),
            "ops_spooled": sum(f["store"]["ops_spooled"] for f in hosts),
            "ops_replayed": sum(f["store"]["ops_replayed"] for f in hosts)}


LAST = Path(tempfile.gettempdir()) / "bench_fleet_last.json"  # the figures so far, after every phase


def keep(res: dict[str, Any]) -> None:
    """Write the figures so far (a run stopped early, or a bug in the table, loses nothing measured)."""
    try:
        LAST.write_text(json.dumps(res, indent=1, default=str) + "\n")
    except OSError:
        pass


async def run(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    from hostagent.store.migrate import upgrade

    res: dict[str, Any] = {"plan": asdict(plan) | {"url": re.sub(r"//[^@/]*@", "//", plan.url)},
                           "machine": header_line()}
    server = Server(plan.url)
    await asyncio.to_thread(upgrade, plan.url)
    server.query(f"CREATE TABLE IF NOT EXISTS {RAW_TABLE} LIKE usage_samples")
    # each host holds a writer, a roller and a pooled reader connection; the raw writers one each more
    need = plan.hosts * 5 + 100
    max_conn = int(server.variable("max_connections"))
    res["server"] = {"version": server.query("SELECT VERSION()")[0][0], "pid": server.pid,
                     "max_connections": max_conn, "innodb_buffer_pool_size": int(server.variable(
                         "innodb_buffer_pool_size")), "innodb_flush_log_at_trx_commit": int(server.variable(
                             "innodb_flush_log_at_trx_commit")), "thread_handling": server.variable("thread_handling")}
    if max_conn < need:
        server.query(f"SET GLOBAL max_connections = {need}")
        res["server"]["max_connections_raised_to"] = need
    coord = Coordinator(plan, args.tmp)
    viewer = None
    try:
        t0 = time.perf_counter()
        outs = await coord.all("open", timeout=900)
        res["open"] = {"wall_s": time.perf_counter() - t0, "per_host": pcts(merge(outs, "open_s"))}
        if not args.no_page:
            viewer = Viewer(plan.url, args.tmp / "viewer")
            await viewer.start()
        base = time.time() - 20 * 86400  # flood instants: a backlog of 1 Hz samples from 20 days ago, per host

        # phase 1: paced
        stop = asyncio.Event()
        watch = asyncio.create_task(server.watch_threads(stop))
        a = server.snapshot()
        start = time.time() + 1.0
        page_task = None
        if viewer is not None:
            async def page_under_load() -> dict[str, list[float]]:
                # after every host has published once, and with time left for a few fetches before the end
                after = min(max(plan.publish_s + 2, plan.paced_s / 2), plan.paced_s - 3)
                await asyncio.sleep(max(0.0, start + after - time.time()))
                return await viewer.measure(plan.page_repeat, until=start + plan.paced_s - 0.5)
            page_task = asyncio.create_task(page_under_load())
        outs = await coord.all("paced", timeout=plan.paced_s + plan.recover_s + 600, t0=start, duration=plan.paced_s)
        b = server.snapshot()
        stop.set()
        await watch
        paced = {"cost": delta(a, b, sum(o["cpu_s"] for o in outs)), "sent": merge(outs, "sent"),
                 "target": plan.hosts * plan.gpus * plan.paced_s, "late": pcts(merge(outs, "late")),
                 "refused": merge(outs, "refused"), "depth_max": max(o["depth_max"] for o in outs),
                 "drain_s": max(o["drain_s"] for o in outs), "threads_running": server.threads_running[:],
                 "lag": lag_figures(merge(outs, "lags"), plan.gpus)}
        lat = merge(outs, "lat")
        paced["write"] = pcts([x for v in lat.values() for x in v])
        host_p95 = [percentile(v, 95) for v in lat.values() if v]
        paced["write_host_p95"] = {"median": percentile(host_p95, 50) * 1000, "worst": max(host_p95) * 1000}
        paced["delay"] = pcts(merge(outs, "delay"))
        paced["parts"] = parts(outs)
        paced["client_cpu"] = cpu_parts(outs)
        paced["trouble"] = trouble(outs)
        if page_task is not None:
            paced["page"] = {k: pcts(v) for k, v in (await page_task).items()}
            paced["page_hosts_seen"] = viewer.hosts_seen  # type: ignore[union-attr]
        res["paced"] = paced
        keep(res)

        # phase 2: floods, at each number of writers of --flood-hosts
        async def flood(kind: str, active: int) -> dict[str, Any]:
            server.threads_running.clear()
            stop = asyncio.Event()
            watch = asyncio.create_task(server.watch_threads(stop))
            a = server.snapshot()
            start = time.time() + 1.0
            outs = await coord.all("flood" if kind == "store" else "raw", timeout=plan.flood_s + plan.recover_s + 2400,
                                   t0=start, warmup=plan.warmup_s, duration=plan.flood_s, base=base, active=active)
            b = server.snapshot()
            stop.set()
            await watch
            window = plan.flood_s - plan.warmup_s
            f = {"cost": delta(a, b, sum(o["cpu_s"] for o in outs)), "sent": merge(outs, "sent"),
                 "inserted_rate": merge(outs, "inserted_window") / window,
                 "drain_s": max(o["drain_s"] for o in outs), "threads_running": server.threads_running[:]}
            lat = merge(outs, "lat")
            f["write"] = pcts([x for v in lat.values() for x in v])
            f["client_cpu"] = cpu_parts(outs)
            if kind == "store":
                f["trouble"] = trouble(outs)
                f["parts"] = parts(outs)
                f["rolled_rate"] = merge(outs, "rolled_window") / window
                f["pending_end"] = merge(outs, "pending_end")
                f["writes"] = [sum(o["writes"][0] for o in outs), sum(o["writes"][1] for o in outs), plan.batch]
                f["lag"] = lag_figures(merge(outs, "lags"), 0)
            else:
                f["errors"] = merge(outs, "errors")
            return f

        res["flood_sets"] = []
        for k in plan.flood_sets if plan.flood_s > 0 else ():
            fl: dict[str, list[dict[str, Any]]] = {"store": [], "raw": []}
            over = False
            for r in range(plan.repeat):
                # raw first: an overloaded store run ends in a backlog of replays that must not meet a raw run
                for kind in ("raw", "store") if r % 2 == 0 else ("store", "raw"):
                    fl[kind].append(await flood(kind, k))
                    keep(res | {"flood_partial": {"hosts": k, **fl}})
                over = overloaded(fl["store"][-1], fl["raw"][-1])
                if over:
                    break  # past the server's knee: another pair would tell the same
            store_rate = statistics.median(min(f["inserted_rate"], f["rolled_rate"]) for f in fl["store"])
            raw_rate = statistics.median(f["inserted_rate"] for f in fl["raw"])
            res["flood_sets"].append({"hosts": k, **fl, "store_rate": store_rate, "raw_rate": raw_rate,
                                      "ratio": store_rate / raw_rate if raw_rate else math.nan, "overloaded": over})

        outs = await coord.all("close")
        hosts = merge(outs, "hosts")
        res["sequential_replay"] = {"spooled_before": sum(o["sequential_replay"]["spooled_before"] for o in outs),
                                    "took_s": max(o["sequential_replay"]["took_s"] for o in outs)}
        res["hosts"] = {"published": sum(h["published"] for h in hosts),
                        "unmirrored": sum(h["unmirrored"] for h in hosts)}
        res["verify"] = verify(server, hosts)
        keep(res)
        res["server"]["latest_deadlock"] = latest_deadlock(server)
        rows = server.query("SELECT data_length + index_length FROM information_schema.tables "
                            "WHERE table_schema = DATABASE() AND table_name = 'usage_samples'")
        stored = res["verify"]["stored"]
        res["bytes_per_sample"] = int(rows[0][0]) / stored if rows and stored else None
        if not args.no_unit_costs:
            res["unit_costs"] = await asyncio.to_thread(unit_costs, server, plan.url, args.tmp)
        log: collections.Counter[str] = collections.Counter()
        for o in outs:
            log.update(o["outage_log"])
        res["verify"]["outage_log"] = dict(log.most_common())
        if viewer is not None:
            res["page_idle"] = {k: pcts(v) for k, v in (await viewer.measure(plan.page_repeat)).items()}
            res["page_hosts_seen"] = viewer.hosts_seen
        await coord.all("exit")
    finally:
        if viewer is not None:
            await viewer.stop()
        coord.stop()
        if max_conn < need:
            server.query(f"SET GLOBAL max_connections = {max_conn}")
        server.conn.close()
        server.watch_conn.close()
    return res


# -- the report ----------------------------------------------------------------------------------------------------
def fmt_cost(c: dict[str, Any], samples: float) -> str:
    st = c["status"]
    srv = c["server_cpu_s"]
    per = f"{srv / samples * 1e6:.0f} µs server CPU per sample" if srv is not None and samples else "-"
    return (f"server CPU {srv / c['wall_s']:.2f} cores, clients {c['client_cpu_s'] / c['wall_s']:.2f} cores, "
            f"machine busy {c['machine_busy'] * 100:.0f} %; {per}; statements {st['Questions']} "
            f"({st['Questions'] / samples * 1000:.0f} per 1000 samples), commits {st['Com_commit']}, row lock waits "
            f"{st['Innodb_row_lock_waits']} ({st['Innodb_row_lock_time']} ms), deadlocks {st['Innodb_deadlocks']}, "
            f"buffer pool reads {st['Innodb_buffer_pool_reads']}, fsyncs {st['Innodb_data_fsyncs']}"
            if samples else "-")


def report(res: dict[str, Any]) -> list[str]:
    p = res["plan"]
    hosts, gpus = p["hosts"], p["gpus"]
    s = res["server"]
    out = [res["machine"],
           f"MariaDB {s['version']} on this machine (pid {s['pid']}), innodb_buffer_pool_size "
           f"{s['innodb_buffer_pool_size'] >> 20} MiB, innodb_flush_log_at_trx_commit "
           f"{s['innodb_flush_log_at_trx_commit']}, {s['thread_handling']}, max_connections {s['max_connections']}"
           + (f" (raised to {s['max_connections_raised_to']} for this run, then restored)"
              if "max_connections_raised_to" in s else ""),
           f"{hosts} hosts x {gpus} GPUs in {p['procs']} worker processes, each host its own UsageStore; leases "
           f"~{p['lease_s']:g} s (1 in {round(1 / RECLAIMED)} reclaimed idle), fleet publish every {p['publish_s']:g} "
           f"s, ingestor batch {p['batch']} / flush {p['flush_s']:g} s"
           + (f"; WHAT-IF roller: ROLL_AFTER_S {p['roll_after_s']}, ROLL_EVERY_WRITES {p['roll_every_writes']}"
              if p["roll_after_s"] is not None or p["roll_every_writes"] is not None else ""),
           f"open: {res['open']['wall_s']:.1f} s for all hosts (UsageStore + GPUs per host: p50 "
           f"{res['open']['per_host']['p50']:.0f} ms, max {res['open']['per_host']['max']:.0f} ms)", ""]
    pc = res["paced"]
    rate = pc["sent"] / p["paced_s"]
    out += [f"[phase 1: paced, 1 sample per GPU per second, {p['paced_s']:g} s]",
            f"  samples            {pc['sent']} of {pc['target']:.0f} ({rate:.0f}/s of {hosts * gpus}/s); "
            f"refused {pc['refused']}; queue depth max {pc['depth_max']}; drain after {pc['drain_s'] * 1000:.0f} ms",
            f"  heartbeat lateness p50 {pc['late']['p50']:.1f} ms, p99 {pc['late']['p99']:.1f} ms, max "
            f"{pc['late']['max']:.0f} ms (the client loop's own delay)",
            "                     flushes      p50 ms   p95 ms   p99 ms   max ms",
            f"  write per flush  {pc['write']['n']:>9}  {pc['write']['p50']:>8.1f} {pc['write']['p95']:>8.1f} "
            f"{pc['write']['p99']:>8.1f} {pc['write']['max']:>8.1f}   (mirror + INSERT + commit, per host)",
            f"  sample -> commit {pc['delay']['n']:>9}  {pc['delay']['p50']:>8.1f} {pc['delay']['p95']:>8.1f} "
            f"{pc['delay']['p99']:>8.1f} {pc['delay']['max']:>8.1f}   (oldest sample of each flush)",
            f"  per-host p95 of write: median host {pc['write_host_p95']['median']:.1f} ms, worst host "
            f"{pc['write_host_p95']['worst']:.1f} ms",
            f"  {parts_line(pc['parts'])}",
            f"  rollup lag (rollup_pending per host, every {p['lag_every_s']:g} s, {pc['lag']['checks']} checks): p50 "
            f"{pc['lag']['host_p50']:.0f}, p95 {pc['lag']['host_p95']:.0f}, max {pc['lag']['host_max']} rows "
            f"(= {pc['lag']['host_max_s'] or 0:.1f} s of a host's samples); whole fleet at most "
            f"{pc['lag']['fleet_max']}",
            f"  cost: {fmt_cost(pc['cost'], pc['sent'])}",
            f"  clients' CPU by part: {cpu_line(pc['client_cpu'], pc['cost']['wall_s'])}",
            f"  Threads_running: mean {statistics.mean(pc['threads_running'] or [0]):.1f}, max "
            f"{max(pc['threads_running'] or [0])}"]
    out += trouble_lines(pc["trouble"], "  ")
    # the roller waits up to 1.5 x ROLL_AFTER_S for writes to gather (the store's own, or a what-if's), then a
    # flush interval and a step's time (2 s allowed) may pass before the check sees them folded
    roll = p["roll_after_s"] if p["roll_after_s"] is not None else ROLL_AFTER_S
    lag_ok = max(5.0, 1.5 * roll + p["flush_s"] + 2.0)
    keeps = (pc["sent"] >= 0.99 * pc["target"] and pc["refused"] == 0 and pc["drain_s"] < 5
             and pc["delay"]["p99"] < 2000 * p["flush_s"] + 1000 and (pc["lag"]["host_max_s"] or 0) <= lag_ok)
    out.append(f"  keeps up: {'YES' if keeps else 'NO'} (all samples accepted, p99 sample -> commit under "
               f"{2 * p['flush_s'] + 1:g} s, rollups at most {lag_ok:g} s behind on every host, drained at once)")
    if pc["late"]["p99"] > 1000:
        c = pc["cost"]
        out.append(f"    the simulated agents themselves are late (heartbeat p99 {pc['late']['p99'] / 1000:.1f} s): "
                   f"they "
                   f"use {c['client_cpu_s'] / c['wall_s']:.2f} cores of this machine's CPUs beside the server's "
                   f"{(c['server_cpu_s'] or 0) / c['wall_s']:.2f} (busy {c['machine_busy'] * 100:.0f} %)")
    if "page" in pc and not pc["page"]:
        out.append("  fleet page under this load: not measured (the paced phase ended before a publish interval "
                   "had passed; lengthen --paced-s or shorten --publish-s)")
    elif "page" in pc:
        out.append(f"  fleet page under this load ({pc['page_hosts_seen'][0]} hosts in the view, "
                   f"{pc['page_hosts_seen'][1]} rows on the page):")
        out += page_lines(pc["page"])
    if not res["flood_sets"]:
        out += ["", "[phase 2: skipped (--flood-s 0)]", ""]
    for fs in res["flood_sets"]:
        out += ["", f"[phase 2: flood, {fs['hosts']} hosts at once, each as fast as the store takes it, "
                    f"{p['flood_s']:g} s, counted after {p['warmup_s']:g} s; {len(fs['store'])} run(s) of each path, "
                    f"raw first, then alternating]"]
        for kind in ("store", "raw"):
            for i, f in enumerate(fs[kind]):
                out += flood_lines(kind, i, f)
        if fs["overloaded"]:
            verdict = "not comparable: both paths past this server's knee (OVERLOADED), run once"
        else:
            verdict = f"target >= 0.80: {'MET' if fs['ratio'] >= 0.8 else 'NOT MET'}"
        out += [f"  store path (inserted and rolled up) {fs['store_rate']:8.0f} samples/s  (median)",
                f"  raw executemany, same writers       {fs['raw_rate']:8.0f} samples/s  (median)",
                f"  ratio store/raw                     {fs['ratio']:8.2f}  ({verdict})"]
    out.append("")
    v = res["verify"]
    out += [f"[correctness] samples sent {v['sent']}, stored {v['stored']} ({v['distinct']} distinct GPU instants), "
            f"rolled up minute/hour {v['rolled_minute']}/{v['rolled_hour']}; leases {v['leases']}, journal events "
            f"{v['events']} (left unmirrored {res['hosts']['unmirrored']}), fleet publishes "
            f"{res['hosts']['published']}; "
            f"raw rows {v['raw_sent']}: {'nothing lost or duplicated' if v['ok'] else 'PROBLEMS'}"]
    out += [f"  {x}" for x in v["problems"][:10]]
    sq = res["sequential_replay"]
    if sq["spooled_before"]:
        out.append(f"  {sq['spooled_before']} writes were still spooled at the end: replayed host by host before "
                   f"counting ({sq['took_s']:.0f} s)")
    out.append(f"  store outages (the store spooled, then replayed): {v['outages']} on {v['hosts_with_outages']} "
               f"hosts, {v['ops_spooled']} writes spooled, {v['ops_replayed']} replayed (a deadlock counts as one)")
    for what, n in list(v["outage_log"].items())[:6]:
        out.append(f"    {n:>5} x  {what}  (MySQL error number on the statement that failed)")
    if s.get("latest_deadlock"):
        out.append("  InnoDB's latest detected deadlock:")
        out += [f"    {x}" for x in s["latest_deadlock"][:12]]
    if "page_idle" in res:
        out += ["", f"[fleet page after the load, {res['page_hosts_seen'][0]} hosts, {p['page_repeat']} fetches]"]
        out += page_lines(res["page_idle"])
        idle = res["page_idle"]["GET /ui/fleet"]["p95"]
        loaded = res["paced"].get("page", {}).get("GET /ui/fleet", {}).get("p95")
        out.append(f"  GET /ui/fleet p95 {idle:.0f} ms (target < 200 ms: {'MET' if idle < 200 else 'NOT MET'})"
                   + (f"; {loaded:.0f} ms during phase 1, this machine "
                      f"{res['paced']['cost']['machine_busy'] * 100:.0f} % busy with the simulated agents and the server"
                      if loaded is not None else ""))
    out += ["", "[per host, and a projection to 10,000 hosts at 1 sample per GPU per second]"] + projection(res)
    return out


def cpu_line(parts: dict[str, float], wall: float) -> str:
    return ", ".join(f"{k} {v / wall:.2f}" for k, v in parts.items() if v) + " cores"


def flood_lines(kind: str, i: int, f: dict[str, Any]) -> list[str]:
    rolled = f" rolled up {f['rolled_rate']:8.0f}/s," if kind == "store" else ""
    out = [f"  {kind:<5} run {i + 1}: inserted {f['inserted_rate']:8.0f}/s,{rolled} write p50 "
           f"{f['write']['p50']:.0f} ms p99 {f['write']['p99']:.0f} ms, drain {f['drain_s']:.1f} s"
           + (f", rollup pending at the last check {f['pending_end']} rows (fleet)" if kind == "store" else "")]
    if kind == "store":
        out.append(f"      {parts_line(f['parts'])}")
        if f.get("writes") and f["writes"][1]:
            n, w, batch = f["writes"]
            out.append(f"      the ingestors' writes: {w}, {n / w:.0f} samples each on average (a batch is {batch}: "
                       "fewer would mean the guests left the store waiting)")
        out += trouble_lines(f["trouble"], "      ")
    out.append(f"      clients' CPU by part: {cpu_line(f['client_cpu'], f['cost']['wall_s'])}")
    out.append(f"      cost: {fmt_cost(f['cost'], f['sent'])}; Threads_running mean "
               f"{statistics.mean(f['threads_running'] or [0]):.1f}")
    if f.get("errors"):
        out.append(f"      errors: {f['errors'][:3]}")
    return out


def parts_line(pt: dict[str, Any]) -> str:
    i, st = pt["insert"], pt["step"]
    return (f"INSERT statement p50 {i['p50']:.1f} ms, p99 {i['p99']:.1f} ms ({i['n']}, {pt['insert_s_total']:.1f} s in "
            f"all); roller steps {st['n']} of {pt['step_rows']:.0f} rows on average, p50 {st['p50']:.1f} ms, p99 "
            f"{st['p99']:.1f} ms ({pt['step_s_total']:.1f} s in all)")


def page_lines(page: dict[str, dict[str, float]]) -> list[str]:
    out = ["                        n   p50 ms   p95 ms   max ms"]
    for k, v in page.items():
        out.append(f"    {k:<18}{v['n']:>5} {v['p50']:>8.1f} {v['p95']:>8.1f} {v['max']:>8.1f}")
    return out


def projection(res: dict[str, Any]) -> list[str]:
    p = res["plan"]
    pc = res["paced"]["cost"]
    hosts, gpus = p["hosts"], p["gpus"]
    srv = pc["server_cpu_s"]
    if srv is None:
        return ["  (no server CPU figure: the server's process is not readable here)"]
    per_host = srv / pc["wall_s"] / hosts  # server cores per host at 1 Hz
    stm = pc["status"]["Questions"] / pc["wall_s"] / hosts
    commits = pc["status"]["Com_commit"] / pc["wall_s"] / hosts
    u = res.get("unit_costs") or {}
    n = 10_000
    rate = n * gpus
    roll = p["roll_after_s"] if p["roll_after_s"] is not None else ROLL_AFTER_S
    out = [f"  paced, as the agent runs now (a flush of {gpus} samples per host per second, a rollup step about "
           f"every {roll:g} s): "
           f"{per_host * 1000:.2f} ms of server CPU per host per second, {stm:.1f} statements and {commits:.1f} "
           f"commits per host per second, 3 connections per host (writer, roller, reader)"]
    if u:
        out.append(f"  server CPU measured alone: an INSERT of 8 rows and its commit "
                   f"{u['insert_8_and_commit_us'] / 1000:.2f} ms; per row: INSERT in batches of 1000 "
                   f"{u['insert_batch_1000']:.1f} µs; "
                   f"rollup step of 8 rows {u['rollup_step_8']:.1f} µs/row ({u['rollup_step_8'] * 8 / 1000:.2f} ms a "
                   f"step), of 1000 rows {u['rollup_step_1000']:.1f} µs/row, of 50,000 rows "
                   f"{u['rollup_step_50000']:.1f} µs/row")
    out.append(f"  10,000 hosts x {gpus} GPUs at 1 Hz = {rate:,} samples/s on one primary:")
    if res.get("bytes_per_sample"):
        day = res["bytes_per_sample"] * rate * 86400
        out.append(f"    raw samples take {res['bytes_per_sample']:.0f} bytes each here (row and indexes): "
                   f"{day / 1e9:,.0f} GB a day, {day * 30 / 1e12:,.0f} TB for the default 30 days of raw retention")
    out.append(f"    as measured here: ~{per_host * n:.0f} server cores, {stm * n:,.0f} statements/s, "
               f"{commits * n:,.0f} commits/s, {3 * n:,} connections")
    if u:
        rows = gpus * roll  # a step's rows: its fixed cost (the 8-row step's) plus each row past 8 at the 1000-row rate
        step = u["rollup_step_8"] * 8 + max(0.0, rows - 8) * u["rollup_step_1000"]
        now = (u["insert_8_and_commit_us"] + step / roll) / 1e6  # server s per host per second
        out.append(f"    as the agent runs when it keeps up (an {gpus}-row flush per second and a {rows:g}-row rollup "
                   f"step every {roll:g} s per host, from the unit costs): ~{now * n:.0f} server cores")
    if u:
        batched = (u["insert_batch_1000"] + u["rollup_step_1000"]) * rate / 1e6
        out.append(f"    with 1000-sample batches (flush every {1000 // gpus} s) and a rollup step per batch: "
                   f"~{batched:.1f} server cores for inserts and rollups, {2 * n / (1000 / gpus):,.0f} commits/s")
    return out


def flood_sets(text: str, hosts: int) -> tuple[int, ...]:
    """'all,20' -> (hosts, 20), each at most hosts, each once."""
    out: list[int] = []
    for part in text.split(","):
        n = hosts if part.strip() in ("all", "") else max(1, min(hosts, int(part)))
        if n not in out:
            out.append(n)
    return tuple(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="SQLAlchemy URL of a MariaDB database (default: a temporary one)")
    ap.add_argument("--port", type=int, default=3306, help="port of the MariaDB server for the temporary database")
    ap.add_argument("--keep", action="store_true", help="keep the temporary database (its name goes to stderr)")
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per host")
    ap.add_argument("--procs", type=int, default=2, help="worker processes the hosts are spread over")
    ap.add_argument("--paced-s", type=float, default=60.0, help="phase 1 (1 sample per GPU per second)")
    ap.add_argument("--flood-s", type=float, default=30.0, help="phase 2, each path's run")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="the start of each flood left out of its rate")
    ap.add_argument("--repeat", type=int, default=3, help="flood runs of each path (alternating which goes first; "
                    "the median counts); a set of writers that overloads the server runs once")
    ap.add_argument("--flood-hosts", default="all,20",
                    help="how many hosts flood at once, one flood set each (default: all of them, then 20)")
    ap.add_argument("--lease-s", type=float, default=30.0, help="mean lease length (exponential, at least 2 s)")
    ap.add_argument("--publish-s", type=float, default=15.0, help="fleet publish interval")
    ap.add_argument("--batch", type=int, default=1000, help="the ingestor's batch (store.flush_batch)")
    ap.add_argument("--flush-s", type=float, default=1.0, help="the ingestor's interval (store.flush_interval_s)")
    ap.add_argument("--page-repeat", type=int, default=30, help="fetches of the fleet page per measurement")
    ap.add_argument("--roll-after-s", type=float, help="what-if: the store's ROLL_AFTER_S (0.5 s) in the workers")
    ap.add_argument("--roll-every-writes", type=int, help="what-if: the store's ROLL_EVERY_WRITES (8) in the workers")
    ap.add_argument("--recover-s", type=float, default=60.0,
                    help="how long after a phase the stores' own replays may take before the rest is replayed one "
                         "host at a time")
    ap.add_argument("--no-unit-costs", action="store_true", help="skip the server's CPU per row measured alone")
    ap.add_argument("--no-page", action="store_true", help="skip the fleet page (no agent app)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 20 hosts, 15 s paced, 10 s floods")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="every figure as JSON: to FILE, or instead of the table with no FILE")
    args = ap.parse_args()

    def stopped(signum: int, frame: Any) -> None:  # a SIGTERM still drops the temporary database and puts
        raise KeyboardInterrupt  # max_connections back (the `finally` blocks run)

    signal.signal(signal.SIGTERM, stopped)
    if args.quick:
        args.hosts, args.paced_s, args.flood_s, args.warmup_s, args.page_repeat = 20, 15.0, 10.0, 3.0, 10
        args.flood_hosts, args.publish_s = "all,5", 5.0
    if args.hosts < 1 or args.procs < 1 or (args.flood_s and args.flood_s <= args.warmup_s):
        ap.error("need --hosts >= 1, --procs >= 1 and --flood-s > --warmup-s (or 0: no flood)")
    with database(args.db, args.port, prefix="bench_fleet", keep=args.keep) as url, tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        plan = Plan(url=url, hosts=args.hosts, gpus=args.gpus, procs=min(args.procs, args.hosts),
                    paced_s=args.paced_s, flood_s=args.flood_s, warmup_s=args.warmup_s, repeat=args.repeat,
                    lease_s=args.lease_s, publish_s=args.publish_s, batch=args.batch, flush_s=args.flush_s,
                    page_repeat=args.page_repeat,
                    roll_after_s=args.roll_after_s, roll_every_writes=args.roll_every_writes,
                    flood_sets=flood_sets(args.flood_hosts, args.hosts), recover_s=args.recover_s)
        args.tmp = Path(tmp)
        res = asyncio.run(run(plan, args))
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    if args.json == "-":
        print(json.dumps(res, indent=1, default=str))
    else:
        try:
            print("\n".join(report(res)))
        except Exception:  # a long run's figures are not lost to a bug in their table
            print(json.dumps(res, indent=1, default=str))
            raise
    if not res["verify"]["ok"]:
        print("LOST OR DUPLICATED ROWS", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
