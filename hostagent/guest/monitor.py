"""The monitor: samples the leased GPUs, carries the samples to the host in heartbeats, honours reclaim notices.

Sampling and heartbeats are two loops: a host outage stalls only the heartbeats, and the samples wait in a
bounded buffer per lease (oldest dropped beyond it, counted) until the host answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hostagent.guest.buffer import SampleBuffer
from hostagent.guest.client import HostClient
from hostagent.guest.config import GuestConfig
from hostagent.guest.errors import ApiError, HostUnreachable
from hostagent.guest.hooks import run_hook, stop_processes
from hostagent.guest.mapping import DeviceMap, map_devices
from hostagent.guest.sampler import Reading, Sampler

log = logging.getLogger("hostagent.guest.monitor")

TERMINAL = frozenset({"RELEASED", "EXPIRED", "FAILED"})
_SAMPLE_FIELD = re.compile(r"^samples\[(\d+)\]")


@dataclass
class Tracked:
    """One lease under watch and what happened to it."""

    lease: dict[str, Any]
    buffer: SampleBuffer
    sent: int = 0
    heartbeats: int = 0
    warned_for: Any = None  # strike_at of the last warning handled
    reclaiming: bool = False
    detach_pending_seen: bool = False
    ended: str | None = None  # final state once over
    end_note: str | None = None
    reported_drops: int = 0
    moved_for: Any = None  # (from, to) of the last move notice handled
    last_reply: dict[str, Any] | None = None
    hook_tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    @property
    def id(self) -> str:
        """The lease id."""
        return str(self.lease["id"])

    @property
    def gpu_ids(self) -> list[str]:
        """The host's gpu ids of the lease."""
        return [d["gpu_id"] for d in self.lease.get("devices") or ()]


class Monitor:
    """Watches leases: sample -> buffer -> heartbeat -> act on the reply."""

    def __init__(self, client: HostClient, cfg: GuestConfig, open_sampler: Callable[[], Sampler], *,
                 clock: Callable[[], float] = time.time, extra_gpu_users: Callable[[], list[int]] = list,
                 auto_renew: bool = False) -> None:
        self.client = client
        self.cfg = cfg
        self.open_sampler = open_sampler
        self.clock = clock
        self.extra_gpu_users = extra_gpu_users  # `run`'s child: stopped with the NVML-reported users
        self.auto_renew = auto_renew
        self.sampler: Sampler | None = None
        self.map = DeviceMap({}, {}, ())
        self.leases: dict[str, Tracked] = {}
        self.last_readings: list[Reading] = []
        self.host_down_since: float | None = None
        self.on_end: Callable[[Tracked], Awaitable[None] | None] | None = None

    # -- leases and devices ---------------------------------------------------------------------------------------
    def track(self, lease: Mapping[str, Any]) -> Tracked:
        """Start watching an ACTIVE lease (re-opens the sampler so hot-plugged GPUs are seen)."""
        t = self.leases.get(lease["id"])
        if t is None:
            t = self.leases[lease["id"]] = Tracked(dict(lease), SampleBuffer(self.cfg.buffer_max))
            log.info("watching lease %s (GPUs %s)", t.id, ", ".join(t.gpu_ids) or "none")
            self.refresh_devices(reopen=True)
        return t

    def untrack(self, lease_id: str) -> Tracked | None:
        """Stop watching a lease (its unsent samples go with it)."""
        t = self.leases.pop(lease_id, None)
        if t is not None:
            self.refresh_devices(reopen=False)
        return t

    def refresh_devices(self, *, reopen: bool) -> None:
        """(Re)open the sampler and map guest GPUs to the leases' gpu ids."""
        if reopen or self.sampler is None:
            if self.sampler is not None:
                self.sampler.close()
            self.sampler = self.open_sampler()
            if not self.sampler.available:
                log.warning("%s; heartbeats carry no samples and the host judges idleness from vfio interrupts",
                            self.sampler.note)
            else:
                log.info("%s", self.sampler.note)
        live = sorted((t.lease for t in self.leases.values() if not t.ended), key=lambda x: x.get("granted_at") or 0)
        self.map = map_devices(self.sampler.devices, live)
        for idx, gid in sorted(self.map.gpu_of.items()):
            log.info("guest GPU %d -> %s (matched by %s)", idx, gid, self.map.how[idx])
        if self.map.unmapped and self.sampler.available:
            log.warning("no guest GPU found for %s", ", ".join(self.map.unmapped))

    def _owner(self, gpu_id: str) -> Tracked | None:
        for t in self.leases.values():
            if not t.ended and gpu_id in t.gpu_ids:
                return t
        return None

    # -- sampling -------------------------------------------------------------------------------------------------
    async def sample(self) -> int:
        """Read every GPU once and buffer a sample for each leased one; returns how many were buffered."""
        if self.sampler is None or not self.sampler.available:
            return 0
        try:
            now = self.clock()
            readings = (await asyncio.to_thread(self.sampler.read, now) if self.sampler.blocks
                        else self.sampler.read(now))
        except Exception as exc:  # the driver may fail mid-lease (GPU unplugged); keep heartbeating
            log.warning("sampling failed: %s", exc)
            return 0
        self.last_readings = readings
        n = 0
        for r in readings:
            gpu_id = self.map.gpu_of.get(r.index)
            t = self._owner(gpu_id) if gpu_id else None
            if t is None or r.util_pct is None:
                continue
            s: dict[str, Any] = {"ts": r.ts, "gpu": gpu_id, "util_pct": max(0.0, min(100.0, r.util_pct)),
                                 "mem_used_bytes": max(0, int(r.mem_used_bytes or 0))}
            if r.work_rate is not None:
                s["work_rate"] = r.work_rate
            t.buffer.add(s)
            n += 1
        for t in self.leases.values():
            if t.buffer.dropped > t.reported_drops:
                log.warning("lease %s: %d sample(s) dropped so far (buffer of %d full while the host was away)",
                            t.id, t.buffer.dropped, t.buffer.max_len)
                t.reported_drops = t.buffer.dropped
        return n

    # -- heartbeats -----------------------------------------------------------------------------------------------
    async def heartbeat(self, t: Tracked, *, retries: int = 0) -> dict[str, Any] | None:
        """Send everything buffered (batches of batch_max), at least one heartbeat; act on the last reply.

        Returns the reply, or None when the host could not be reached (the samples stay buffered).
        """
        reply = None
        while True:
            batch = t.buffer.peek(self.cfg.batch_max)
            try:
                reply = await self.client.heartbeat(t.id, batch, retries=retries)
            except HostUnreachable as exc:
                self._host_down(exc.message)
                return None
            except ApiError as exc:
                if exc.status >= 500:
                    self._host_down(exc.message)
                    return None
                if exc.status == 400 and self._reject_one(t, batch, exc):
                    continue
                if exc.status in (404, 409):
                    self._ended(t, "GONE" if exc.status == 404 else "ENDED", exc.server_message)
                    return None
                raise  # 401/403/413/415: configuration or client errors; the caller reports them
            self._host_up()
            t.buffer.commit(batch)
            t.sent += int(reply.get("accepted", len(batch)))
            t.heartbeats += 1
            if not len(t.buffer) or not batch:
                break
        t.last_reply = reply
        await self.handle_reply(t, reply)
        return reply

    def _reject_one(self, t: Tracked, batch: list[dict[str, Any]], exc: ApiError) -> bool:
        """A 400 naming samples[i]: drop that one sample (it would block the buffer forever) and go on."""
        m = _SAMPLE_FIELD.match(exc.field or "")
        if m and int(m.group(1)) < len(batch):
            log.warning("lease %s: host refused a sample: %s; dropping it", t.id, exc.server_message)
            t.buffer.reject(batch[int(m.group(1))])
            return True
        if batch:  # not about one sample: drop the batch rather than resend it forever
            log.error("lease %s: host refused a heartbeat batch: %s; dropping %d samples", t.id, exc.message,
                      len(batch))
            for s in batch:
                t.buffer.reject(s)
            return True
        raise exc

    def _host_down(self, why: str) -> None:
        if self.host_down_since is None:
            self.host_down_since = self.clock()
            log.warning("host agent unreachable, buffering samples: %s", why)

    def _host_up(self) -> None:
        if self.host_down_since is not None:
            log.info("host agent reachable again after %.0f s", self.clock() - self.host_down_since)
            self.host_down_since = None

    def _ended(self, t: Tracked, state: str, note: str | None) -> None:
        if t.ended is None:
            t.ended, t.end_note = state, note
            log.info("lease %s is over (%s)%s", t.id, state, f": {note}" if note else "")
            self.refresh_devices(reopen=False)

    async def handle_reply(self, t: Tracked, reply: Mapping[str, Any]) -> None:
        """Warnings, reclaim notices, the end of the lease, renewal."""
        state = str(reply.get("state", ""))
        t.lease["state"] = state
        if reply.get("expires_at") is not None:
            t.lease["expires_at"] = reply["expires_at"]
        if state == "ACTIVE" and int(reply.get("granted_gpus") or 0) > len(t.gpu_ids):
            await self._topped_up(t)
        if state in TERMINAL:
            self._ended(t, state, None)
            return
        reclaim = reply.get("reclaim") or {}
        codes = {w.get("code"): w for w in reply.get("warnings") or ()}
        if "move" in codes and t.moved_for != (codes["move"].get("from"), codes["move"].get("to")):
            await self.move(t, codes["move"])
        if "reclaim_notice" in codes or reclaim.get("notice") == "reclaim":
            if not t.reclaiming:
                why = "preempted" if reclaim.get("preempted_by") else str((codes.get("reclaim_notice") or {}).get(
                    "reason") or "idle")
                await self.reclaim(t, reclaim.get("notice_deadline"), why)
            return
        if "idle_strike_one" in codes or reclaim.get("notice") == "warning":
            strike = reclaim.get("strike_at") or "warning"
            if t.warned_for != strike:  # once per strike, not on every heartbeat
                t.warned_for = strike
                recheck = reclaim.get("recheck_at")
                when = f" in {recheck - self.clock():.0f} s" if recheck else ""
                log.warning("lease %s: the host saw its GPUs idle (strike one); they will be reclaimed if still "
                            "idle at the recheck%s", t.id, when)
                if self.cfg.on_warning:
                    t.hook_tasks.append(asyncio.create_task(run_hook(
                        self.cfg.on_warning, self._hook_env(t, "warning", recheck), self.cfg.hook_timeout_s,
                        "warning")))
        elif t.warned_for is not None and not reclaim.get("strike_at"):
            log.info("lease %s: strike cleared, the GPUs are busy again", t.id)
            t.warned_for = None
        if "detach_pending" in codes and not t.detach_pending_seen:
            t.detach_pending_seen = True
            log.warning("lease %s: the host is waiting for this guest to let go of the GPU (detach pending)", t.id)
            if self.cfg.stop_gpu_users:
                await stop_processes(self.gpu_users(t), self.cfg.stop_grace_s)
        if self.auto_renew and state == "ACTIVE":
            await self._maybe_renew(t)

    async def move(self, t: Tracked, notice: Mapping[str, Any]) -> None:
        """The host attached a GPU to move to: see it, run `on_move` (the job moves its work), confirm, so the host
        detaches the old GPU now (without a confirmation it does at the deadline). A failing hook confirms nothing."""
        t.moved_for = (notice.get("from"), notice.get("to"))
        log.warning("lease %s: the host moves it from %s to %s (attached now); deadline %s", t.id, notice.get("from"),
                    notice.get("to"), notice.get("deadline"))
        try:
            body = await self.client.get_lease(t.id)
            t.lease["devices"] = body.get("devices") or []
        except (ApiError, HostUnreachable) as exc:
            log.warning("lease %s: its devices could not be read: %s", t.id, exc.message)
        self.refresh_devices(reopen=True)
        deadline = notice.get("deadline")
        if self.cfg.on_move:
            env = {**self._hook_env(t, "move", deadline), "HOSTAGENT_MOVE_FROM": str(notice.get("from")),
                   "HOSTAGENT_MOVE_TO": str(notice.get("to"))}
            left = (deadline - self.clock()) if deadline is not None else self.cfg.hook_timeout_s
            rc = await run_hook(self.cfg.on_move, env, min(self.cfg.hook_timeout_s, max(1.0, left - 2.0)), "move")
            if rc != 0:
                log.error("lease %s: the move hook failed (%s); not confirming: the host detaches %s at the deadline",
                          t.id, rc, notice.get("from"))
                return
        try:
            _, body = await self.client.request("POST", f"/v1/leases/{t.id}/move/done")
        except (ApiError, HostUnreachable) as exc:
            log.warning("lease %s: confirming the move failed: %s", t.id, exc.message)
            return
        if isinstance(body, dict) and body.get("devices") is not None:  # the old GPU has gone (or is going)
            t.lease["devices"] = body["devices"]
            self.refresh_devices(reopen=False)
        log.info("lease %s: moved to %s; the host detaches %s", t.id, notice.get("to"), notice.get("from"))

    async def _topped_up(self, t: Tracked) -> None:
        """The host added GPUs to a partial lease: read its devices again and sample the new ones too."""
        try:
            body = await self.client.get_lease(t.id)
        except (ApiError, HostUnreachable) as exc:
            log.warning("lease %s: the host topped it up but its devices could not be read: %s", t.id, exc.message)
            return
        before = set(t.gpu_ids)
        t.lease["devices"] = body.get("devices") or []
        added = [g for g in t.gpu_ids if g not in before]
        log.warning("lease %s topped up by the host: now %d GPU(s) (%s added)", t.id, len(t.gpu_ids),
                    ", ".join(added) or "none")
        self.refresh_devices(reopen=True)

    async def _maybe_renew(self, t: Tracked) -> None:
        expires = t.lease.get("expires_at")
        if expires is None or expires - self.clock() > 3 * self.cfg.heartbeat_interval_s:
            return
        try:
            body = await self.client.renew(t.id)
        except (ApiError, HostUnreachable) as exc:
            log.warning("lease %s: renewal failed: %s", t.id, exc.message)
            return
        t.lease["expires_at"] = body.get("expires_at")
        log.info("lease %s renewed until %s", t.id, body.get("expires_at"))

    def _hook_env(self, t: Tracked, notice: str, deadline: float | None, reason: str | None = None) -> dict[str, str]:
        env = {"HOSTAGENT_LEASE_ID": t.id, "HOSTAGENT_GPU_IDS": ",".join(t.gpu_ids), "HOSTAGENT_NOTICE": notice,
               "HOSTAGENT_URL": self.client.url}
        if reason is not None:
            env["HOSTAGENT_NOTICE_REASON"] = reason
        if deadline is not None:
            env["HOSTAGENT_DEADLINE"] = f"{deadline:.3f}"
        idx = [self.map.index_of(g) for g in t.gpu_ids]
        env["HOSTAGENT_GUEST_GPUS"] = ",".join(str(i) for i in idx if i is not None)
        return env

    def gpu_users(self, t: Tracked) -> list[int]:
        """PIDs using the lease's GPUs (NVML's view) plus `run`'s command."""
        mine = {self.map.index_of(g) for g in t.gpu_ids}
        pids = {p for r in self.last_readings if r.index in mine for p in (r.processes or ())}
        return sorted(pids | set(self.extra_gpu_users()))

    async def reclaim(self, t: Tracked, deadline: float | None, reason: str = "idle") -> None:
        """The reclaim notice (`reason`: idle, or preempted by a request of higher priority): pre-release hook, stop
        GPU users if configured, flush, release cooperatively."""
        t.reclaiming = True
        left = (deadline - self.clock()) if deadline is not None else self.cfg.hook_timeout_s
        log.warning("lease %s: reclaim notice (%s), releasing cooperatively (%.0f s before the host detaches)", t.id,
                    reason, left)
        if self.cfg.on_reclaim:
            budget = min(self.cfg.hook_timeout_s, max(1.0, left - 2.0))
            await run_hook(self.cfg.on_reclaim, self._hook_env(t, "reclaim", deadline, reason), budget,
                           "pre-release")
        if self.cfg.stop_gpu_users:
            left = (deadline - self.clock()) if deadline is not None else self.cfg.stop_grace_s
            stopped = await stop_processes(self.gpu_users(t), min(self.cfg.stop_grace_s, max(0.5, left - 1.0)))
            if stopped:
                log.info("lease %s: stopped GPU users %s", t.id, stopped)
        await self.sample()
        await self.flush(t)
        await self.release(t, "reclaim notice")

    async def release(self, t: Tracked, why: str) -> str | None:
        """DELETE the lease; returns its state (RELEASED, or DETACH_PENDING while the guest still holds it)."""
        if t.ended:
            return t.ended
        try:
            status, body = await self.client.release(t.id)
        except ApiError as exc:
            if exc.status == 404:
                self._ended(t, "GONE", exc.server_message)
                return t.ended
            raise
        state = str(body.get("state", "RELEASED"))
        if status == 202:
            log.warning("lease %s released (%s) but the detach is pending: the guest has not let go of the GPU", t.id,
                        why)
        else:
            log.info("lease %s released (%s): %s", t.id, why, state)
        t.lease.update(body)
        self._ended(t, state, why)
        return state

    async def flush(self, t: Tracked, *, retries: int | None = None) -> dict[str, Any] | None:
        """Send what is buffered now, with the client's retries (used before a release and on exit)."""
        if t.ended:
            return None
        return await self.heartbeat(t, retries=self.client.retries if retries is None else retries)

    # -- the loops ------------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, *, discover: Callable[[], Awaitable[None]] | None = None) -> None:
        """Sample every sample_interval_s and heartbeat every heartbeat_interval_s until `stop` is set."""
        sampler_task = asyncio.create_task(self._sample_loop(stop))
        try:
            while not stop.is_set():
                if discover is not None:
                    await discover()
                for t in list(self.leases.values()):
                    if not t.ended:
                        await self.heartbeat(t)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.cfg.heartbeat_interval_s)
        finally:
            sampler_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler_task

    async def _sample_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.cfg.sample_interval_s)

    async def close(self) -> None:
        """Wait for hooks still running, release the sampler."""
        for t in self.leases.values():
            for task in t.hook_tasks:
                with contextlib.suppress(Exception):
                    await task
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None

    def summary(self, t: Tracked) -> str:
        """One line: what the heartbeats carried and what was lost."""
        lost = f", {t.buffer.dropped} dropped (buffer full)" if t.buffer.dropped else ""
        bad = f", {t.buffer.rejected} refused by the host" if t.buffer.rejected else ""
        left = f", {len(t.buffer)} unsent" if len(t.buffer) else ""
        return f"lease {t.id}: {t.sent} samples in {t.heartbeats} heartbeats{lost}{bad}{left}"
