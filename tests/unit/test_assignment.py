"""Queue-aware assignment (domain.assignment) on small cases whose right answers are known by hand."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from hostagent.domain.assignment import Candidate, Fairness, _nth, choose
from hostagent.learn.simulate import Job, SimGpu, Table, run_policy

F = Fairness(max_passes=3, max_delay_s=100.0)


def test_each_job_gets_its_comparative_advantage() -> None:
    # GPU X is free. A (first) runs at 1 on X and 10 on Y; B runs at 8 on X and 10 on Y: X is worth far more to B
    a = Candidate("A", 0, 0, now=1.0, best=10.0)
    b = Candidate("B", 1, 0, now=8.0, best=10.0)
    pick = choose([a, b], F, now=0.0)
    assert pick.chosen == "B" and pick.passed == ("A",)
    assert "comparative advantage: 80% of its best rate" in pick.reason and "10% for the request ahead" in pick.reason
    # the same two in strict order: the head goes
    assert choose([a, b], Fairness(enabled=False), now=0.0).chosen == "A"
    # equal advantage: serve order decides, nobody is passed over
    same = choose([Candidate("A", 0, 0, 5.0, 10.0), Candidate("B", 1, 0, 5.0, 10.0)], F, now=0.0)
    assert same.chosen == "A" and same.passed == ()


def test_efficiencies_the_predictions_cannot_tell_apart_keep_serve_order() -> None:
    # A at 10 % of its best, B at 80 %: a log gap of ln 8 = 2.08. Known to a few per cent, B goes first; where A's
    # efficiency rests on a pair never seen (its deviation 2.2 > 2.08), the two count as equal and A keeps its turn
    b = Candidate("B", 1, 0, now=8.0, best=10.0, sd=0.05)
    sure = choose([Candidate("A", 0, 0, 1.0, 10.0, sd=0.05), b], F, now=0.0)
    assert sure.chosen == "B" and not sure.unsure and "uncertainty" not in sure.reason
    pick = choose([Candidate("A", 0, 0, 1.0, 10.0, sd=2.2), b], F, now=0.0)
    assert pick.chosen == "A" and pick.passed == () and pick.unsure
    assert pick.reason == ("first in serve order (10% of its best rate on the GPUs free now; B's 80% is within the "
                           "model's uncertainty of it)")
    # the deviations combine (hypot): 1.5 and 1.5 make 2.12, enough; 1.4 and 1.4 make 1.98, not
    assert choose([Candidate("A", 0, 0, 1.0, 10.0, sd=1.5), Candidate("B", 1, 0, 8.0, 10.0, sd=1.5)], F, 0.0).chosen == "A"
    assert choose([Candidate("A", 0, 0, 1.0, 10.0, sd=1.4), Candidate("B", 1, 0, 8.0, 10.0, sd=1.4)], F, 0.0).chosen == "B"
    # of three, the earliest of those within reach of the most efficient: C (80 %) is told apart from A (10 %) but
    # not from B (50 %, ln 1.6 = 0.47 within 0.5): B, passing A only
    three = [Candidate("A", 0, 0, 1.0, 10.0), Candidate("B", 1, 0, 5.0, 10.0, sd=0.4),
             Candidate("C", 2, 0, 8.0, 10.0, sd=0.3)]
    pick = choose(three, F, now=0.0)
    assert pick.chosen == "B" and pick.passed == ("A",) and pick.unsure is True
    assert pick.reason.endswith("started ahead of 1 request(s) of the same priority; C's 80% is within the model's "
                                "uncertainty of it")
    # nobody can start on a useful GPU (every efficiency 0): serve order
    assert choose([Candidate("A", 0, 0, 0.0, 10.0), Candidate("B", 1, 0, 0.0, 10.0, sd=1.0)], F, 0.0).chosen == "A"
    # two equally efficient (to 1e-9): the earlier of them is the one the others are measured against. C (80 %) is
    # told apart from A (exact), though B (unsure, 0.5) would not tell it apart: A, passing C
    for a_now in (10.0, 10.0 - 4e-9):
        tied = [Candidate("C", 0, 0, 8.0, 10.0), Candidate("A", 1, 0, a_now, 10.0),
                Candidate("B", 2, 0, 10.0, 10.0, sd=0.5)]
        assert choose(tied, F, now=0.0).chosen == "A", a_now


def test_the_simulator_gives_each_job_its_comparative_advantage_and_the_greedy_oracle_does_not() -> None:
    # Two GPU models with opposite speedups: "a" runs 10/s on X and 9/s on Y, "b" 1/s on X and 10/s on Y.
    table = Table({("a", "X"): 10.0, ("a", "Y"): 9.0, ("b", "X"): 1.0, ("b", "Y"): 10.0}, {"a": 0.0, "b": 0.0})
    host = [SimGpu("x", "X", 16.0, 0), SimGpu("y", "Y", 16.0, 0)]
    # t=0: an "a" takes X until t=10. t=1: another "a" (90 units) and a "b" (100) arrive, the "a" first; Y is free.
    jobs = [Job(0, 0.0, "a", 100.0, 1), Job(1, 1.0, "a", 90.0, 1), Job(2, 1.0, "b", 100.0, 1)]

    def jcts(policy: str) -> list[float]:
        fig = run_policy(policy, table, host, jobs, seed=0, warmup_jobs=0, retrain_every=10, min_records=10)
        return [round(fig.jct[i], 6) for i in range(3)]
    # greedy: the "a" in front takes Y (its best free GPU, 9/s: ends at 11); "b" waits for X and runs at 1/s there
    # from t=10: ends at 110, 109 s after it came
    assert jcts("oracle") == [10.0, 10.0, 109.0]
    # comparative advantage: Y gives "b" 100 % of its best rate and "a" 90 %: "b" takes Y (ends at 11), "a" takes X
    # when it frees at t=10 (10/s: ends at 19)
    assert jcts("matching-oracle") == [10.0, 18.0, 10.0]
    assert sum(jcts("matching-oracle")) < sum(jcts("oracle")) / 3


def test_a_job_that_should_wait_does_and_one_that_should_not_does_not() -> None:
    # A: 100 s of work at rate 1; the free GPU gives it 0.1 (1000 s), its best GPU (1.0) frees in 5 s: 105 s
    slow_now = Candidate("A", 0, 0, now=0.1, best=1.0, run_s=100.0, better_in_s=5.0)
    other = Candidate("B", 1, 0, now=0.5, best=1.0)
    pick = choose([slow_now, other], F, now=0.0)
    assert pick.chosen == "B" and "A" in pick.waiting and "A" not in pick.passed
    assert "waiting for a better GPU: predicted to end in 105 s there (free in 5 s) against 1000 s" in pick.waiting["A"]
    # the better GPU frees only in 2000 s: waiting would end later than starting now: no wait, and A is at 10 %
    # of its best, B at 50 %: B still goes first, by comparative advantage, and A is passed over (not waiting)
    late = Candidate("A", 0, 0, now=0.1, best=1.0, run_s=100.0, better_in_s=2000.0)
    pick = choose([late, other], F, now=0.0)
    assert pick.chosen == "B" and pick.waiting == {} and pick.passed == ("A",)
    # exactly as soon either way (900 s wait + 100 s there = 1000 s now): "beats" means sooner, so no wait
    even = Candidate("A", 0, 0, now=0.1, best=1.0, run_s=100.0, better_in_s=900.0)
    assert choose([even, other], F, now=0.0).waiting == {}
    # alone with the free GPU, a job that would rather wait waits: the GPU stays free (for a request that gains from
    # it) rather than run A ten times as long as it need
    alone = choose([slow_now, Candidate("C", 1, 0, now=None, best=1.0)], F, now=0.0)
    assert alone.chosen is None and list(alone.waiting) == ["A"]
    assert alone.reason == "every request that could start would rather wait for a better GPU"
    # every candidate would rather wait, each for a GPU of its own: none starts
    both = choose([slow_now, Candidate("B", 1, 0, now=0.1, best=1.0, run_s=100.0, better_in_s=5.0)], F, now=0.0)
    assert both.chosen is None and list(both.waiting) == ["A", "B"]


def test_requests_waiting_for_the_same_gpus_stand_in_line_for_them() -> None:
    # A and B both run 100 s at their best rate (1.0) and 200 s on the free GPU (0.5). Their best GPUs are the same
    # two, free in 5 s and in 400 s. A, first in line, waits 5 s (ends in 105 s, not 200 s). B is second in line: the
    # first of them is A's until 105 s, the other frees at 400 s, so B would end in 205 s there: B starts now
    def job(name: str, order: int, passes: int = 0, **kw: object) -> Candidate:
        return Candidate(name, order, 0, now=0.5, best=1.0, passes=passes, run_s=100.0, better_in_s=5.0,
                         later_s=(400.0,), best_on="X", **kw)  # type: ignore[arg-type]
    pick = choose([job("A", 0), job("B", 1)], F, now=0.0)
    assert pick.chosen == "B" and list(pick.waiting) == ["A"] and pick.passed == ()
    assert pick.free_in == {"A": 5.0}
    assert pick.waiting["A"].startswith("waiting for a better GPU: predicted to end in 105 s there (free in 5 s) "
                                        "against 200 s")
    # on a slower GPU (rate 0.25: 400 s) B waits too, second in line: its GPU is free for it when A's run ends (105 s)
    slow = [job("A", 0), Candidate("B", 1, 0, now=0.25, best=1.0, run_s=100.0, better_in_s=5.0, later_s=(400.0,),
                                   best_on="X")]
    pick = choose(slow, F, now=0.0)
    assert pick.chosen is None and list(pick.waiting) == ["A", "B"]
    assert pick.waiting["B"].startswith("waiting for a better GPU: predicted to end in 205 s there (free in 105 s, "
                                        "2nd in line for it) against 400 s")
    assert pick.free_in == {"A": 5.0, "B": 105.0}  # when each is expected to start: its ETA
    # without the line (each for GPUs of its own) both would count on the GPU free in 5 s
    apart = choose([Candidate("A", 0, 0, 0.5, 1.0, run_s=100.0, better_in_s=5.0, later_s=(400.0,)),
                    Candidate("B", 1, 0, 0.5, 1.0, run_s=100.0, better_in_s=5.0, later_s=(400.0,))], F, 0.0)
    assert apart.chosen is None and list(apart.waiting) == ["A", "B"]
    # the due stand first in line: B, due, takes the GPU free in 5 s and A, second, would end in 205 s: A starts now,
    # by comparative advantage ahead of nobody (B waits)
    pick = choose([job("A", 0), job("B", 1, passes=3)], F, now=0.0)
    assert pick.chosen == "A" and list(pick.waiting) == ["B"] and pick.passed == ()
    # a line for other GPUs is a line of its own: C, whose best are "Y", is first in its line
    other = Candidate("C", 2, 0, now=0.5, best=1.0, run_s=100.0, better_in_s=5.0, later_s=(400.0,), best_on="Y")
    assert list(choose([job("A", 0), job("B", 1), other], F, 0.0).waiting) == ["A", "C"]
    # a set of 2 waits for 2 of the line's GPUs: one free (0 s), the other in 50 s, so it starts there in 50 s and
    # ends in 150 s against 400 s on the GPUs free now (a quarter of its best rate); both GPUs are then its until
    # 150 s, so a single request behind it would end in 250 s there against 200 s now: it starts now
    pair = Candidate("P", 0, 0, now=0.25, best=1.0, run_s=100.0, better_in_s=50.0, later_s=(0.0,), best_on="X", count=2)
    single = Candidate("S", 1, 0, now=0.5, best=1.0, run_s=100.0, better_in_s=0.0, later_s=(50.0,), best_on="X")
    pick = choose([pair, single], F, now=0.0)
    assert pick.chosen == "S" and list(pick.waiting) == ["P"]
    assert pick.free_in == {"P": 50.0}
    assert pick.waiting["P"].startswith("waiting for a better GPU: predicted to end in 150 s there (free in 50 s)")
    # a set larger than the line's GPUs cannot wait for them
    assert "P" not in choose([replace(pair, count=3), single], F, now=0.0).waiting
    # one in line that would not wait gives its place back: A runs nearly as fast now (0.99) and starts; B, behind
    # it, still counts on the GPU free in 5 s (105 s there against 200 s now), not on one after A's run
    quick = Candidate("A", 0, 0, now=0.99, best=1.0, run_s=100.0, better_in_s=5.0, later_s=(400.0,), best_on="X")
    pick = choose([quick, job("B", 1)], F, now=0.0)
    assert pick.chosen == "A" and pick.waiting["B"].startswith("waiting for a better GPU: predicted to end in 105 s "
                                                                "there (free in 5 s) against 200 s")
    # a GPU whose expected free time is already past counts as free now for the next in line too: A waits for it
    # (0 s + 100 s), and it is B's again only after A's run, at 100 s (200 s there: not sooner than now)
    late = [Candidate(n, k, 0, now=0.5, best=1.0, run_s=100.0, better_in_s=-30.0, later_s=(400.0,), best_on="X")
            for k, n in enumerate("AB")]
    pick = choose(late, F, now=0.0)
    assert pick.chosen == "B" and pick.waiting["A"].startswith("waiting for a better GPU: predicted to end in 100 s")
    # (the reason's ordinals)
    assert [_nth(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th"]


def test_the_fairness_bound_stops_starvation() -> None:
    def poor(passes: int, since: float | None = None) -> Candidate:
        return Candidate("A", 0, 0, now=1.0, best=10.0, passes=passes, passed_since=since)
    good = Candidate("B", 1, 0, now=10.0, best=10.0)
    assert choose([poor(2), good], F, now=0.0).chosen == "B"  # passed over twice: the bound is 3
    due = choose([poor(3), good], F, now=0.0)
    assert due.chosen == "A" and "served in turn: passed over 3 time(s)" in due.reason
    assert choose([poor(1, since=0.0), good], F, now=99.0).chosen == "B"
    assert choose([poor(1, since=0.0), good], F, now=100.0).chosen == "A"  # first passed over 100 s ago
    # a due request that cannot start now holds nobody back here, not even from GPUs it could never use: the caller
    # keeps the head of the queue its GPUs (EASY backfilling); until 2026-11-30 it stopped every other request
    stuck = Candidate("A", 0, 0, now=None, best=10.0, passes=3)
    held = choose([stuck, good], F, now=0.0)
    assert held.chosen == "B" and held.passed == ()
    # a due request is never passed over by a waiting one either
    assert choose([poor(3), Candidate("B", 1, 0, now=10.0, best=10.0, run_s=1.0, better_in_s=0.0)], F, 0.0).chosen == "A"
    # a bound of 0 passes: every request is due, so the one closest to its best rate goes (serve order among equals)
    assert choose([poor(0), good], Fairness(max_passes=0, max_delay_s=100.0), now=0.0).chosen == "B"
    assert choose([poor(0), Candidate("B", 1, 0, 1.0, 10.0)], Fairness(max_passes=0), now=0.0).chosen == "A"


def test_a_request_served_in_turn_still_waits_for_a_gpu_on_which_it_ends_sooner() -> None:
    # A is due (passed over 3 times). The GPU free now gives it 10 % of its best rate (1000 s); its best GPU frees in
    # 5 s (105 s there). Taking the slow GPU would help nobody: A waits, still due, and B takes the free GPU
    due_slow = Candidate("A", 0, 0, now=0.1, best=1.0, passes=3, run_s=100.0, better_in_s=5.0)
    other = Candidate("B", 1, 0, now=0.5, best=1.0)
    pick = choose([due_slow, other], F, now=0.0)
    assert pick.chosen == "B" and "A" in pick.waiting and pick.passed == ()
    assert pick.waiting["A"].startswith("waiting for a better GPU: predicted to end in 105 s there (free in 5 s)")
    # when its GPU frees it goes first, in turn, ahead of a request that gains more from it
    freed = choose([Candidate("A", 0, 0, now=0.5, best=1.0, passes=3), Candidate("B", 1, 0, now=1.0, best=1.0)], F, 0.0)
    assert freed.chosen == "A" and freed.reason.startswith("served in turn: passed over 3 time(s)")
    # its best GPU frees only in 2000 s: waiting would end later, so it takes the free GPU, in turn
    late = Candidate("A", 0, 0, now=0.1, best=1.0, passes=3, run_s=100.0, better_in_s=2000.0)
    pick = choose([late, other], F, now=0.0)
    assert pick.chosen == "A" and pick.waiting == {} and "served in turn" in pick.reason
    # another due request behind it goes in turn; it passes B, not the waiting A
    also_due = Candidate("C", 2, 0, now=0.2, best=1.0, passes=5)
    pick = choose([due_slow, other, also_due], F, now=0.0)
    assert pick.chosen == "C" and pick.passed == ("B",) and "A" in pick.waiting
    assert "served in turn: passed over 5 time(s)" in pick.reason
    # every one of them would rather wait: none starts, the due one among them
    both = choose([Candidate("B", 0, 0, now=0.1, best=1.0, run_s=100.0, better_in_s=5.0),
                   Candidate("A", 1, 0, now=0.1, best=1.0, passes=3, run_s=100.0, better_in_s=5.0)], F, now=0.0)
    assert both.chosen is None and set(both.waiting) == {"A", "B"} and both.passed == ()


def test_of_several_due_the_one_closest_to_its_best_rate_goes_first() -> None:
    # A and B are both due; the free GPU gives A 10 % of its best rate and B 90 %: B goes, passing A (again), rather
    # than A taking a GPU that runs it ten times as long as its best
    a = Candidate("A", 0, 0, now=0.1, best=1.0, passes=3)
    b = Candidate("B", 1, 0, now=0.9, best=1.0, passes=4)
    pick = choose([a, b], F, now=0.0)
    assert pick.chosen == "B" and pick.passed == ("A",) and pick.reason.startswith("served in turn: passed over 4")
    # a due request still goes ahead of a more efficient one that is not due
    assert choose([a, Candidate("C", 1, 0, now=1.0, best=1.0)], F, now=0.0).chosen == "A"
    # due ones the predictions cannot tell apart keep serve order
    assert choose([Candidate("A", 0, 0, 0.1, 1.0, passes=3, sd=3.0), b], F, now=0.0).chosen == "A"


def test_the_wait_is_weighed_only_with_every_figure_it_needs() -> None:
    # a request served in turn asks gains_by_waiting too, so every guard counts: no rate now, none at its best, no
    # run time or no free time for its best GPU means no wait (and no division by a zero rate)
    assert Candidate("A", 0, 0, now=0.0, best=1.0, run_s=100.0, better_in_s=5.0).gains_by_waiting() is None
    assert Candidate("A", 0, 0, now=1.0, best=0.0, run_s=100.0, better_in_s=5.0).gains_by_waiting() is None
    assert Candidate("A", 0, 0, now=None, best=1.0, run_s=100.0, better_in_s=5.0).gains_by_waiting() is None
    assert Candidate("A", 0, 0, now=0.5, best=1.0, run_s=None, better_in_s=5.0).gains_by_waiting() is None
    assert Candidate("A", 0, 0, now=0.5, best=1.0, run_s=100.0, better_in_s=None).gains_by_waiting() is None
    # a GPU already free at its best (free in 0 s): 100 s there against 100.5 s now, a half-second sooner: it waits
    near = Candidate("A", 0, 0, now=0.995, best=1.0, run_s=100.0, better_in_s=0.0).gains_by_waiting()
    assert near is not None and near[0] == 100.0 and abs(near[1] - 100.0 / 0.995) < 1e-9
    # a free time already past counts as now, not as a negative wait
    assert Candidate("A", 0, 0, now=0.5, best=1.0, run_s=100.0, better_in_s=-50.0).gains_by_waiting() == (100.0, 200.0)
    # two efficiencies equal to 9 places are one level: the first in serve order, and no doubt said
    same = choose([Candidate("A", 0, 0, now=1.0, best=2.0), Candidate("B", 1, 0, now=1.0000000006, best=2.0)], F, 0.0)
    assert same.chosen == "A" and not same.unsure and "uncertainty" not in same.reason


def test_a_pick_by_comparative_advantage_keeps_saying_who_waits_and_how_sure_it_is() -> None:
    # A waits for its better GPU (free in 5 s); C (80 %) passes B (10 %) by comparative advantage, surely: the pick
    # names A among the waiting and says it was not in doubt
    waits = Candidate("A", 0, 0, now=0.1, best=1.0, run_s=100.0, better_in_s=5.0)
    pick = choose([waits, Candidate("B", 1, 0, now=0.1, best=1.0), Candidate("C", 2, 0, now=0.8, best=1.0)], F, 0.0)
    assert pick.chosen == "C" and pick.passed == ("B",) and pick.reason.startswith("comparative advantage")
    assert list(pick.waiting) == ["A"] and pick.unsure is False


def test_priorities_are_never_inverted() -> None:
    low_but_perfect = Candidate("L", 0, 0, now=10.0, best=10.0)
    high_but_poor = Candidate("H", 1, 5, now=1.0, best=10.0)
    pick = choose([low_but_perfect, high_but_poor], F, now=0.0)
    assert pick.chosen == "H" and pick.passed == ()
    # a higher-priority request that cannot start now does not stop a lower one that can (the caller's backfilling
    # decides whether it may); it is not counted as passed over
    waiting_high = Candidate("H", 0, 5, now=None, best=10.0)
    assert choose([waiting_high, low_but_perfect], F, now=0.0).chosen == "L"
    assert choose([], F, now=0.0).chosen is None
    # a higher-priority request that would rather wait for a better GPU leaves the free one to a lower priority,
    # which is told why; the higher one is not passed over (it declined the GPU)
    high_waits = Candidate("H", 0, 5, now=1.0, best=10.0, run_s=100.0, better_in_s=5.0)
    pick = choose([high_waits, low_but_perfect], F, now=0.0)
    assert pick.chosen == "L" and pick.passed == () and list(pick.waiting) == ["H"]
    assert pick.reason == ("first in serve order; every request of a higher priority that could start would rather "
                           "wait for a better GPU")
    # a due request of the lower priority that cannot start holds nobody back (the caller's backfilling keeps the
    # head its GPUs)
    stuck_low = Candidate("S", 2, 0, now=None, best=10.0, passes=3)
    held = choose([high_waits, low_but_perfect, stuck_low], F, now=0.0)
    assert held.chosen == "L" and list(held.waiting) == ["H"]
    # of two lower-priority requests the model cannot tell apart, the first in serve order takes the GPU the higher
    # one declines, and the pick says it was unsure
    unsure_low = [high_waits, Candidate("L1", 1, 0, now=1.0, best=10.0, sd=2.5),
                  Candidate("L2", 2, 0, now=8.0, best=10.0, sd=0.1)]
    pick = choose(unsure_low, F, now=0.0)
    assert pick.chosen == "L1" and pick.unsure and list(pick.waiting) == ["H"]
    # strict order is by priority first, whatever the serve order says
    strict = choose([low_but_perfect, Candidate("H", 1, 5, now=1.0, best=10.0)], Fairness(enabled=False), 0.0)
    assert strict.chosen == "H"


def test_every_decision_says_why_in_words_and_counts_whom_it_passed() -> None:
    # (what the lease's reasons and the queue's notes show; found by mutation testing: each line fails on a mutant)
    assert choose([Candidate("A", 0, 0, None, 10.0)], F, 0.0).reason == "no queued request can start now"
    assert choose([Candidate("A", 0, 0, 1.0, 10.0)], F, 0.0).reason == "first in serve order"
    strict = choose([Candidate("A", 0, 0, 1.0, 10.0), Candidate("B", 1, 0, 9.0, 10.0)], Fairness(enabled=False), 0.0)
    assert strict.reason == "first in serve order (strict order)"
    # served in turn: it passes every request ahead of it in serve order, not itself; the reason says how long only
    # when it knows since when
    due = Candidate("C", 2, 0, now=1.0, best=10.0, passes=3)
    pick = choose([Candidate("A", 0, 0, 9.0, 10.0), Candidate("B", 1, 0, 9.0, 10.0), due], F, now=0.0)
    assert pick.chosen == "C" and pick.passed == ("A", "B")
    assert pick.reason == "served in turn: passed over 3 time(s) (fairness bound: 3 times or 100 s)"
    # a request that cannot start, due by time (passed over once, 150 s ago), is not passed over again by one that
    # starts: it was not offered the GPUs
    late = Candidate("A", 0, 0, now=None, best=10.0, passes=1, passed_since=0.0)
    assert choose([late, Candidate("B", 1, 0, 10.0, 10.0)], F, now=150.0).passed == ()
    # a request that gains nothing on the GPUs free now (efficiency 0) is never the one compared against: no division
    # by its zero, and it is passed over by one that gains
    zero = choose([Candidate("A", 0, 0, 0.0, 10.0, sd=0.5), Candidate("B", 1, 0, 5.0, 10.0, sd=0.5)], F, 0.0)
    assert zero.chosen == "B" and zero.passed == ("A",)


def sim_host(table: Table, gpus: Sequence[tuple[str, str]]) -> tuple[list[Any], Any]:
    """A simulated host of 80 GiB GPUs (id, model) on one node: its device views and `matching-oracle`'s scorer."""
    import random

    from hostagent.domain.placement import DeviceView
    from hostagent.learn.simulate import rule_scorers

    host = [SimGpu(gid, model, 80.0, 0) for gid, model in gpus]
    views = [DeviceView(gpu_id=g.gpu_id, model=g.model, vendor="NVIDIA Corporation", memory_bytes=80 << 30,
                        numa_node=0, probe_score=1.0) for g in host]
    return views, rule_scorers(table, host, random.Random(0))["matching-oracle"]


def test_the_simulator_puts_jobs_that_want_the_same_gpu_in_line_for_it() -> None:
    # X (rate 10 for "a") runs an "a" since t=0, expected to take 10 s (the median "a" so far: 100 s at rate 1); Y
    # (rate 5) is free. At t=5 two more "a" wait. The first would end in 5 + 10 = 15 s on X against 20 s on Y: it
    # waits. The second stands behind it: X is next free for it at 15 s, so 25 s there against 20 s on Y: it starts
    # now, on Y (counting only the first GPU to free, both would have waited and the first taken Y)
    from collections import deque

    from hostagent.domain.placement import PlacementRequest
    from hostagent.learn import sim_queue

    views, scorer = sim_host(Table({("a", "X"): 10.0, ("a", "Y"): 5.0}, {"a": 0.0}), [("gx", "X"), ("gy", "Y")])
    state = sim_queue.QueueState(F)
    state.runs["a"] = deque([100.0])
    running = {0: sim_queue.Running("a", 0.0, 10.0)}
    request = PlacementRequest(count=1, task_type="a")
    got, pick = sim_queue.pick(state, [(1, request), (2, request)], views, [False, True], lambda r, i: True, scorer,
                               running, now=5.0)
    assert got == 2 and list(pick.waiting) == ["1"] and pick.passed == ()
    assert pick.waiting["1"].startswith("waiting for a better GPU: predicted to end in 15 s there (free in 5 s) "
                                        "against 20 s")
    # alone, the second would have waited too: its line is empty
    alone, pick = sim_queue.pick(state, [(2, request)], views, [False, True], lambda r, i: True, scorer, running, 5.0)
    assert alone is None and list(pick.waiting) == ["2"]
    # X busy with a job started before the first model (no estimate of its end): nobody counts on it freeing, so the
    # first job starts now on Y (X is not free in 0 s)
    got, pick = sim_queue.pick(state, [(1, request)], views, [False, True], lambda r, i: True, scorer, {}, now=5.0)
    assert got == 1 and pick.waiting == {}
    # no "a" has finished under a model yet: the simulator asks the model for the run time its records show (the
    # agent's queue asks the placer the same); a scorer that has none (the table) leaves the job unable to wait
    class WithRecords:
        def __init__(self, inner: object, run_s: float | None) -> None:
            self.inner, self.run_s = inner, run_s

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def typical_run_s(self, task_type: str) -> float | None:
            return self.run_s if task_type == "a" else None

    fresh = sim_queue.QueueState(F)
    got, pick = sim_queue.pick(fresh, [(1, request)], views, [False, True], lambda r, i: True,
                               WithRecords(scorer, 100.0), running, now=5.0)  # type: ignore[arg-type]
    assert got is None and pick.waiting["1"].startswith("waiting for a better GPU: predicted to end in 15 s there")
    for none_known in (WithRecords(scorer, None), scorer):
        got, pick = sim_queue.pick(sim_queue.QueueState(F), [(1, request)], views, [False, True], lambda r, i: True,
                                   none_known, running, now=5.0)  # type: ignore[arg-type]
        assert got == 1 and pick.waiting == {}


def test_the_simulator_expects_a_job_that_has_run_long_to_run_longer() -> None:
    # run times at rate 1 of the last finished "a": 100, 300 and 1000 s. A new one is expected to run their mean
    # (466.7 s, not the median 300: run times are heavy-tailed and a wait's gain is linear in them). One that has run
    # 200 s is expected to go on as the two that lasted longer did beyond 200 s: (100 + 800) / 2 = 450 s more; one
    # that has outlived them all (1000 s, 1500 s): as long again as it has run
    from collections import deque

    from hostagent.learn import sim_queue

    state = sim_queue.QueueState(F)
    assert state.run_s("a") is None and state.left_s("a", 0.0) is None
    for held, rate in ((50.0, 2.0), (300.0, 1.0), (100.0, 10.0)):
        state.finished("a", held, rate)
    assert state.runs["a"] == deque([100.0, 300.0, 1000.0])
    assert state.run_s("a") == pytest.approx(1400 / 3) and state.left_s("a", 0.0) == pytest.approx(1400 / 3)
    assert state.left_s("a", 200.0) == pytest.approx(450.0)
    assert state.left_s("a", 1000.0) == 1000.0 and state.left_s("a", 1500.0) == 1500.0
    state.finished("a", 0.0, 1.0)  # nothing held: nothing learnt
    assert len(state.runs["a"]) == 3
    # jobs still running count too, each as lasting what it has run plus what it is expected to go on (short jobs
    # finish first: the finished alone would expect every job to be short): one that has run 200 s as 200 + 450 s,
    # one that has outlived them all (1500 s) as as long again (3000 s)
    assert state.run_s("a", [200.0]) == pytest.approx((1400 + 650) / 4)
    assert state.run_s("a", [200.0, 1500.0]) == pytest.approx((1400 + 650 + 3000) / 5)
    assert state.run_s("a", []) == pytest.approx(1400 / 3) and state.run_s("b", [500.0]) is None  # none finished


def test_the_simulator_prices_a_wait_with_the_jobs_still_running() -> None:
    # X runs an "a" at twice Y's rate; one "a" finished after 10 s at rate 1. An "a" that waits for X gains
    # run_s / 1 - run_s / 2 and pays the 40 s until X frees (X's job, started at 0 at rate 2, has run 80 s at rate 1
    # and outlived the finished one: as long again). With the finished one alone the run time is 10 s: waiting gains
    # 5 s and costs 40, so it starts on Y. Counting the job running on X as lasting 160 s, the run time is 85 s:
    # waiting gains 42.5 s, so it waits
    from collections import deque

    from hostagent.domain.placement import PlacementRequest
    from hostagent.learn import sim_queue

    table = Table({("a", "X"): 2.0, ("a", "Y"): 1.0}, {"a": 0.0})
    views, scorer = sim_host(table, [("gx", "X"), ("gy", "Y")])
    state = sim_queue.QueueState(F)
    state.runs["a"] = deque([10.0])
    request = PlacementRequest(count=1, task_type="a")
    ran = sim_queue.Running("a", 0.0, 2.0)
    got, pick = sim_queue.pick(state, [(1, request)], views, [False, True], lambda r, i: True, scorer, {0: ran}, 40.0)
    assert got is None and pick.waiting["1"].startswith("waiting for a better GPU: predicted to end in 82 s there "
                                                        "(free in 40 s) against 85 s")
    # the same job on two GPUs counts once: a second X held by it changes nothing (X's two GPUs: a line of two)
    views2, scorer2 = sim_host(table, [("gx", "X"), ("gy", "Y"), ("gx2", "X")])
    got, pick = sim_queue.pick(sim_queue.QueueState(F, runs={"a": deque([10.0])}), [(1, request)], views2,
                               [False, True, False], lambda r, i: True, scorer2, {0: ran, 2: ran}, 40.0)
    assert got is None and "against 85 s" in pick.waiting["1"]


def test_a_place_in_line_reads_as_english_ordinals() -> None:
    from hostagent.domain.assignment import _nth
    got = [_nth(n) for n in (1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 21, 22, 23, 101, 111, 112, 113, 121, 122, 123)]
    assert got == ["1st", "2nd", "3rd", "4th", "10th", "11th", "12th", "13th", "14th", "20th", "21st", "22nd", "23rd",
                   "101st", "111th", "112th", "113th", "121st", "122nd", "123rd"]


def test_a_place_in_line_keeps_every_other_gpu_of_the_line() -> None:
    one = Candidate("A", 0, 0, now=0.5, best=1.0)
    one.stand_in_line([400.0, 5.0, 10.0], "X")  # its place: the first to free; the others for those behind it
    assert (one.better_in_s, one.later_s, one.best_on) == (5.0, (10.0, 400.0), "X")
    pair = Candidate("P", 0, 0, now=0.5, best=1.0, count=2)
    pair.stand_in_line([100.0, 0.0, 50.0, 70.0], "X")  # a set of 2: when the second frees
    assert (pair.better_in_s, pair.later_s) == (50.0, (0.0, 70.0, 100.0))
    short = Candidate("S", 0, 0, now=0.5, best=1.0, count=3)
    short.stand_in_line([1.0, 2.0], "X")  # fewer of them than it takes: it cannot wait for them
    assert (short.better_in_s, short.later_s, short.best_on) == (None, (), None)
    # in one line, a set that needs more of its GPUs than the line has does not wait, and the next in line still does
    big = Candidate("B", 0, 0, now=0.25, best=1.0, run_s=100.0, better_in_s=5.0, later_s=(), best_on="X", count=2)
    single = Candidate("C", 1, 0, now=0.25, best=1.0, run_s=100.0, better_in_s=5.0, later_s=(), best_on="X")
    assert list(choose([big, single], F, now=0.0).waiting) == ["C"]


def test_a_draw_within_the_models_doubt_weighs_the_wait_and_says_when_it_decided() -> None:
    # A: 1000 s of work at rate 1; the free GPU runs it at 0.5 (2000 s), its best (1.0) frees in 400 s: 1400 s.
    # By the prediction it waits. The model is unsure of the ratio (sd 0.5): a draw of +1.5 deviations puts the
    # rate now at 0.5 * e^0.75 = 1.0585 (945 s, sooner than 1400 s): it starts, and says the draw decided
    def a(doubt: float, now: float = 0.5, sd: float = 0.5) -> Candidate:
        return Candidate("A", 0, 0, now=now, best=1.0, run_s=1000.0, better_in_s=400.0, sd=sd, doubt=doubt)

    assert a(0.0).gains_by_waiting() == (1400.0, 2000.0)
    started = choose([a(1.5)], F, now=0.0)
    assert started.chosen == "A" and started.waiting == {}
    assert started.drawn == {"A": "started rather than wait for a better GPU by a draw within the model's doubt of "
                                  "its rate on the GPUs free now (deviation 0.50, drawn +1.50): 945 s here against "
                                  "1400 s there (free in 400 s); by the prediction alone 2000 s here"}
    # a smaller draw (+0.5: 0.5 * e^0.25 = 0.642, 1558 s) still waits; its reason gives the drawn and predicted ends
    kept = choose([a(0.5)], F, now=0.0)
    assert kept.chosen is None and kept.drawn == {}
    assert kept.waiting["A"] == ("waiting for a better GPU: predicted to end in 1400 s there (free in 400 s) against "
                                 "1558 s on the GPUs free now (50% of its best rate; drawn +0.50 deviations of 0.50 "
                                 "within the model's doubt; 2000 s as predicted)")
    # a draw down may decide a wait: at 0.8 it starts by the prediction (1250 s < 1400 s); drawn -1 deviation,
    # 0.8 * e^-0.5 = 0.485 (2061 s), it waits, and says the prediction alone would have started it
    assert choose([a(0.0, now=0.8)], F, now=0.0).chosen == "A"
    down = choose([a(-1.0, now=0.8)], F, now=0.0)
    assert down.chosen is None and down.drawn == {}
    assert down.waiting["A"] == ("waiting for a better GPU: predicted to end in 1400 s there (free in 400 s) against "
                                 "2061 s on the GPUs free now (80% of its best rate; drawn -1.00 deviations of 0.50 "
                                 "within the model's doubt, which decided: by the prediction alone it would start "
                                 "now, 1250 s here)")
    # second in line for the better GPU: its place frees when the first's run there ends (100 s + 100 s), so the
    # draw is weighed against 200 s + 300 s there; +1 deviation puts it at 600 * e^-0.5 = 364 s here: it starts
    def line(doubt: float) -> list[Candidate]:
        first = Candidate("A", 0, 0, now=0.1, best=1.0, run_s=100.0)
        second = Candidate("B", 1, 0, now=0.5, best=1.0, run_s=300.0, sd=0.5, doubt=doubt)
        for c in (first, second):
            c.stand_in_line([100.0], "X")
        return [first, second]

    second = choose(line(1.0), F, now=0.0)
    assert second.chosen == "B" and list(second.waiting) == ["A"]
    assert second.drawn["B"].endswith("(deviation 0.50, drawn +1.00): 364 s here against 500 s there (free in 200 s); "
                                      "by the prediction alone 600 s here"), second.drawn
    kept = choose(line(0.2), F, now=0.0)  # +0.2: 600 * e^-0.1 = 543 s, later than 500 s: it waits, 2nd in line
    assert kept.waiting["B"] == ("waiting for a better GPU: predicted to end in 500 s there (free in 200 s, 2nd in "
                                 "line for it) against 543 s on the GPUs free now (50% of its best rate; drawn +0.20 "
                                 "deviations of 0.50 within the model's doubt; 600 s as predicted)")
    # a model sure of the ratio (sd 0), or no draw: the prediction decides, whatever the draw
    sure = choose([a(3.0, sd=0.0)], F, now=0.0)
    assert sure.chosen is None and sure.waiting["A"].endswith("(50% of its best rate)") and sure.drawn == {}
    assert choose([a(0.0)], F, now=0.0).waiting["A"].endswith("(50% of its best rate)")


def test_the_draw_is_the_placers_only_where_the_request_may_explore() -> None:
    import random

    from hostagent.domain.placement import Exploration, doubt_draw

    ex = Exploration(epsilon=0.05, max_priority=5)
    assert [doubt_draw(ex, random.Random(7), p) for p in (0, 5)] == [random.Random(7).gauss(0.0, 1.0)] * 2
    rng = random.Random(7)
    assert doubt_draw(ex, rng, 6) == 0.0 and rng.random() == random.Random(7).random()  # above the bound: none drawn
    assert doubt_draw(Exploration(epsilon=0.0, max_priority=5), rng, 0) == 0.0  # exploration off: the prediction
    assert doubt_draw(None, rng, 0) == 0.0 and doubt_draw(ex, None, 0) == 0.0


def test_the_simulator_draws_the_models_doubt_where_a_job_weighs_a_wait() -> None:
    # as test_the_simulator_prices_a_wait_with_the_jobs_still_running: the job waits for X (82 s there against 85 s
    # on Y). With a model unsure of the ratio (0.5 per prediction: 0.71) and a draw of +1 deviation, Y's rate is
    # drawn at e^0.71 = 2.03 (42 s on Y): it starts on Y. Without draws (`QueueState.doubt` None) it waits
    from collections import deque

    from hostagent.domain.placement import PlacementRequest
    from hostagent.learn import sim_queue

    table = Table({("a", "X"): 2.0, ("a", "Y"): 1.0}, {"a": 0.0})
    views, oracle = sim_host(table, [("gx", "X"), ("gy", "Y")])

    class Unsure:
        def covers(self, request: Any) -> bool:
            return True

        def score(self, request: Any, devices: Any) -> Any:
            return oracle.score(request, devices)

        def uncertainty(self, request: Any, devices: Any) -> list[float]:
            return [0.5] * len(devices)

    request = PlacementRequest(count=1, task_type="a")
    ran = sim_queue.Running("a", 0.0, 2.0)
    asked: list[Any] = []

    def draw(r: Any) -> float:
        asked.append(r)
        return 1.0

    for doubt in (None, draw):
        state = sim_queue.QueueState(F, runs={"a": deque([10.0])}, doubt=doubt)
        got, pick = sim_queue.pick(state, [(1, request)], views, [False, True], lambda r, i: True, Unsure(), {0: ran},
                                   40.0)
        if doubt is None:
            assert got is None and "against 85 s" in pick.waiting["1"] and pick.drawn == {}
        else:
            assert got == 1 and "1" in pick.drawn and "42 s here against 82 s there" in pick.drawn["1"], pick
            assert asked == [request]


def test_the_simulator_compares_a_request_the_model_does_not_cover_by_its_predictions() -> None:
    # as the agent's queue (services.placement.Placer.relative_rates): a request of a task type the model does not
    # cover yet is compared by the model's predictions with their deviations (until 2026-12-01 it kept strict serve
    # order). X is busy, Y free: "a" and "b" run there at a tenth of their rate on X, "c" at its best; "b" is not
    # covered, and the model is as sure of it as `sd` says
    from hostagent.domain.placement import PlacementRequest
    from hostagent.learn import sim_queue

    views, oracle = sim_host(Table({("a", "X"): 10.0, ("a", "Y"): 1.0, ("b", "X"): 10.0, ("b", "Y"): 1.0,
                                    ("c", "X"): 1.0, ("c", "Y"): 1.0}, {}), [("gx", "X"), ("gy", "Y")])

    class Partial:  # the table's rates, trusted for placement for every task type but "b"
        def __init__(self, sd: float) -> None:
            self.sd = sd

        def covers(self, request: PlacementRequest) -> bool:
            return request.task_type != "b"

        def score(self, request: PlacementRequest, devices: Sequence[Any]) -> list[float]:
            return oracle.score(request, devices)

        def uncertainty(self, request: PlacementRequest, devices: Sequence[Any]) -> list[float]:
            return [self.sd if request.task_type == "b" else 0.01 for _ in devices]

    a, b, c = (PlacementRequest(count=1, task_type=t) for t in "abc")

    def pick(waiting: list[tuple[int, PlacementRequest]], sd: float = 0.01) -> tuple[int | None, str]:
        got, p = sim_queue.pick(sim_queue.QueueState(F), waiting, views, [False, True], lambda r, i: True,
                                Partial(sd), {}, 0.0)
        return got, p.reason

    # comparative advantage: "c" (100 % of its best on Y) passes "a" (10 %), and "b" (10 %) where the model is sure
    for waiting in ([(2, a), (1, c)], [(0, b), (2, a), (1, c)], [(2, a), (0, b), (1, c)]):
        got, why = pick(waiting)
        assert got == 1 and why.startswith("comparative advantage"), (waiting, why)
    # unsure of "b" (2.0 per prediction, 2.83 for the ratio, above ln 10): "b" and "c" count as equal, "b" first
    got, why = pick([(0, b), (2, a), (1, c)], sd=2.0)
    assert got == 0 and why.startswith("first in serve order") and "within the model's uncertainty" in why, why
