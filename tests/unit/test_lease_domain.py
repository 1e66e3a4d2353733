"""Pure tests of the lease state machine, request validation, arbitration and ETAs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostagent.domain.errors import Conflict, InvalidInput, InvalidTransition
from hostagent.domain.admission import (
    DAY_S, Ledger, Shadow, TenantUse, backfill_share, gpu_hours, may_backfill, quota_cap, shadow,
)
from hostagent.domain.lease import (
    TERMINAL,
    TRANSITIONS,
    Lease,
    LeaseDevice,
    LeaseRequest,
    LeaseState,
    Quota,
    Verdict,
    Waiting,
    arbitrate,
    estimate_eta,
    new_lease,
    parse_lease_request,
    queue_order,
)

S = LeaseState
NOW = 1_700_000_000.0


def test_every_state_is_reachable_from_requested_through_the_table() -> None:
    seen = {S.REQUESTED}
    frontier = [S.REQUESTED]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(LeaseState)


def test_terminal_states_have_no_exit_and_every_live_state_can_end() -> None:
    assert TERMINAL == {S.RELEASED, S.EXPIRED, S.FAILED}
    for state in LeaseState:
        if state in TERMINAL:
            continue
        seen, frontier = {state}, [state]
        while frontier:
            for nxt in TRANSITIONS[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert seen & TERMINAL, f"{state} can never end"


def test_illegal_transition_raises_with_allowed_list() -> None:
    lease = new_lease("l1", "u", "vm", LeaseRequest(), NOW)
    with pytest.raises(InvalidTransition) as exc:
        lease.transition(S.ACTIVE)
    assert "REQUESTED to ACTIVE" in exc.value.message and "BINDING" in exc.value.message


def test_active_can_not_be_given_back_without_detaching() -> None:
    lease = new_lease("l1", "u", "vm", LeaseRequest(), NOW)
    for s in (S.BINDING, S.ATTACHING, S.ACTIVE):
        lease = lease.transition(s)
    for forbidden in (S.REBINDING, S.RELEASED, S.FAILED):
        with pytest.raises(InvalidTransition):
            lease.transition(forbidden)
    # DETACH_PENDING can only go back to DETACHING or (once confirmed) REBINDING
    assert TRANSITIONS[S.DETACH_PENDING] == {S.DETACHING, S.REBINDING}


@given(st.lists(st.sampled_from(list(LeaseState)), max_size=30))
def test_random_walks_only_follow_the_table(steps: list[LeaseState]) -> None:
    lease = new_lease("l1", "u", "vm", LeaseRequest(), NOW)
    for target in steps:
        if target in TRANSITIONS[lease.state]:
            lease = lease.transition(target)
            assert lease.state is target
        else:
            with pytest.raises(InvalidTransition):
                lease.transition(target)


def test_lease_round_trips_through_json() -> None:
    lease = new_lease("l1", "u", "vm", LeaseRequest(gpus=2, task_type="training", precision="bf16"), NOW)
    lease = lease.transition(S.BINDING, devices=(LeaseDevice("gpu-a", ("0000:3b:00.0", "0000:3b:00.1"),
                                                             ("nvidia", "snd_hda_intel"), 12, ("0000:00:05.0",)),))
    assert Lease.from_dict(lease.to_dict()) == lease


class TestParseRequest:
    def test_defaults(self) -> None:
        r = parse_lease_request({}, now=NOW, max_duration_s=3600)
        assert r == LeaseRequest()

    def test_full(self) -> None:
        body = {"gpus": 2, "task_type": "training", "data_scale": 1e6, "precision": "bf16", "min_memory_gib": 20,
                "duration_s": 600, "priority": 5, "accept_partial": True, "accept_deferred": True,
                "not_after": NOW + 60, "idempotency_key": "k1"}
        r = parse_lease_request(body, now=NOW, max_duration_s=3600)
        assert r.gpus == 2 and r.precision == "bf16" and r.not_after == NOW + 60

    @pytest.mark.parametrize("body,field", [
        ({"gpus": 0}, "gpus"), ({"gpus": "1"}, "gpus"), ({"gpus": True}, "gpus"), ({"gpus": 1.5}, "gpus"),
        ({"precision": "fp17"}, "precision"), ({"duration_s": 7200}, "duration_s"),
        ({"min_memory_gib": -1}, "min_memory_gib"), ({"not_after": NOW - 1}, "not_after"),
        ({"bogus": 1}, "bogus"), ({"task_type": ""}, "task_type"), ({"task_type": "a\nb"}, "task_type"),
        ({"accept_partial": "yes"}, "accept_partial"), ({"priority": 10**9}, "priority"),
        ({"min_memory_gib": float("nan")}, "min_memory_gib"),
    ])
    def test_rejects_with_field(self, body: dict, field: str) -> None:
        with pytest.raises(InvalidInput) as exc:
            parse_lease_request(body, now=NOW, max_duration_s=3600)
        assert exc.value.field == field

    def test_rejects_non_object(self) -> None:
        with pytest.raises(InvalidInput):
            parse_lease_request([1], now=NOW, max_duration_s=3600)


class TestArbitrate:
    def test_grant_when_free(self) -> None:
        a = arbitrate(LeaseRequest(gpus=2), free=3, feasible_total=8, waiting=[])
        assert (a.verdict, a.count) == (Verdict.GRANT, 2)

    def test_partial_only_when_accepted(self) -> None:
        assert arbitrate(LeaseRequest(gpus=4, accept_partial=True), 2, 8, []).count == 2
        assert arbitrate(LeaseRequest(gpus=4), 2, 8, []).verdict is Verdict.REFUSE

    def test_defer_only_when_accepted(self) -> None:
        assert arbitrate(LeaseRequest(accept_deferred=True), 0, 8, []).verdict is Verdict.DEFER
        refused = arbitrate(LeaseRequest(), 0, 8, [])
        assert refused.verdict is Verdict.REFUSE and "accept_deferred" in refused.reason

    def test_never_jumps_a_waiting_request_of_equal_or_higher_priority(self) -> None:
        waiting = [Waiting("w", priority=5, queued_at=1.0, gpus=1)]
        assert arbitrate(LeaseRequest(priority=5, accept_deferred=True), 4, 8, waiting).verdict is Verdict.DEFER
        assert arbitrate(LeaseRequest(priority=6), 4, 8, waiting).verdict is Verdict.GRANT

    def test_impossible_request_is_refused_even_if_deferrable(self) -> None:
        a = arbitrate(LeaseRequest(gpus=9, accept_deferred=True), 8, 8, [])
        assert a.verdict is Verdict.REFUSE and "only 8" in a.reason

    @given(st.integers(1, 16), st.integers(0, 16), st.integers(0, 16), st.booleans(), st.booleans())
    def test_never_grants_more_than_free_or_asked(self, gpus: int, free: int, total: int, partial: bool,
                                                  deferred: bool) -> None:
        free = min(free, total)
        a = arbitrate(LeaseRequest(gpus=gpus, accept_partial=partial, accept_deferred=deferred), free, total, [])
        assert a.count <= min(free, gpus)
        if a.verdict is Verdict.PARTIAL:
            assert partial and 0 < a.count < gpus
        if a.verdict is Verdict.DEFER:
            assert deferred


def test_queue_order_is_priority_then_age() -> None:
    w = [Waiting("a", 0, 1.0, 1), Waiting("b", 5, 3.0, 1), Waiting("c", 5, 2.0, 1)]
    assert [x.lease_id for x in queue_order(w)] == ["c", "b", "a"]


def test_queue_order_keeps_request_order_among_equal_times() -> None:
    w = [Waiting(i, 0, 1.0, 1) for i in ("z", "a", "m")]
    assert [x.lease_id for x in queue_order(w)] == ["z", "a", "m"]


class TestEta:
    def test_free_now(self) -> None:
        assert estimate_eta(100.0, free=2, busy_until=[], ahead=[], need=1) == 100.0

    def test_waits_for_ends_behind_those_ahead(self) -> None:
        # 0 free; leases end at 110, 120, 130; one request ahead needs 2 -> we get the third device at 130.
        assert estimate_eta(100.0, 0, [130.0, 110.0, 120.0], ahead=[2], need=1) == 130.0

    def test_unknowable(self) -> None:
        assert estimate_eta(100.0, 0, [110.0], ahead=[], need=2) is None

    @given(st.lists(st.floats(0, 1e4), max_size=8), st.integers(0, 4), st.lists(st.integers(1, 3), max_size=3),
           st.integers(1, 3))
    @settings(max_examples=200)
    def test_eta_never_before_now_and_monotone_in_queue(self, ends: list[float], free: int, ahead: list[int],
                                                        need: int) -> None:
        t = estimate_eta(500.0, free, ends, ahead, need)
        if t is not None:
            assert t >= 500.0
            shorter = estimate_eta(500.0, free, ends, ahead[:-1], need) if ahead else t
            assert shorter is not None and shorter <= t


def test_quota_cap() -> None:
    assert quota_cap("vm", Quota(), TenantUse(100, 100, 100.0), LeaseRequest(gpus=8)) == 8
    with pytest.raises(Conflict, match="holds 2"):
        quota_cap("vm", Quota(max_gpus=2), TenantUse(2), LeaseRequest())
    with pytest.raises(Conflict, match="1 more queued"):
        quota_cap("vm", Quota(max_gpus=2), TenantUse(1, 1), LeaseRequest())
    with pytest.raises(Conflict, match="GPU-hours"):
        quota_cap("vm", Quota(max_gpu_hours_per_day=1), TenantUse(0, 0, 1.0), LeaseRequest())
    assert quota_cap("vm", Quota(max_gpu_hours_per_day=1), TenantUse(0, 0, 0.99), LeaseRequest()) == 1
    assert quota_cap("vm", Quota(max_gpus=3), TenantUse(2), LeaseRequest(gpus=2, accept_partial=True)) == 1
    assert quota_cap("vm", Quota(max_gpus=3), TenantUse(0, 1), LeaseRequest(gpus=8, accept_partial=True)) == 2
    assert quota_cap("vm", Quota(max_gpus=3), TenantUse(0), LeaseRequest(gpus=3)) == 3
    with pytest.raises(Conflict, match="never"):
        quota_cap("vm", Quota(max_gpus=3), TenantUse(0), LeaseRequest(gpus=4))
    with pytest.raises(Conflict):
        quota_cap("vm", Quota(max_gpus=3), TenantUse(3), LeaseRequest(gpus=1, accept_partial=True))


def test_gpu_hours_over_a_sliding_day() -> None:
    now = 10 * DAY_S
    assert gpu_hours([], now) == 0
    assert gpu_hours([(now - 3600, None, 2)], now) == pytest.approx(2.0)  # live: up to now
    assert gpu_hours([(now - 7200, now - 3600, 1)], now) == pytest.approx(1.0)  # ended
    assert gpu_hours([(now - DAY_S - 3600, now - DAY_S + 3600, 1)], now) == pytest.approx(1.0)  # half inside
    assert gpu_hours([(now - 3 * DAY_S, now - 2 * DAY_S, 8)], now) == 0


def test_ledger_forgets_what_left_the_window() -> None:
    led = Ledger()
    base = new_lease("l", "u", "vm", LeaseRequest(), NOW)
    dev = LeaseDevice("g0", ("0000:01:00.0",), ("nvidia",), 1)
    for i, end in enumerate((NOW + 10, NOW + DAY_S, NOW + DAY_S + 10)):
        led.add(base.with_changes(id=f"l{i}", granted_at=NOW, ended_at=end, devices=(dev,)))
    led.add(base.with_changes(id="never", devices=()))  # never granted: used nothing
    spans = led.spans(lambda u, n: u == "u", NOW + DAY_S + 15)
    assert [e for _, e, _ in spans] == [NOW + DAY_S, NOW + DAY_S + 10]
    assert led.spans(lambda u, n: u == "other", NOW + DAY_S + 5) == []


def test_shadow_and_backfill() -> None:
    # head needs 4: 2 free now, 6 free at t=100 -> it starts at 100 with 4 spare
    sh = shadow(0.0, 2, [100.0] * 6, 4)
    assert sh == Shadow(100.0, 4)
    assert may_backfill(sh, 0.0, 100.0) and not may_backfill(sh, 0.0, 101.0)
    assert shadow(0.0, 8, [], 8) == Shadow(0.0, 0)  # it could start now
    assert shadow(0.0, 1, [50.0, 200.0], 2) == Shadow(50.0, 0)
    assert shadow(0.0, 1, [50.0], 3).start is None and not may_backfill(shadow(0.0, 1, [], 3), 0.0, 1.0)


def test_backfill_share_gives_the_head_only_what_it_cannot_use_or_will_not_need() -> None:
    inside, outside = ["h1", "h2", "h3"], ["o1"]  # free GPUs the head could use, and one it never could
    sh = Shadow(100.0, 2)  # the head starts at 100 with 2 of its GPUs spare then
    # ends before the head starts: every free GPU, the head's too
    assert backfill_share(sh, 0.0, 100.0, inside, outside) == (["o1", "h1", "h2", "h3"], True)
    # ends after: the GPUs the head never uses, and the 2 it will not need, in the order given
    assert backfill_share(sh, 0.0, 100.5, inside, outside) == (["o1", "h1", "h2"], False)
    assert backfill_share(Shadow(100.0, 0), 0.0, 500.0, inside, outside) == (["o1"], False)
    assert backfill_share(Shadow(100.0, -1), 0.0, 500.0, inside, []) == ([], False)  # never a negative slice
    # a head whose start cannot be predicted: only what it can never use (and its spare GPUs)
    assert backfill_share(Shadow(None, 0), 0.0, 1.0, inside, outside) == (["o1"], False)


def test_a_token_bucket_refills_refuses_and_charges_into_debt() -> None:
    from hostagent.domain.admission import TokenBucket

    b = TokenBucket(2.0, 10.0, now=0.0)
    assert b.take(10, 0.0) == 0.0 and b.take(1, 0.0) == 0.5
    assert b.refused_for(0.2) == 0.3 and b.refused_for(1.0) == 0.0
    assert b.take(1, 0.5) == 0.0  # refilled at 2 per second
    b.charge(4, 0.5)  # work already done: into debt
    assert b.take(1, 0.5) == 2.5 and b.take(1, 3.0) == 0.0
    b.give_back(100)
    assert b.take(10, 3.0) == 0.0 and b.take(0.5, 3.0) > 0  # never more than the burst
