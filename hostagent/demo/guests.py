"""The demo's simulated guests: each VM runs jobs through the guest agent's own code against the real API.

A guest is the guest agent as it runs in a VM (:class:`hostagent.guest.client.HostClient` for the lease calls,
:class:`hostagent.guest.monitor.Monitor` for sampling, heartbeats, strike warnings and reclaim notices) with one
difference: its GPUs are simulated. :class:`SimGpus` is a sampler backend that reads the running job's utilisation
curve and work rate (:mod:`hostagent.demo.jobs`) where NVML would read the card.

A guest is a small state machine advanced by :meth:`DemoGuest.step`, so the same code runs live (a step every few
seconds of wall time) and on a fast clock (the history the demo writes before it serves, :mod:`hostagent.demo.history`):
think, ask for a lease, wait in the queue if deferred, work, release; a job that "forgets" its GPUs idles without
releasing until the agent's two-strike detector reclaims them (the monitor honours the notice and releases).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.demo.jobs import Job, draw_job
from hostagent.guest.client import HostClient
from hostagent.guest.config import GuestConfig
from hostagent.guest.errors import ApiError, HostUnreachable
from hostagent.guest.monitor import Monitor, Tracked
from hostagent.guest.sampler import GpuInfo, Reading, Sampler, normalize_bus_id
from hostagent.host.fakesysfs import record_interrupts_of

log = logging.getLogger("hostagent.demo")


@dataclass(frozen=True)
class Pace:
    """How a guest's life is paced: think time between jobs, how long jobs work, how long a forgotten GPU idles
    before the guest gives up on the detector, how long a queued request waits before it is withdrawn."""

    think_s: tuple[float, float]
    busy_s: tuple[float, float]
    forget_chance: float
    priority_chance: float
    queue_patience_s: float
    heartbeat_s: float
    sample_s: float
    book_chance: float = 0.0  # how often a job is booked ahead (start_at) instead of asked for now
    book_ahead_s: tuple[float, float] = (120.0, 900.0)  # how far ahead


LIVE = Pace(think_s=(5.0, 40.0), busy_s=(60.0, 420.0), forget_chance=0.2, priority_chance=0.1,
            queue_patience_s=300.0, heartbeat_s=15.0, sample_s=5.0, book_chance=0.15, book_ahead_s=(120.0, 900.0))


class HostInterrupts:
    """The simulated host's side of a GPU at work: its vfio-msix counters in the fake /proc/interrupts move with its
    utilisation (what the reaper's host signal reads), and stand still while it idles."""

    def __init__(self, proc_root: Path | str) -> None:
        self.proc_root = Path(proc_root)
        self.counts: dict[str, int] = {}
        self.moved: set[str] = set()

    def __call__(self, address: str, util_pct: float, seconds: float) -> None:
        if util_pct < 1.0:
            return
        self.counts[address] = self.counts.get(address, 0) + max(1, int(util_pct * seconds * 20))
        self.moved.add(address)

    def publish(self) -> None:
        """Write the counters that moved since the last call, in one rewrite of the file (once per round of the
        guests, before the reaper may read it: not once per sample)."""
        moved, self.moved = self.moved, set()
        record_interrupts_of(self.proc_root, {a: self.counts[a] for a in sorted(moved)})


class SimGpus:
    """A sampler backend for the GPUs of a guest's current lease: what NVML would report, from the job's curve."""

    note = "simulated GPUs (hostagent demo)"
    blocks = False  # read from the job's curve in memory: no thread hop per sample (23,000 in the demo's history)

    def __init__(self, guest: DemoGuest) -> None:
        self.guest = guest
        self.devices: list[GpuInfo] = []
        lease = guest.lease or {}
        tracked = guest.monitor.leases.get(lease.get("id", "")) if lease else None
        if tracked is not None:  # the monitor's copy: it learns of a top-up's new devices
            lease = tracked.lease
        for i, dev in enumerate(lease.get("devices") or ()):
            info = guest.gpu_info.get(dev["gpu_id"], {})
            addr = (dev.get("guest_addresses") or [f"0000:00:{1 + i:02x}.0"])[0]
            self.devices.append(GpuInfo(i, normalize_bus_id(addr), str(info.get("model") or "GPU"),
                                        memory_total_bytes=info.get("memory_bytes"), source="demo"))
        self.host_addresses = [str(guest.gpu_info.get(d["gpu_id"], {}).get("address") or "")
                               for d in lease.get("devices") or ()]

    def read(self, ts: float) -> list[Reading]:
        """One reading per GPU at `ts`."""
        job, start = self.guest.job, self.guest.started_at
        out = []
        for d in self.devices:
            if job is None or start is None:
                out.append(Reading(ts, d.index, d.bus_id, 0.0, 0, d.memory_total_bytes))
                continue
            t = ts - start
            util = job.util(t, d.index)
            out.append(Reading(ts, d.index, d.bus_id, util, job.mem_bytes(t, d.memory_total_bytes),
                               d.memory_total_bytes, (), job.rate(t, d.index, d.name)))
            if self.guest.interrupts is not None and self.host_addresses[d.index]:
                self.guest.interrupts(self.host_addresses[d.index], util, self.guest.pace.sample_s)
        return out

    def close(self) -> None:
        """Nothing to release."""


@dataclass
class DemoGuest:
    """One VM of the demo and the job it is on."""

    name: str
    client: HostClient
    pace: Pace
    clock: Callable[[], float]
    rng: random.Random
    gpu_info: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # gpu_id -> its /v1/gpus entry
    interrupts: HostInterrupts | None = None
    state: str = "thinking"  # thinking | queued | working
    job: Job | None = None
    lease: dict[str, Any] | None = None
    started_at: float | None = None
    next_at: float = 0.0
    next_beat: float = 0.0
    next_sample: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: {"leases": 0, "queued": 0, "booked": 0, "withdrawn": 0,
                                                             "refused": 0, "reclaimed": 0, "released": 0})
    monitor: Monitor = field(init=False)

    def __post_init__(self) -> None:
        cfg = GuestConfig(url=self.client.url, sample_interval_s=self.pace.sample_s,
                          heartbeat_interval_s=self.pace.heartbeat_s, hook_timeout_s=5.0)
        self.monitor = Monitor(self.client, cfg, lambda: Sampler(SimGpus(self), SimGpus.note, sys_root=""),  # type: ignore[arg-type]
                               clock=self.clock, auto_renew=True)
        self.next_at = self.clock() + self.rng.uniform(0.0, self.pace.think_s[1])

    async def step(self) -> None:
        """Advance the guest to the clock's time: at most one API call besides the heartbeat it owes."""
        now = self.clock()
        try:
            if self.state == "thinking" and now >= self.next_at:
                await self._ask()
            elif self.state == "queued":
                await self._check_queue(now)
            elif self.state == "working":
                await self._work(now)
        except HostUnreachable as exc:
            log.debug("%s: host unreachable: %s", self.name, exc.message)
        except ApiError as exc:
            log.info("%s: %s", self.name, exc.message)
            self._think(now)

    async def _ask(self) -> None:
        self.job = job = draw_job(self.rng, busy_s=self.pace.busy_s, forget_chance=self.pace.forget_chance,
                                  priority_chance=self.pace.priority_chance)
        request = job.request(duration_s=job.busy_s * 2 + 600)
        booking = self.rng.random() < self.pace.book_chance
        if booking:  # booked ahead: the host binds the GPUs at its start (the earliest window that fits, if taken)
            request.update(start_at=self.clock() + self.rng.uniform(*self.pace.book_ahead_s),
                           duration_s=int(job.busy_s * 1.5 + 300), accept_partial=False)
        try:
            status, body = await self.client.create_lease(request)
        except ApiError as exc:  # more than the host could ever give, a quota: think again
            self.counts["refused"] += 1
            log.debug("%s: lease refused: %s", self.name, exc.message)
            self._think(self.clock())
            return
        self.counts["leases"] += 1
        self.lease = body
        if body.get("state") == "BOOKED":  # waits for its start as a queued request waits for its turn
            self.counts["booked"] += 1
            start = float((body.get("booking") or {}).get("start_at") or self.clock())
            self.state, self.next_at = "queued", start + self.pace.queue_patience_s
        elif status == 202 or body.get("state") == "QUEUED":
            self.counts["queued"] += 1
            self.state, self.next_at = "queued", self.clock() + self.pace.queue_patience_s
        else:
            self._start(body)

    async def _check_queue(self, now: float) -> None:
        assert self.lease is not None
        body = await self.client.get_lease(self.lease["id"])
        if body.get("state") == "ACTIVE":
            self._start(body)
        elif body.get("state") in ("RELEASED", "EXPIRED", "FAILED"):
            self._think(now)
        elif now >= self.next_at:  # waited long enough: withdraw and try something else later
            await self.client.release(self.lease["id"])
            self.counts["withdrawn"] += 1
            self._think(now)

    def _start(self, lease: dict[str, Any]) -> None:
        self.lease, self.state = lease, "working"
        self.started_at = self.clock()
        self.next_beat = self.started_at + self.pace.heartbeat_s
        self.next_sample = self.started_at
        self.monitor.track(lease)

    async def _work(self, now: float) -> None:
        assert self.lease is not None and self.job is not None and self.started_at is not None
        t = self.monitor.leases.get(self.lease["id"])
        if t is None:
            self._think(now)
            return
        if now >= self.next_sample:
            self.next_sample = now + self.pace.sample_s
            await self.monitor.sample()
        if now >= self.next_beat and not t.ended:
            self.next_beat = now + self.pace.heartbeat_s
            await self.monitor.heartbeat(t)
        if t.ended:  # reclaimed (the monitor released it on the notice), expired, or ended by the operator
            self.counts["reclaimed" if t.reclaiming else "released"] += 1
            self._end(t, now)
            return
        worked = now - self.started_at
        if worked >= self.job.busy_s and not self.job.forgets:
            await self.monitor.flush(t)
            await self.monitor.release(t, "job finished")
            self.counts["released"] += 1
            self._end(t, now)
        elif self.job.forgets and worked >= self.job.busy_s + 20 * self.pace.busy_s[1]:
            await self.monitor.release(t, "gave up waiting for the reclaim")  # a detector that never came
            self._end(t, now)

    def _end(self, t: Tracked, now: float) -> None:
        self.monitor.untrack(t.id)
        self._think(now)

    def _think(self, now: float) -> None:
        self.state, self.job, self.lease, self.started_at = "thinking", None, None, None
        self.next_at = now + self.rng.uniform(*self.pace.think_s)

    async def leave(self) -> None:
        """Give back what this guest holds (the demo is stopping)."""
        if self.lease is None:
            return
        t = self.monitor.leases.get(self.lease["id"])
        try:
            if t is not None:
                await self.monitor.release(t, "demo stopping")
            elif self.state == "queued":
                await self.client.release(self.lease["id"])
        except (ApiError, HostUnreachable) as exc:
            log.info("%s: could not release %s: %s", self.name, self.lease["id"], exc.message)
        self._think(self.clock())


async def gpu_info(client: HostClient) -> dict[str, dict[str, Any]]:
    """The host's GPUs by id (model and memory), as a guest token reads them."""
    body = (await client.request("GET", "/v1/gpus"))[1]
    return {g["id"]: g for g in body.get("gpus", [])}


async def run_live(url: str, creds: Mapping[str, Any], proc_root: Path | str, *, seed: int | None = None,
                   pace: Pace = LIVE, tick_s: float = 1.0) -> None:
    """The demo's guests, live against the agent at `url`, until cancelled (then they give back what they hold)."""
    rng = random.Random(seed)
    irq = HostInterrupts(proc_root)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(HostClient(url, vm["token"], retries=1)) for vm in creds["vms"]]
        info = await gpu_info(clients[0])
        guests = [DemoGuest(vm["domain"], c, pace, time.time, random.Random(rng.randrange(1 << 30)), info, irq)
                  for vm, c in zip(creds["vms"], clients)]
        log.info("demo: %d simulated guests at work (their leases, heartbeats and releases go through the API)",
                 len(guests))
        try:
            while True:
                for g in guests:
                    await g.step()
                irq.publish()
                await asyncio.sleep(tick_s)
        finally:
            await asyncio.shield(_leave_all(guests))


async def _leave_all(guests: list[DemoGuest]) -> None:
    for g in guests:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(g.leave(), 5.0)
