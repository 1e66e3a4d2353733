"""The agent retrains as its records grow (#21, services.retraining, placement.retrain_growth): its first model as
soon as placement.min_records leases have finished, not at the first placement.retrain_interval_s, then each time the
finished leases reach retrain_growth times those its model was trained at, as the simulator's learned policy does
(domain.retraining.GrowthSchedule, whose rule is tested in tests/unit/test_retraining.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from hostagent.config import Settings, settings_from_dict
from hostagent.domain.errors import ConfigError
from hostagent.learn import lifecycle
from hostagent.services.model_follow import GROWN, WHY
from hostagent.store.repo import UsageStore
from tests.support.agent import AgentRig, make_rig, operator_login, start_rig
from tests.support.learn import fill_store
from tests.support.waits import until

CHECK_S = 0.1  # placement.model_check_interval_s: how often the agent counts its records
WAIT_S = 30.0  # bound on a training and its load (scikit-learn's first import on a busy machine)
T0 = 1_700_000_000.0


class Records:
    """Finished leases written to the agent's store over a connection of their own, as the agent's mirror (or
    another host of the fleet) would write them; each batch newer than the last. The leases of a batch are written
    one by one: the agent's counting is held meanwhile (`Retrainer.started`), so that each of its checks sees whole
    batches and the counts the tests name."""

    def __init__(self, rig: AgentRig, tmp: Path) -> None:
        self.rig, self.url, self.tmp, self.batches, self.total = rig, rig.settings.store_url, tmp, 0, 0

    async def add(self, n: int, fill: Any = None) -> int:
        """`n` more finished leases (`fill(url, spool, n)` writes them, else fill_store); how many there are now."""
        retrainer = self.rig.runtime.retrainer
        started, retrainer.started = retrainer.started, False
        spool = self.tmp / f"fill{self.batches}.sqlite3"
        try:
            if fill is None:
                await asyncio.to_thread(fill_store, self.url, "fleet-1", spool, n, T0 + 100_000.0 * self.batches,
                                        self.batches + 3)
            else:
                await asyncio.to_thread(fill, self.url, spool, n)
        finally:
            retrainer.started = started
        self.batches += 1
        self.total += n
        return self.total


async def agent(tmp: Path, aiohttp_client: Any, **placement: Any) -> AgentRig:
    """An agent with a SQLite usage store, its retraining counting the records every CHECK_S; its start done."""
    rig = make_rig(tmp, placement={"model_check_interval_s": CHECK_S, "min_records": 30, **placement})
    rig = await start_rig(rig, aiohttp_client)
    await until(lambda: rig.runtime.retrainer.started, WAIT_S, "the start's model check and count")
    await operator_login(rig)
    return rig


async def checks(rig: AgentRig, n: int = 5) -> None:
    """Wait for `n` more growth checks (each counts the store's finished leases)."""
    seen = rig.runtime.retrainer.checks
    await until(lambda: rig.runtime.retrainer.checks >= seen + n, WAIT_S, f"{n} more growth checks")


async def test_a_fresh_agent_trains_its_first_model_once_it_has_min_records_then_as_they_grow(
        tmp_path: Path, aiohttp_client: Any) -> None:
    """placement.retrain_growth 1.5: the first model at 40 finished leases (placement.min_records 30), the next
    training at 60, not at 55 (nor at twice 40, the default's)."""
    rig = await agent(tmp_path, aiohttp_client, retrain_growth=1.5)
    rt = rig.runtime
    assert rt.settings.placement.retrain_interval_s == 6 * 3600.0  # the interval alone would wait six hours
    records = Records(rig, tmp_path)
    assert await records.add(20) == 20
    await checks(rig)
    assert rt.retrainer.trainings == [] and rt.placer.model_version is None  # 20 < placement.min_records
    assert await records.add(20) == 40
    await until(lambda: rt.placer.model_version is not None, WAIT_S, "the first model")
    first = rt.placer.model_version
    assert rt.retrainer.trainings == [("grown", 40, "promoted")]
    assert rt.retrainer.schedule.trained_at == 40
    (change,) = rt.models.changes
    assert (change.before, change.after, change.how) == (None, first, GROWN)
    page = await (await rig.client.get("/ui/model")).text()
    assert WHY[GROWN].replace("'", "&#39;") in page  # the placement page says which retraining promoted it
    assert await records.add(15) == 55  # under 1.5 x 40
    await checks(rig)
    assert len(rt.retrainer.trainings) == 1 and rt.placer.model_version == first
    assert await records.add(10) == 65  # 1.5 x 40 reached
    await until(lambda: len(rt.retrainer.trainings) == 2, WAIT_S, "the second training")
    how, count, decision = rt.retrainer.trainings[1]
    assert (how, count) == ("grown", 65) and decision in ("promoted", "kept-current")
    store = UsageStore(rig.settings.store_url, "reader", spool_path=tmp_path / "reader.sqlite3")
    try:
        versions = lifecycle.show(store)
    finally:
        store.close()
    assert len(versions) == 2 and versions[-1]["version"] == first  # newest first: both trainings saved a version
    await checks(rig)
    assert len(rt.retrainer.trainings) == 2  # next at 97.5


async def test_a_training_short_of_labelled_records_is_tried_again_at_the_next_finished_lease(
        tmp_path: Path, aiohttp_client: Any) -> None:
    """40 finished leases, 25 of them without a work rate (their guests reported none): the training finds 15
    labelled records, under placement.min_records, and the next is due at the next finished lease, not at twice 40."""
    rig = await agent(tmp_path, aiohttp_client)
    rt = rig.runtime
    records = Records(rig, tmp_path)
    await records.add(15)
    await records.add(25, unlabelled)
    await until(lambda: len(rt.retrainer.trainings) == 1, WAIT_S, "a training")
    assert rt.retrainer.trainings == [("grown", 40, "insufficient-records")] and rt.placer.model_version is None
    assert rt.retrainer.schedule.trained_at is None
    await checks(rig)
    assert len(rt.retrainer.trainings) == 1  # no new finished lease: not tried again
    await records.add(20)
    await until(lambda: rt.placer.model_version is not None, WAIT_S, "the model")
    assert rt.retrainer.trainings[-1] == ("grown", 60, "promoted")


def unlabelled(url: str, spool: Path, n: int) -> None:
    """`n` finished leases on g0 whose guests reported no usage: records no training can label."""
    store = UsageStore(url, "fleet-2", spool_path=spool)
    try:
        for i in range(n):
            t = T0 - 10_000.0 + 100.0 * i
            store.insert_lease({"id": f"U-{i}", "domain_uuid": "00000000-0000-4000-8000-000000000002",
                                "state": "RELEASED", "created_at": t, "granted_at": t, "ended_at": t + 50,
                                "end_reason": "released", "granted_gpus": 1, "request": {"gpus": 1, "task_type": "a"},
                                "devices": [{"gpu_id": "g0"}]})
    finally:
        store.close()


async def test_an_agent_that_starts_with_a_model_counts_from_the_records_it_finds(
        tmp_path: Path, aiohttp_client: Any) -> None:
    rig = make_rig(tmp_path, placement={"model_check_interval_s": CHECK_S, "min_records": 30})
    records = Records(rig, tmp_path)
    await records.add(120)
    store = UsageStore(rig.settings.store_url, "elsewhere", spool_path=tmp_path / "cli-spool.sqlite3")
    try:
        trained = await asyncio.to_thread(lifecycle.train, store, min_records=30)
    finally:
        store.close()
    assert trained.decision == "promoted"
    rig = await start_rig(rig, aiohttp_client)
    rt = rig.runtime
    await until(lambda: rt.retrainer.started, WAIT_S, "the start")
    assert rt.placer.model_version == trained.version and rt.retrainer.schedule.trained_at == 120
    await checks(rig)
    assert rt.retrainer.trainings == []  # 120 finished leases, not twice 120
    await records.add(120)
    await until(lambda: len(rt.retrainer.trainings) == 1, WAIT_S, "the training at twice 120")
    assert rt.retrainer.trainings[0][:2] == ("grown", 240)


async def test_placement_retrain_growth_0_leaves_the_interval_alone(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await agent(tmp_path, aiohttp_client, retrain_growth=0)
    rt = rig.runtime
    await Records(rig, tmp_path).add(100)
    for _ in range(5):
        await rt.retrainer.if_grown()  # what its timer would call
    await asyncio.sleep(10 * CHECK_S)
    assert rt.retrainer.trainings == [] and rt.placer.model_version is None
    await rt.retrainer.scheduled()  # the interval's training still runs
    assert rt.retrainer.trainings == [("retrain", 100, "promoted")] and rt.placer.model_version is not None


def test_the_key_defaults_to_2_and_is_0_or_above_1() -> None:
    assert Settings().placement.retrain_growth == 2.0
    assert settings_from_dict({"placement": {"retrain_growth": 0}}).placement.retrain_growth == 0
    assert settings_from_dict({"placement": {"retrain_growth": 1.5}}).placement.retrain_growth == 1.5
    for bad in (1.0, 0.5, -2.0):
        with pytest.raises(ConfigError) as info:
            settings_from_dict({"placement": {"retrain_growth": bad}})
        assert info.value.field == "placement.retrain_growth"
