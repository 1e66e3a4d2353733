"""The two-strike idle policy, pure: properties with hypothesis."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hostagent.domain.reclaim import (
    Action,
    Activity,
    IdlePolicy,
    Sample,
    Strikes,
    interrupt_delta,
    judge,
    step,
)

POL = IdlePolicy(idle_util_pct=5, min_lease_age_s=0)


def test_busy_guest_is_busy() -> None:
    v = judge([Sample(1, 2), Sample(2, 40)], 0, lease_age_s=1e4, paused=False, policy=POL)
    assert v.activity is Activity.BUSY and "above 5 %" in v.reason


def test_rising_interrupts_beat_idle_guest_samples() -> None:
    v = judge([Sample(1, 0)], 17, lease_age_s=1e4, paused=False, policy=POL)
    assert v.activity is Activity.BUSY and "17 vfio interrupts" in v.reason


def test_idle_guest_and_quiet_host_is_idle() -> None:
    assert judge([Sample(1, 0), Sample(2, 5)], 0, lease_age_s=1e4, paused=False, policy=POL).activity is Activity.IDLE


def test_memory_held_counts_as_busy_unless_configured() -> None:
    s = [Sample(1, 0, mem_used_bytes=4 * 2**30)]
    assert judge(s, 0, lease_age_s=1e4, paused=False, policy=POL).activity is Activity.BUSY
    lax = IdlePolicy(idle_util_pct=5, min_lease_age_s=0, memory_counts_busy=False)
    assert judge(s, 0, lease_age_s=1e4, paused=False, policy=lax).activity is Activity.IDLE


def test_no_heartbeats_judged_by_host_alone_and_said_so() -> None:
    v = judge([], 0, lease_age_s=1e4, paused=False, policy=POL)
    assert v.activity is Activity.IDLE and "host interrupts alone" in v.reason
    never = IdlePolicy(min_lease_age_s=0, no_heartbeat="never-idle")
    assert judge([], 0, lease_age_s=1e4, paused=False, policy=never).activity is Activity.UNKNOWN


def test_exempt_when_paused_or_young() -> None:
    assert judge([Sample(1, 0)], 0, lease_age_s=1e4, paused=True, policy=POL).activity is Activity.EXEMPT
    young = IdlePolicy(min_lease_age_s=600)
    assert judge([Sample(1, 0)], 0, lease_age_s=10, paused=False, policy=young).activity is Activity.EXEMPT


@given(st.lists(st.tuples(st.floats(0, 100), st.integers(0, 2**34)), max_size=20), st.booleans())
def test_missing_data_is_never_idle_unless_the_host_says_so(raw: list, host_known: bool) -> None:
    samples = [Sample(i, u, m) for i, (u, m) in enumerate(raw)]
    v = judge(samples, 0 if host_known else None, lease_age_s=1e4, paused=False, policy=POL)
    if not samples and not host_known:
        assert v.activity is Activity.UNKNOWN
    if v.activity is Activity.IDLE:
        assert samples or host_known
        assert all(s.util_pct <= POL.idle_util_pct for s in samples)


def test_interrupt_delta() -> None:
    fns = ["0000:3b:00.0", "0000:3b:00.1"]
    assert interrupt_delta(None, {"0000:3b:00.0": 5}, fns) is None
    assert interrupt_delta({"0000:3b:00.0": 5}, {"0000:3b:00.0": 9, "0000:3b:00.1": 1}, fns) == 5
    assert interrupt_delta({"0000:3b:00.0": 50}, {"0000:3b:00.0": 3}, fns) == 3  # counter restarted
    assert interrupt_delta({}, {}, fns) is None


def test_two_strikes_then_reclaim() -> None:
    s, a = step(Strikes(), Activity.IDLE, 100.0, grace_s=60)
    assert a is Action.STRIKE_ONE and s == Strikes(100.0, 160.0)
    s, a = step(s, Activity.IDLE, 130.0, grace_s=60)
    assert a is Action.NONE  # too early
    s, a = step(s, Activity.UNKNOWN, 165.0, grace_s=60)
    assert a is Action.NONE and s.strike_at == 100.0  # unknown neither forgets nor reclaims
    _, a = step(s, Activity.IDLE, 170.0, grace_s=60)
    assert a is Action.RECLAIM


def test_strike_two_waits_for_the_recheck_even_past_the_grace_period() -> None:
    """A recheck set later than strike one plus the grace period (the reaper's own schedule) is when strike two may
    come: idle at strike one + grace, before the recheck, changes nothing; idle at the recheck reclaims. A
    recheck set earlier than the grace period allows still waits for the grace period."""
    late = Strikes(100.0, 300.0)
    assert step(late, Activity.IDLE, 200.0, grace_s=60) == (late, Action.NONE)
    assert step(late, Activity.IDLE, 300.0, grace_s=60) == (late, Action.RECLAIM)
    early = Strikes(100.0, 120.0)
    assert step(early, Activity.IDLE, 130.0, grace_s=60) == (early, Action.NONE)
    assert step(early, Activity.IDLE, 160.0, grace_s=60) == (early, Action.RECLAIM)


def test_activity_between_resets() -> None:
    s, _ = step(Strikes(), Activity.IDLE, 0.0, grace_s=10)
    s, a = step(s, Activity.BUSY, 5.0, grace_s=10)
    assert a is Action.CLEAR and s == Strikes()
    s, a = step(s, Activity.IDLE, 20.0, grace_s=10)
    assert a is Action.STRIKE_ONE


@given(st.lists(st.tuples(st.floats(0.0, 50.0), st.sampled_from(list(Activity))), max_size=60),
       st.floats(1.0, 40.0))
@settings(max_examples=500)
def test_reclaim_only_after_two_consecutive_idle_verdicts_grace_apart(steps: list, grace: float) -> None:
    strikes = Strikes()
    now = 0.0
    first_idle_at: float | None = None  # time of the idle verdict that began the current unbroken run
    for dt, verdict in steps:
        now += dt
        strikes, action = step(strikes, verdict, now, grace)
        if verdict in (Activity.BUSY, Activity.EXEMPT):
            first_idle_at = None
        elif verdict is Activity.IDLE and first_idle_at is None:
            first_idle_at = now
        if action is Action.RECLAIM:
            assert verdict is Activity.IDLE
            assert first_idle_at is not None and first_idle_at < now
            assert now - first_idle_at >= grace
            assert strikes.strike_at is not None and now - strikes.strike_at >= grace
            return


def test_a_busy_guest_on_a_quiet_host_is_flagged_and_kept_by_default() -> None:
    v = judge([Sample(1, 90), Sample(2, 95)], 0, lease_age_s=1e4, paused=False, policy=POL)
    assert v.activity is Activity.BUSY and v.disputed is not None
    assert "2 of 2 samples above 5 %" in v.disputed and "0 vfio interrupts" in v.disputed


def test_a_busy_guest_on_a_quiet_host_is_idle_when_the_policy_believes_the_host() -> None:
    pol = IdlePolicy(idle_util_pct=5, min_lease_age_s=0, guest_busy_host_idle="reclaim")
    v = judge([Sample(1, 90)], 0, lease_age_s=1e4, paused=False, policy=pol)
    assert v.activity is Activity.IDLE and v.disputed is not None and "guest_busy_host_idle" in v.reason
    held = judge([Sample(1, 0, 2**33)], 0, lease_age_s=1e4, paused=False, policy=pol)
    assert held.activity is Activity.IDLE and "MiB of GPU memory" in (held.disputed or "")


def test_no_dispute_without_a_host_reading_or_with_host_activity() -> None:
    pol = IdlePolicy(idle_util_pct=5, min_lease_age_s=0, guest_busy_host_idle="reclaim")
    for irq in (None, 3):
        v = judge([Sample(1, 90)], irq, lease_age_s=1e4, paused=False, policy=pol)
        assert v.activity is Activity.BUSY and v.disputed is None
    quiet = judge([Sample(1, 1)], 0, lease_age_s=1e4, paused=False, policy=pol)
    assert quiet.activity is Activity.IDLE and quiet.disputed is None


def test_an_untrusted_host_signal_never_makes_a_lease_idle_alone() -> None:
    """With posted interrupts the host's counters stay flat while the GPU works: none counted proves nothing."""
    from hostagent.domain.reclaim import Activity, IdlePolicy, judge

    why = "VT-d posted interrupts"
    untrusted = IdlePolicy(min_lease_age_s=0, host_signal_untrusted=why)
    v = judge([], 0, lease_age_s=10_000, paused=False, policy=untrusted)
    assert v.activity is Activity.UNKNOWN and why in v.reason
    assert judge([], 0, lease_age_s=10_000, paused=False, policy=IdlePolicy(min_lease_age_s=0)).activity is Activity.IDLE
    # counted interrupts still prove it busy
    assert judge([], 7, lease_age_s=10_000, paused=False, policy=untrusted).activity is Activity.BUSY
    # a busy guest is not disputed by counters that cannot see its interrupts
    from hostagent.domain.reclaim import Sample

    busy = [Sample(1.0, 90.0)]
    v = judge(busy, 0, lease_age_s=10_000, paused=False, policy=untrusted)
    assert v.activity is Activity.BUSY and v.disputed is None
    v = judge(busy, 0, lease_age_s=10_000, paused=False,
              policy=IdlePolicy(min_lease_age_s=0, host_signal_untrusted=why, guest_busy_host_idle="reclaim"))
    assert v.activity is Activity.BUSY
    # the guest's own idle samples still count, and the reason says the host could not be asked
    v = judge([Sample(1.0, 0.0)], 0, lease_age_s=10_000, paused=False, policy=untrusted)
    assert v.activity is Activity.IDLE and why in v.reason
