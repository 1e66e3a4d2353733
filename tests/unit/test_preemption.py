"""Preemption's victim choice as a pure function (domain.preemption)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hostagent.domain.preemption import Holder, choose_victims, may_preempt


def test_threshold_zero_is_off_and_the_threshold_itself_may_preempt() -> None:
    assert not may_preempt(1000, 0)
    assert not may_preempt(4, 5)
    assert may_preempt(5, 5) and may_preempt(9, 5)


def test_lowest_priority_first_then_youngest() -> None:
    holders = [Holder("old-low", 1, granted_at=100.0, usable=1), Holder("young-low", 1, granted_at=200.0, usable=1),
               Holder("lowest", 0, granted_at=50.0, usable=1), Holder("mid", 3, granted_at=300.0, usable=1)]
    assert choose_victims(9, 1, holders).victims == ("lowest",)
    assert choose_victims(9, 2, holders).victims == ("lowest", "young-low")
    assert choose_victims(9, 3, holders).victims == ("lowest", "young-low", "old-low")


def test_never_equal_or_higher_priority_never_paused_and_never_for_nothing() -> None:
    holders = [Holder("equal", 5, 10.0, 2), Holder("higher", 7, 20.0, 2), Holder("paused", 1, 30.0, 2, paused=True),
               Holder("low", 1, 40.0, 1)]
    got = choose_victims(5, 2, holders)
    assert got.victims == () and "only 1" in got.reason  # one usable GPU of lower priority cannot cover two
    assert choose_victims(5, 1, holders).victims == ("low",)


def test_no_shortfall_no_victims() -> None:
    assert choose_victims(9, 0, [Holder("a", 0, 1.0, 4)]).victims == ()
    assert choose_victims(9, -2, [Holder("a", 0, 1.0, 4)]).victims == ()


def test_a_lease_that_holds_none_of_the_usable_gpus_is_never_a_victim() -> None:
    assert choose_victims(9, 1, [Holder("elsewhere", 0, 1.0, 0), Holder("here", 2, 2.0, 1)]).victims == ("here",)


holder = st.builds(Holder, lease_id=st.uuids().map(str), priority=st.integers(-5, 10),
                   granted_at=st.floats(0, 1e6, allow_nan=False), usable=st.integers(0, 4), paused=st.booleans())


@given(st.integers(-5, 12), st.integers(0, 10), st.lists(holder, max_size=12, unique_by=lambda h: h.lease_id))
def test_victims_are_few_enough_and_all_allowed(priority: int, shortfall: int, holders: list[Holder]) -> None:
    got = choose_victims(priority, shortfall, holders)
    by_id = {h.lease_id: h for h in holders}
    chosen = [by_id[v] for v in got.victims]
    assert all(h.priority < priority and not h.paused and h.usable > 0 for h in chosen)
    if chosen:
        covered = sum(h.usable for h in chosen)
        assert covered >= shortfall > 0
        assert covered - chosen[-1].usable < shortfall  # the last victim was needed
    else:
        allowed = sum(h.usable for h in holders if h.priority < priority and not h.paused)
        assert shortfall <= 0 or allowed < shortfall
