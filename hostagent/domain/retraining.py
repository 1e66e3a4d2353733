"""When the placement model is trained again as its records grow: the same rule in the running agent
(`placement.retrain_growth`, :mod:`hostagent.services.retraining`) and in the simulator's learned policy
(:mod:`hostagent.learn.simulate`), so what the harness evaluates is what the agent does."""

from __future__ import annotations

from dataclasses import dataclass

from hostagent.domain.errors import InvalidInput


@dataclass
class GrowthSchedule:
    """When to train again as the records grow, in the agent (`placement.retrain_growth`, services.retraining) and in
    the simulator's learned policy alike: the first training as soon as there are ``first`` records, again at each
    new record while a training leaves no model in use (too few labelled records yet), then each time the records
    reach ``growth`` times the count the last training that left a model in use saw, at most ``most`` records later
    where set (the harness's `--retrain-every`; the agent's `placement.retrain_interval_s` retrains besides).
    ``growth`` 0: never (the interval alone retrains). A young model is fitted on the fewest records, and each
    doubling of them is what improves it most."""

    first: int
    growth: float = 2.0
    most: int | None = None
    trained_at: int | None = None  # the records when a training last left a model in use
    tried_at: int | None = None  # the records when a training last ran

    def __post_init__(self) -> None:
        if self.growth != 0 and not self.growth > 1:
            raise InvalidInput(f"growth must be 0 (off) or above 1, not {self.growth}", field="retrain_growth")

    def due(self, records: int) -> bool:
        """Whether a training is due with this many records."""
        if self.growth == 0 or (self.tried_at is not None and records <= self.tried_at):
            return False
        if self.trained_at is None:
            return records >= self.first
        step = (self.growth - 1.0) * self.trained_at
        if self.most is not None:
            step = min(step, self.most)
        return records >= self.trained_at + max(1.0, step)

    def trained(self, records: int, *, in_use: bool) -> None:
        """A training ran on this many records; ``in_use``: a model places requests after it."""
        self.tried_at = records
        if in_use:
            self.trained_at = records
