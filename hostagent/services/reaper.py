"""The reaper: an APScheduler job that checks ACTIVE leases and reclaims GPUs after two idle strikes.

Strike state lives in the lease (journaled), so a restart between the strikes neither forgets strike one nor
reclaims early. Reclaim is cooperative first: a notice in the heartbeat reply and lease state, a short window
for the guest to release, then detach -> DEVICE_REMOVED -> give back (or DETACH_PENDING).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from hostagent.domain.errors import Conflict, HostAgentError
from hostagent.domain.lease import Lease, LeaseState
from hostagent.domain.reclaim import Action, Activity, IdlePolicy, Sample, Strikes, interrupt_delta, judge, step
from hostagent.services.faults import crash_point
from hostagent.services.leases import LeaseManager

log = logging.getLogger("hostagent.reaper")
S = LeaseState


@dataclass(frozen=True, slots=True)
class ReaperSettings:
    """Timing and policy of the reaper."""

    enabled: bool = True
    check_interval_s: float = 3600.0
    grace_s: float = 1200.0
    notice_window_s: float = 60.0
    policy: IdlePolicy = IdlePolicy()
    per_priority: tuple[tuple[int, float, float], ...] = ()  # (min priority, check_interval_s, grace_s)

    def timing(self, priority: int) -> tuple[float, float]:
        """(check interval, grace) for a priority class: the highest class at or below it wins."""
        best = (self.check_interval_s, self.grace_s)
        for min_prio, interval, grace in sorted(self.per_priority):
            if priority >= min_prio:
                best = (interval, grace)
        return best

    @property
    def tick_s(self) -> float:
        """How often the job wakes to see which leases are due."""
        shortest = min([self.check_interval_s, self.grace_s, self.notice_window_s]
                       + [min(i, g) for _, i, g in self.per_priority])
        return max(0.2, min(30.0, shortest / 4))


class Reaper:
    """Owns the scheduler job; every decision goes through the pure policy in domain.reclaim."""

    def __init__(self, manager: LeaseManager, settings: ReaperSettings, *,
                 samples_since: Callable[[str, float], Sequence[Mapping[str, Any]]],
                 read_interrupts: Callable[[], Mapping[str, int] | None],
                 on_reclaim: Callable[[Lease, str], None] | None = None) -> None:
        self.m = manager
        self.settings = settings
        self.samples_since = samples_since
        self.read_interrupts = read_interrupts
        self.on_reclaim = on_reclaim
        self.scheduler: AsyncIOScheduler | None = None
        self.last_verdicts: dict[str, tuple[float, str, str]] = {}  # lease -> (ts, activity, reason)
        self.disputed: dict[str, str] = {}  # lease -> why its guest's and the host's figures disagree

    async def start(self) -> None:
        """Schedule the check job on the running loop. With idle reclaim off (`reclaim.enabled = false`) the job
        still runs, for the deadlines of the reclaim notices that preemption gives."""
        self.scheduler = AsyncIOScheduler()
        self.scheduler.add_job(self.tick, "interval", seconds=self.settings.tick_s, id="reaper-tick",
                               max_instances=1, coalesce=True)
        self.scheduler.start()

    async def stop(self) -> None:
        """Stop the scheduler."""
        if self.scheduler is not None:
            self.scheduler.shutdown(wait=False)
            self.scheduler = None

    def next_check(self, lease: Lease) -> float | None:
        """When this lease is next examined."""
        if lease.state is not S.ACTIVE:
            return None
        if lease.notice == "reclaim":
            return lease.notice_deadline
        if not self.settings.enabled:
            return None
        if lease.strike_at is not None and lease.recheck_at is not None:
            return lease.recheck_at
        interval, _ = self.settings.timing(lease.request.priority)
        return (lease.last_check_at or lease.granted_at or lease.created_at) + interval

    def status(self) -> list[dict[str, Any]]:
        """Every live lease's strike state and next check (for `hostagent reaper status` and the dashboard)."""
        out = []
        for lease in sorted(self.m.leases.values(), key=lambda x: x.created_at):
            if lease.state not in (S.ACTIVE, S.DETACH_PENDING, S.RELEASING, S.DETACHING):
                continue
            v = self.last_verdicts.get(lease.id)
            out.append({
                "lease_id": lease.id, "domain": lease.domain_name, "gpus": list(lease.gpu_ids),
                "state": lease.state.value, "paused": lease.reclaim_paused,
                "strike": "two (reclaiming)" if lease.notice == "reclaim" else ("one" if lease.strike_at else "none"),
                "strike_at": lease.strike_at, "recheck_at": lease.recheck_at,
                "notice_deadline": lease.notice_deadline, "next_check": self.next_check(lease),
                "last_verdict": None if v is None else {"ts": v[0], "activity": v[1], "reason": v[2]},
                "disputed": self.disputed.get(lease.id),
            })
        return out

    async def tick(self) -> None:
        """Examine every lease that is due."""
        now = self.m.clock()
        irq = None
        try:
            irq = await self.m._run(self.read_interrupts)
        except Exception as exc:  # an unreadable /proc/interrupts must not stop the reaper
            log.warning("cannot read /proc/interrupts: %s", exc)
        for lease in list(self.m.leases.values()):
            due = self.next_check(lease)
            if due is None or now < due:
                continue
            try:
                await self.check(lease.id, now, irq)
            except HostAgentError as exc:
                log.warning("reaper check of %s failed: %s", lease.id, exc.message, extra={"lease_id": lease.id})

    async def check(self, lease_id: str, now: float, irq: Mapping[str, int] | None) -> Action | None:
        """One check of one lease (also used by tests with a controlled clock)."""
        async with self.m.lease_lock(lease_id):
            lease = self.m.leases.get(lease_id)
            if lease is None or lease.state is not S.ACTIVE:
                return None
            if lease.notice == "reclaim":
                if lease.notice_deadline is not None and now >= lease.notice_deadline:
                    reclaim_due = True
                else:
                    return None
            else:
                reclaim_due = False
        if reclaim_due and lease.preempted_by:
            return await self._preempt(lease)
        if reclaim_due:
            await self._reclaim(lease, "the guest did not release within the notice window")
            return Action.RECLAIM
        if not self.settings.enabled:
            return None
        return await self._judge(lease, now, irq)

    async def _preempt(self, lease: Lease) -> Action:
        """A preempted lease's notice ran out: reclaim it while the request it was preempted for still waits; if
        that request was granted elsewhere or ended meanwhile, the notice is withdrawn and the lease keeps its GPUs."""
        head = self.m.leases.get(lease.preempted_by or "")
        if head is not None and head.state is S.QUEUED:
            await self._reclaim(lease, f"preempted by {head.id}: the guest did not release within the notice window",
                                reason="reclaimed: preempted")
            return Action.RECLAIM
        async with self.m.lease_lock(lease.id):
            current = self.m.leases.get(lease.id)
            if current is None or current.state is not S.ACTIVE or current.preempted_by != lease.preempted_by:
                return Action.NONE
            why = f"{lease.preempted_by} no longer waits"
            await self.m._write(current.with_changes(notice=None, notice_deadline=None, preempted_by=None,
                                                     strike_at=None, recheck_at=None),
                                current.state, "reaper", f"preemption withdrawn: {why}")
            await self.m._run(self.m.journal.event, "preempt-withdrawn", actor="reaper", lease_id=lease.id,
                              gpu_id=",".join(lease.gpu_ids), detail=why)
        return Action.CLEAR

    async def _judge(self, lease: Lease, now: float, irq: Mapping[str, int] | None) -> Action:
        functions = [a for d in lease.devices for a in d.functions]
        baseline = dict(lease.irq_baseline) if lease.irq_baseline else None
        delta = interrupt_delta(baseline, irq, functions)
        since = lease.last_check_at or lease.granted_at or lease.created_at
        raw = await self.m._run(self.samples_since, lease.id, since)
        samples = [Sample(float(s["ts"]), float(s["util_pct"]), int(s.get("mem_used_bytes") or 0)) for s in raw]
        verdict = judge(samples, delta, lease_age_s=now - (lease.granted_at or lease.created_at),
                        paused=lease.reclaim_paused, policy=self.settings.policy)
        self.last_verdicts[lease.id] = (now, verdict.activity.value, verdict.reason)
        await self._note_dispute(lease, verdict.disputed)
        _, grace = self.settings.timing(lease.request.priority)
        strikes, action = step(Strikes(lease.strike_at, lease.recheck_at), verdict.activity, now, grace)
        new_baseline = tuple((f, int(irq.get(f, 0))) for f in functions) if irq is not None else lease.irq_baseline
        async with self.m.lease_lock(lease.id):
            current = self.m.leases.get(lease.id)
            if current is None or current.state is not S.ACTIVE:
                return Action.NONE
            changes: dict[str, Any] = {"last_check_at": now, "irq_baseline": new_baseline}
            detail = f"idle check: {verdict.activity.value} ({verdict.reason})"
            kind = None
            if action is Action.STRIKE_ONE:
                changes.update(strike_at=strikes.strike_at, recheck_at=strikes.recheck_at, notice="warning",
                               notice_deadline=None)
                kind = "strike-one"
            elif action is Action.CLEAR:
                changes.update(strike_at=None, recheck_at=None, notice=None, notice_deadline=None)
                kind = "strike-cleared"
            elif action is Action.RECLAIM:
                changes.update(notice="reclaim", notice_deadline=now + self.settings.notice_window_s)
                kind = "strike-two"
            await self.m._write(current.with_changes(**changes), current.state, "reaper",
                                detail if kind else None)
            if kind:
                await self.m._run(self.m.journal.event, kind, actor="reaper", lease_id=lease.id,
                                  gpu_id=",".join(lease.gpu_ids), detail=verdict.reason)
                crash_point(f"reaper:{kind}")
        if action is Action.RECLAIM and self.settings.notice_window_s <= 0:
            await self._reclaim(lease, "no notice window configured")
        return action

    async def _note_dispute(self, lease: Lease, disputed: str | None) -> None:
        """Flag (or unflag) a lease whose guest reports busy while the host's signal is flat; the journal gets an
        event when a dispute starts, so the operator sees both figures once, not at every check."""
        if disputed is None:
            self.disputed.pop(lease.id, None)
            return
        started = lease.id not in self.disputed
        self.disputed[lease.id] = disputed
        if started:
            log.warning("lease %s: %s", lease.id, disputed, extra={"lease_id": lease.id})
            await self.m._run(self.m.journal.event, "guest-host-disagree", actor="reaper", lease_id=lease.id,
                              gpu_id=",".join(lease.gpu_ids), detail=disputed)

    async def activity_seen(self, lease_id: str, reason: str) -> None:
        """A busy heartbeat between the strikes clears strike one at once, unless the host's signal disputes the
        guest's word and the policy believes the host (reclaim.guest_busy_host_idle = reclaim)."""
        if lease_id in self.disputed and self.settings.policy.guest_busy_host_idle == "reclaim":
            return
        async with self.m.lease_lock(lease_id):
            lease = self.m.leases.get(lease_id)
            if lease is None or lease.state is not S.ACTIVE or lease.strike_at is None or lease.notice == "reclaim":
                return
            await self.m._write(lease.with_changes(strike_at=None, recheck_at=None, notice=None), lease.state,
                                "reaper", f"strike cleared: {reason}")
            await self.m._run(self.m.journal.event, "strike-cleared", actor="reaper", lease_id=lease_id,
                              detail=reason)

    async def _reclaim(self, lease: Lease, why: str, reason: str = "reclaimed: idle") -> None:
        log.warning("reclaiming lease %s: %s", lease.id, why, extra={"lease_id": lease.id})
        await self.m._run(self.m.journal.event, "reclaim", actor="reaper", lease_id=lease.id,
                          gpu_id=",".join(lease.gpu_ids), detail=why)
        crash_point("reaper:reclaim")
        done = await self.m.release(lease.id, actor="reaper", reason=reason)
        outcome = done.state.value
        await self.m._run(self.m.journal.event, "reclaim-outcome", actor="reaper", lease_id=lease.id,
                          gpu_id=",".join(lease.gpu_ids), detail=outcome)
        if self.on_reclaim is not None:
            self.on_reclaim(done, why)

    async def set_paused(self, lease_id: str, paused: bool, *, actor: str, domain_uuid: str | None = None) -> Lease:
        """Operator: opt a lease out of (or back into) idle reclaim."""
        lease = self.m.get(lease_id, domain_uuid=domain_uuid)
        async with self.m.lease_lock(lease_id):
            lease = self.m.leases.get(lease_id) or lease
            if lease.state.terminal:
                raise Conflict(f"lease {lease_id} has ended", field="lease_id")
            changes: dict[str, Any] = {"reclaim_paused": paused}
            if paused and lease.notice != "reclaim":
                changes.update(strike_at=None, recheck_at=None, notice=None)
            return await self.m._write(lease.with_changes(**changes), lease.state, actor,
                                       "reclaim paused" if paused else "reclaim resumed")


def host_signal_untrusted(reclaim: Any, detected: Callable[[], str | None]) -> str | None:
    """Why flat vfio interrupt counters prove nothing on this host (None: they are trusted): `reclaim.host_signal`
    decides, or with `auto` what `detected` (host.interrupts.irq_bypass) finds."""
    if reclaim.host_signal == "trusted":
        return None
    if reclaim.host_signal == "untrusted":
        return "reclaim.host_signal = untrusted"
    return detected()


def reaper_settings(reclaim: Any, untrusted: str | None = None) -> ReaperSettings:
    """ReaperSettings from the [reclaim] config section; `untrusted`: see host_signal_untrusted."""
    per = []
    for prio, vals in reclaim.per_priority.items():
        per.append((int(prio), float(vals.get("check_interval_s", reclaim.check_interval_s)),
                    float(vals.get("grace_s", reclaim.grace_s))))
    return ReaperSettings(
        enabled=reclaim.enabled, check_interval_s=reclaim.check_interval_s, grace_s=reclaim.grace_s,
        notice_window_s=reclaim.notice_window_s,
        policy=IdlePolicy(idle_util_pct=reclaim.idle_util_pct, memory_counts_busy=reclaim.memory_counts_busy,
                          min_lease_age_s=reclaim.min_lease_age_s, no_heartbeat=reclaim.no_heartbeat,
                          guest_busy_host_idle=reclaim.guest_busy_host_idle, host_signal_untrusted=untrusted),
        per_priority=tuple(per),
    )


__all__ = ["Activity", "Reaper", "ReaperSettings", "host_signal_untrusted", "reaper_settings"]
