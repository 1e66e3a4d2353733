"""The two-strike idle policy, pure: what 'idle' means over a window, and what a check does to a lease's strikes."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class Activity(str, enum.Enum):
    """One check's verdict."""

    IDLE = "idle"
    BUSY = "busy"
    UNKNOWN = "unknown"  # not enough data: never counts as idle
    EXEMPT = "exempt"  # paused by an operator, or too young


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    """Knobs of the idle verdict."""

    idle_util_pct: float = 5.0
    memory_counts_busy: bool = True
    memory_busy_bytes: int = 512 * 1024**2  # guest memory use above this means a process holds the GPU
    min_lease_age_s: float = 600.0
    no_heartbeat: str = "host-signal"  # host-signal | never-idle
    guest_busy_host_idle: str = "flag"  # flag: the guest's word wins, flagged | reclaim: the host's wins
    host_signal_untrusted: str | None = None  # why flat host interrupt counters prove nothing here (IRQ bypass)


@dataclass(frozen=True, slots=True)
class Sample:
    """A guest usage sample, reduced to what the policy reads."""

    ts: float
    util_pct: float
    mem_used_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    """The verdict and the sentence recorded with it."""

    activity: Activity
    reason: str
    disputed: str | None = None  # the guest reports busy while the host saw nothing: both figures, for the operator


def interrupt_delta(before: Mapping[str, int] | None, now: Mapping[str, int] | None,
                    functions: Sequence[str]) -> int | None:
    """Interrupts raised by the device's functions since `before`; None when either reading is missing."""
    if before is None or now is None:
        return None
    if not any(f in now for f in functions) and not any(f in before for f in functions):
        return None
    total = 0
    for f in functions:
        a, b = before.get(f, 0), now.get(f, 0)
        # A counter that went down (vfio fds re-opened, guest rebooted) restarted: count what it shows now.
        total += b - a if b >= a else b
    return total


def judge(samples: Sequence[Sample], irq_delta: int | None, *, lease_age_s: float, paused: bool,
          policy: IdlePolicy) -> Verdict:
    """Is the lease idle over the window? Busy beats idle; missing data is never idle unless the host says so."""
    if paused:
        return Verdict(Activity.EXEMPT, "reclaim paused by an operator")
    if lease_age_s < policy.min_lease_age_s:
        return Verdict(Activity.EXEMPT, f"lease younger than {policy.min_lease_age_s:.0f} s")
    if irq_delta is not None and irq_delta > 0:
        return Verdict(Activity.BUSY, f"host: {irq_delta} vfio interrupts since the last check")
    untrusted = ""
    if irq_delta == 0 and policy.host_signal_untrusted:
        # counted interrupts prove the device busy, but none counted proves nothing: they may bypass the host
        irq_delta, untrusted = None, f"host interrupt counters not trusted ({policy.host_signal_untrusted})"
    claim = _guest_busy(samples, policy)
    if claim is not None:
        if irq_delta != 0:  # the host has no reading: the guest's word stands
            return Verdict(Activity.BUSY, claim)
        # The host's own signal was readable and flat for the whole window while the guest says busy.
        disputed = f"{claim}, but the host saw 0 vfio interrupts since the last check"
        if policy.guest_busy_host_idle == "reclaim":
            return Verdict(Activity.IDLE, f"host: no vfio interrupts since the last check (the {claim}; "
                                          "reclaim.guest_busy_host_idle = reclaim)", disputed)
        return Verdict(Activity.BUSY, f"{claim} (the host saw no vfio interrupts: flagged for the operator)", disputed)
    if samples:
        host = "no host interrupts" if irq_delta == 0 else untrusted or "host interrupt counters unavailable"
        return Verdict(Activity.IDLE, f"guest: all {len(samples)} samples at or below {policy.idle_util_pct:g} %; {host}")
    if policy.no_heartbeat == "host-signal" and irq_delta == 0:
        return Verdict(Activity.IDLE, "no guest heartbeats in the window; judged by host interrupts alone: none")
    if untrusted:
        return Verdict(Activity.UNKNOWN, f"no guest heartbeats, and {untrusted}: not judged idle")
    return Verdict(Activity.UNKNOWN, "no guest heartbeats and no host interrupt reading: not judged idle")


def _guest_busy(samples: Sequence[Sample], policy: IdlePolicy) -> str | None:
    """What makes the guest's samples say busy, or None."""
    busy = [s for s in samples if s.util_pct > policy.idle_util_pct]
    if busy:
        return (f"guest: {len(busy)} of {len(samples)} samples above {policy.idle_util_pct:g} % "
                f"(max {max(s.util_pct for s in busy):.0f} %)")
    if policy.memory_counts_busy:
        held = [s for s in samples if s.mem_used_bytes > policy.memory_busy_bytes]
        if held:
            return f"guest: a process holds {max(s.mem_used_bytes for s in held) / 2**20:.0f} MiB of GPU memory"
    return None


class Action(str, enum.Enum):
    """What a check does to the lease."""

    NONE = "none"
    STRIKE_ONE = "strike-one"
    CLEAR = "clear"
    RECLAIM = "reclaim"


@dataclass(frozen=True, slots=True)
class Strikes:
    """A lease's strike state (persisted in the journal)."""

    strike_at: float | None = None
    recheck_at: float | None = None


def step(strikes: Strikes, verdict: Activity, now: float, grace_s: float) -> tuple[Strikes, Action]:
    """Advance the two-strike machine by one check.

    Idle with no strike: strike one, recheck after the grace period. Idle again at or after the recheck: reclaim.
    Busy: clears. Unknown or exempt: nothing changes (neither forgets strike one nor reclaims).
    """
    if verdict is Activity.BUSY:
        return (Strikes(), Action.CLEAR) if strikes.strike_at is not None else (strikes, Action.NONE)
    if verdict is not Activity.IDLE:
        if verdict is Activity.EXEMPT and strikes.strike_at is not None:
            return Strikes(), Action.CLEAR
        return strikes, Action.NONE
    if strikes.strike_at is None:
        return Strikes(now, now + grace_s), Action.STRIKE_ONE
    due = strikes.recheck_at if strikes.recheck_at is not None else strikes.strike_at + grace_s
    if now >= due and now - strikes.strike_at >= grace_s:
        return strikes, Action.RECLAIM
    return strikes, Action.NONE
