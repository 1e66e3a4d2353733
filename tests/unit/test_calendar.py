"""The booking calendar (domain.calendar): overlaps, backfill, earliest-window offers, priority displacement."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hostagent.domain.calendar import INF, Hold, clear_until, displace, earliest_window, free_over, next_start

GPUS = ["g0", "g1", "g2", "g3"]


def booking(gpu: str, start: float, end: float, lease: str, priority: int = 0, created: float = 0.0) -> Hold:
    return Hold(gpu, start, end, lease, priority, created, booking=True)


def running(gpu: str, until: float, lease: str) -> Hold:
    return Hold(gpu, 0.0, until, lease)


def test_spans_are_half_open() -> None:
    h = booking("g0", 100, 200, "b")
    assert h.overlaps(150, 160) and h.overlaps(50, 101) and h.overlaps(199, 300)
    assert not h.overlaps(200, 300) and not h.overlaps(0, 100)
    assert free_over(GPUS, [h], 200, 300) == GPUS
    assert free_over(GPUS, [h], 0, 101) == ["g1", "g2", "g3"]
    assert free_over(GPUS, [h], 0, 101, ignore=["b"]) == GPUS


def test_a_lease_granted_now_never_holds_a_gpu_into_its_booking() -> None:
    holds = [booking("g0", 1000, 2000, "b"), booking("g1", 5000, 6000, "c"), running("g2", INF, "r")]
    # a lease until t=1500 may not take g0 (booked from 1000) but may take g1 (booked from 5000): a backfill
    assert clear_until(GPUS, holds, now=0, until=1500) == ["g1", "g2", "g3"]
    assert clear_until(GPUS, holds, now=0, until=1000) == GPUS  # it ends as the booking starts: fits the gap
    assert clear_until(GPUS, holds, now=0, until=5001) == ["g2", "g3"]
    # a booking already over does not count
    assert clear_until(GPUS, holds, now=2500, until=4000) == GPUS
    assert next_start(holds, "g0", 0) == 1000 and next_start(holds, "g3", 0) == INF
    assert next_start(holds, "g0", 0, ignore=["b"]) == INF  # a renewal of the booking's own lease
    assert next_start(holds, "g0", 1999) == 1000 and next_start(holds, "g0", 2000) == INF  # over at its end


def test_the_earliest_window_starts_where_enough_gpus_free() -> None:
    holds = [running("g0", 300, "a"), running("g1", 500, "b"), running("g2", INF, "c"),
             booking("g3", 400, 900, "d")]
    # 2 GPUs for 100 s: g3 is free until 400, g0 from 300: [300, 400) fits
    w = earliest_window(GPUS, holds, 2, 100, not_before=0, horizon=10_000)
    assert w is not None and w.start == 300 and set(w.gpus) == {"g0", "g3"}
    # for 200 s g3's booking is in the way until 900; g0 and g1 are both free from 500
    w = earliest_window(GPUS, holds, 2, 200, not_before=0, horizon=10_000)
    assert w is not None and w.start == 500 and set(w.gpus) >= {"g0", "g1"}
    assert earliest_window(GPUS, holds, 4, 10, not_before=0, horizon=10_000) is None  # g2 never frees
    assert earliest_window(GPUS, holds, 2, 200, not_before=0, horizon=400) is None  # past the horizon
    w = earliest_window(GPUS, holds, 2, 200, not_before=0, horizon=500)  # a window may start at the horizon
    assert w is not None and w.start == 500
    assert earliest_window(GPUS, holds, 5, 1, 0, 10) is None and earliest_window(GPUS, holds, 0, 1, 0, 10) is None


def test_displacement_takes_the_lowest_youngest_bookings_it_needs_and_never_equals() -> None:
    holds = [booking("g0", 100, 200, "low-old", priority=1, created=1.0),
             booking("g1", 100, 200, "low-young", priority=1, created=5.0),
             booking("g2", 150, 300, "lowest", priority=0, created=9.0),
             booking("g3", 100, 200, "equal", priority=5, created=0.0)]
    d = displace(GPUS, holds, 1, 100, 200, priority=5)
    assert d is not None and d.victims == ("lowest",) and d.gpus == ("g2",)
    d = displace(GPUS, holds, 2, 100, 200, priority=5)
    assert d is not None and d.victims == ("lowest", "low-young") and set(d.gpus) == {"g1", "g2"}
    d = displace(GPUS, holds, 3, 100, 200, priority=5)
    assert d is not None and set(d.victims) == {"lowest", "low-young", "low-old"}
    assert displace(GPUS, holds, 4, 100, 200, priority=5) is None  # the equal one is never displaced
    assert displace(GPUS, holds, 1, 100, 200, priority=0) is None  # nothing lower than 0
    # a running lease is never a victim (preemption is the queue's)
    assert displace(["g0"], [running("g0", INF, "r")], 1, 0, 10, priority=100) is None
    # free GPUs first: nothing displaced when there is room
    assert displace(GPUS, holds, 1, 300, 400, priority=5) == displace(GPUS, [], 1, 300, 400, priority=5)
    assert displace(GPUS, holds, 1, 300, 400, priority=5).victims == ()  # type: ignore[union-attr]


def test_a_victim_the_later_ones_made_unneeded_keeps_its_booking() -> None:
    # the lowest booking holds g0 only briefly; removing it is not enough, the next one (two GPUs) is; then the
    # first is not needed after all
    holds = [booking("g0", 100, 120, "tiny", priority=0, created=1.0),
             booking("g1", 100, 200, "pair", priority=1, created=1.0), booking("g2", 100, 200, "pair", priority=1),
             running("g0", 110, "r")]
    d = displace(["g0", "g1", "g2"], holds, 2, 100, 200, priority=5)
    assert d is not None and d.victims == ("pair",) and set(d.gpus) == {"g1", "g2"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(GPUS), st.integers(0, 50), st.integers(1, 30), st.integers(0, 3),
                          st.booleans()), max_size=12),
       st.integers(1, 4), st.integers(1, 40), st.integers(0, 60), st.integers(0, 4))
def test_offers_and_displacements_always_fit(raw: list[tuple[str, int, int, int, bool]], count: int, duration: int,
                                             not_before: int, priority: int) -> None:
    holds = [Hold(g, s, s + d, f"l{i}", p, float(i), booking=b) for i, (g, s, d, p, b) in enumerate(raw)]
    w = earliest_window(GPUS, holds, count, duration, not_before, horizon=1000)
    if w is not None:
        assert w.start >= not_before and len(free_over(w.gpus, holds, w.start, w.start + duration)) == len(w.gpus)
        assert len(w.gpus) >= count
        # nothing earlier among the candidate starts fits
        for t in range(not_before, int(w.start)):
            assert len(free_over(GPUS, holds, t, t + duration)) < count
    d = displace(GPUS, holds, count, not_before, not_before + duration, priority)
    if d is not None:
        kept = [h for h in holds if h.lease_id not in d.victims]
        assert len(free_over(GPUS, kept, not_before, not_before + duration)) >= count
        assert all(h.booking and h.priority < priority for h in holds if h.lease_id in d.victims)


def test_pruning_keeps_only_the_victims_needed_together() -> None:
    # greedy takes a, b, c (lowest priority first); a and c together free two GPUs, b is not needed after all
    holds = [booking("g0", 0, 10, "a", priority=0), booking("g0", 0, 10, "c", priority=2),
             booking("g1", 0, 10, "b", priority=1), booking("g2", 0, 10, "c", priority=2)]
    d = displace(["g0", "g1", "g2"], holds, 2, 0, 10, priority=5)
    assert d is not None and sorted(d.victims) == ["a", "c"] and set(d.gpus) == {"g0", "g2"}


def test_one_gpu_and_every_gpu_have_windows_too() -> None:
    holds = [running("g0", 50, "r")]
    w = earliest_window(GPUS, holds, 1, 10, not_before=0, horizon=100)
    assert w is not None and w.start == 0 and "g0" not in w.gpus
    w = earliest_window(GPUS, holds, len(GPUS), 10, not_before=0, horizon=100)
    assert w is not None and w.start == 50 and set(w.gpus) == set(GPUS)


def _window_by_brute_force(gpus: list[str], holds: list[Hold], count: int, duration: float, not_before: float,
                           horizon: float) -> tuple[float, tuple[str, ...]] | None:
    """The definition: the first of not_before and every hold's end (where a GPU can free) with `count` free."""
    if count < 1 or count > len(gpus):
        return None
    for t in sorted({not_before, *(h.end for h in holds if not_before < h.end <= horizon and h.end < INF)}):
        if t > horizon:
            break
        free = free_over(gpus, holds, t, t + duration)
        if len(free) >= count:
            return t, tuple(free)
    return None


_spans = st.lists(st.tuples(st.sampled_from(GPUS), st.integers(0, 50), st.integers(0, 30), st.booleans()),
                  max_size=12)


@settings(max_examples=300, deadline=None)
@given(_spans, st.integers(1, 4), st.integers(0, 40), st.integers(0, 40), st.integers(0, 120))
def test_the_earliest_window_is_the_first_hold_end_where_enough_gpus_are_free(
        spans: list[tuple[str, int, int, bool]], count: int, duration: int, not_before: int, horizon: int) -> None:
    """Against the definition, on random calendars (overlapping holds, empty ones, holds for ever)."""
    holds = [Hold(g, float(a), INF if forever else float(a + n), f"h{i}", booking=not forever)
             for i, (g, a, n, forever) in enumerate(spans)]
    w = earliest_window(GPUS, holds, count, duration, not_before, horizon)
    want = _window_by_brute_force(GPUS, holds, count, duration, not_before, horizon)
    assert (None if w is None else (w.start, w.gpus)) == want


def test_a_time_in_a_message_reads_to_the_second_with_its_zone() -> None:
    from hostagent.domain.calendar import utc_text
    assert utc_text(1_800_000_007.0) == "2027-01-15 08:00:07 UTC"
    assert utc_text(0) == "1970-01-01 00:00:00 UTC"
