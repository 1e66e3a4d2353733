"""The agent's retraining of its placement model: every `placement.retrain_interval_s`, and as its records grow.

A fresh host has no model, and the cold-start rule places until one is trained. Retraining on the interval alone
(6 h by default) would keep a busy host on that rule for its first six hours whatever it had learned meanwhile, and
then leave its first model, fitted on the fewest records, in charge for six more. So the agent also counts the
store's finished leases (every host's on a shared store: training reads them all) every
`placement.model_check_interval_s`, and trains as soon as there are `placement.min_records` of them, again at each
new finished lease while a training finds too few labelled records, then each time they reach
`placement.retrain_growth` times the count the model in use was trained at (:class:`GrowthSchedule`, the rule the
simulator's learned policy follows too: what the harness evaluates is what the agent does). An agent that starts
with a model counts from the records it finds. A training either way promotes a model only when it does no worse
than the active one (learn.lifecycle.train), the model follower then loads it (services.model_follow: the placement
page says which retraining promoted it), and no two trainings run at once.

Each fit runs in a worker thread on `placement.train_threads` threads: a host's CPUs are its guests' vCPUs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hostagent.config import PlacementSettings
from hostagent.domain.errors import HostAgentError
from hostagent.domain.retraining import GrowthSchedule
from hostagent.services.model_follow import GROWN, RETRAIN

log = logging.getLogger("hostagent.placement")
TRAININGS_KEPT = 20  # Retrainer.trainings


class Retrainer:
    """The scheduled and the growth-triggered retraining (see the module's docstring)."""

    def __init__(self, settings: PlacementSettings, store: Callable[[], Any], *,
                 load: Callable[[str], Awaitable[None]], in_use: Callable[[], bool]) -> None:
        self.settings = settings
        self._store = store  # the AsyncUsageStore (opened after the runtime is built)
        self._load = load  # follow the store's active model now, saying why (Runtime._load_model)
        self._in_use = in_use  # whether a model places requests now
        self.schedule = GrowthSchedule(first=settings.min_records, growth=settings.retrain_growth)
        self.started = False  # set once the model the agent started with is loaded and counted
        self.checks = 0  # growth checks made (the tests read it)
        self.trainings: list[tuple[str, int, str]] = []  # (why, finished leases then, decision), newest last
        self._lock = asyncio.Lock()
        self._unreadable = False

    async def start(self) -> None:
        """After the start's model check: an agent with a model counts its growth from the records it finds."""
        if self._in_use():
            count = await self._count()
            if count is not None:
                self.schedule.trained(count, in_use=True)
        self.started = True

    async def scheduled(self) -> None:
        """The interval's retraining (whatever the count)."""
        async with self._lock:
            await self._train(RETRAIN, await self._count())

    async def if_grown(self) -> None:
        """Train when the finished leases have grown as the schedule says."""
        if not self.started or self.schedule.growth == 0 or self._lock.locked():
            return
        async with self._lock:
            self.checks += 1
            count = await self._count()
            if count is not None and self.schedule.due(count):
                await self._train(GROWN, count)

    async def _count(self) -> int | None:
        try:
            count = await self._store().finished_leases()
        except HostAgentError as exc:
            if not self._unreadable:
                log.warning("retraining: the store's finished leases cannot be counted (%s); trying again",
                            exc.message)
            self._unreadable = True
            return None
        self._unreadable = False
        return int(count)

    async def _train(self, how: str, count: int | None) -> None:
        from hostagent.learn.lifecycle import train  # scikit-learn: imported by the first training only

        pl = self.settings
        decision = "failed"
        try:
            result = await asyncio.to_thread(limit_threads(train, pl.train_threads), self._store().store,
                                             target=pl.outcome, min_records=pl.min_records)
            decision = str(result.decision)
            log.info("retraining: %s (%s, %s finished leases)", decision, how, "?" if count is None else count)
            await self._load(how)
        finally:  # a training that failed is not tried again at once: at the next finished lease, or the interval
            if count is not None:
                self.schedule.trained(count, in_use=self._in_use())
                self.trainings.append((how, count, decision))
                del self.trainings[:-TRAININGS_KEPT]


def limit_threads(fn: Callable[..., Any], threads: int) -> Callable[..., Any]:
    """`fn`, its native thread pools (scikit-learn's OpenMP, BLAS) limited to `threads` threads while it runs; 0: `fn`
    as it is (a thread per CPU, or OMP_NUM_THREADS). The limit is set in the thread that calls `fn` (the worker
    thread): an OpenMP limit, the trees', holds only in the thread that sets it."""
    if threads <= 0:
        return fn

    def limited(*args: Any, **kwargs: Any) -> Any:
        import sklearn.ensemble  # noqa: F401 - a limit reaches only the libraries loaded already: its OpenMP runtime
        from threadpoolctl import threadpool_limits

        # threadpool_limits is process-wide while active for a pool the process shares (OpenBLAS's own threads):
        # whatever else runs meanwhile gets the limit too. Retrainings never overlap (Retrainer's lock), so no two
        # limits restore each other's values.
        with threadpool_limits(limits=threads):
            return fn(*args, **kwargs)
    return limited
