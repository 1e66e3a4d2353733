"""domain.retraining.GrowthSchedule: when the placement model is trained again as its records grow, the rule the
agent (services.retraining, tests/adapters/test_retraining.py) and the simulator's learned policy share."""

from __future__ import annotations

import pytest

from hostagent.domain.errors import InvalidInput
from hostagent.domain.retraining import GrowthSchedule


def trainings(schedule: GrowthSchedule, upto: int, *, in_use_from: int = 0) -> list[int]:
    """The record counts, one more at a time up to `upto`, at which a training runs; a training leaves a model in
    use from `in_use_from` records."""
    out = []
    for n in range(upto + 1):
        if schedule.due(n):
            schedule.trained(n, in_use=n >= in_use_from)
            out.append(n)
    return out


def test_the_first_at_first_records_then_each_time_they_double() -> None:
    assert trainings(GrowthSchedule(first=30), 1000) == [30, 60, 120, 240, 480, 960]


def test_at_most_most_records_apart() -> None:
    assert trainings(GrowthSchedule(first=100, most=500), 2000) == [100, 200, 400, 800, 1300, 1800]


def test_another_growth_factor() -> None:
    assert trainings(GrowthSchedule(first=10, growth=1.5), 60) == [10, 15, 23, 35, 53]


def test_a_training_that_leaves_no_model_in_use_is_tried_again_at_the_next_record() -> None:
    assert trainings(GrowthSchedule(first=30), 130, in_use_from=34) == [30, 31, 32, 33, 34, 68]


def test_never_twice_at_one_count() -> None:
    s = GrowthSchedule(first=5)
    assert s.due(5)
    s.trained(5, in_use=False)
    assert not s.due(5) and not s.due(4) and s.due(6)


def test_an_agent_that_starts_with_a_model_counts_from_there() -> None:
    s = GrowthSchedule(first=30)
    s.trained(500, in_use=True)
    assert not s.due(999) and s.due(1000)


def test_growth_0_never_trains() -> None:
    assert trainings(GrowthSchedule(first=1, growth=0), 10_000) == []


@pytest.mark.parametrize("growth", [1.0, 0.99, -1.0])
def test_growth_must_be_0_or_above_1(growth: float) -> None:
    with pytest.raises(InvalidInput) as info:
        GrowthSchedule(first=30, growth=growth)
    assert info.value.field == "retrain_growth"
