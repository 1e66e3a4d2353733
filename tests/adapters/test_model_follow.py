"""The running agent follows the usage store's active placement model (#21, services.model_follow): a model trained,
rolled back or deactivated elsewhere (the CLI's library calls, over their own store connection) places the next
lease within `placement.model_check_interval_s`; each switch is journaled and shown on the placement page; a version
whose artifact does not load leaves the model in use as it is."""

from __future__ import annotations

import asyncio
import html
import logging
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.config import Settings, settings_from_dict
from hostagent.domain.errors import ConfigError
from hostagent.learn import lifecycle
from hostagent.services.model_follow import CHANGE_KIND, FAILED_KIND
from hostagent.store.repo import UsageStore
from tests.support.agent import AgentRig, make_rig, operator_login, start_rig
from tests.support.learn import fill_store
from tests.support.waits import until

CHANGES = re.compile(r'<table class="model-changes">(.*?)</table>', re.S)
CHECK_S = 0.1  # the tests' placement.model_check_interval_s
FOLLOW_WAIT_S = 30.0  # bound on a follow: many check intervals, plus scikit-learn's first import on a busy machine
T0 = 1_700_000_000.0


async def agent(tmp: Path, aiohttp_client: Any, check_s: float = CHECK_S, **sections: Any) -> AgentRig:
    """An agent with a SQLite usage store and no model yet, logged in to the dashboard as the operator; its start
    check done. It never retrains as its records grow (placement.retrain_growth 0: test_retraining's): only the
    trainings made elsewhere change its model."""
    rig = make_rig(tmp, placement={"model_check_interval_s": check_s, "explore_epsilon": 0.0,
                                   "cold_explore_epsilon": 0.0, "retrain_growth": 0}, **sections)
    rig = await start_rig(rig, aiohttp_client)
    await until(lambda: rig.runtime.models.checks >= 1, FOLLOW_WAIT_S, "the start check")
    await operator_login(rig)
    return rig


class Elsewhere:
    """The store as `hostagent model train|rollback` opens it: its own connection, beside the running agent."""

    def __init__(self, rig: AgentRig, tmp: Path) -> None:
        self.url, self.tmp, self.batches = rig.settings.store_url, tmp, 0
        self.store = UsageStore(self.url, "elsewhere", spool_path=tmp / "cli-spool.sqlite3")

    async def train(self, n: int = 120) -> str:
        """Finished leases newer than any before, then a training that promotes its model; the version."""
        await asyncio.to_thread(fill_store, self.url, "fleet-1", self.tmp / f"fill{self.batches}.sqlite3", n,
                                T0 + 100_000.0 * self.batches, self.batches + 3)
        self.batches += 1
        res = await asyncio.to_thread(lifecycle.train, self.store, min_records=100, tolerance=10.0)
        assert res.decision == "promoted" and res.version, res.metrics
        return res.version

    async def rollback(self) -> str:
        return str((await asyncio.to_thread(lifecycle.rollback, self.store))["active"])

    def close(self) -> None:
        self.store.close()


async def placed_by(rig: AgentRig) -> str:
    """The reason of a new lease that says which rule, and which model, placed it (the lease released again)."""
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "task_type": "a"}, headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 201, body
    got = await (await rig.client.get(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))).json()
    assert got["reasons"] == body["reasons"]  # GET /v1/leases/{id} says it too
    assert (await rig.client.delete(f"/v1/leases/{body['id']}", headers=rig.auth("vm-a"))).status == 200
    leases = rig.runtime.manager.leases
    await until(lambda: body["id"] not in leases, 10, "the release")
    (rule,) = [x for x in body["reasons"] if x.startswith("rule=")]
    # the lease's placement record names the model too (None where a rule decided), as journaled
    version = got["placement"]["model_version"]
    assert (version is None) == rule.startswith("rule=cold-start") and (version is None or version in rule), got
    return str(rule)


def scored_by(version: str) -> str:
    return f"rule=model: scored by {version} (predicted relative work rate)"


async def follows(rig: AgentRig, version: str | None) -> None:
    await until(lambda: rig.runtime.placer.model_version == version, FOLLOW_WAIT_S, f"the agent follows {version}")


async def change_rows(rig: AgentRig) -> list[list[str]]:
    """The placement page's "Model changes" table: [when, from, to, why] per row, newest first."""
    page = await (await rig.client.get("/ui/model")).text()
    assert "<h2>Model changes</h2>" in page
    table = CHANGES.search(page)
    assert table is not None
    rows = re.findall(r"<tr><td class=\"nowrap\">(.*?)</tr>", table.group(1), re.S)
    cells = (re.findall(r"(?:^|<td[^>]*>)(.*?)</td>", row, re.S) for row in rows)
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in row] for row in cells]


def journaled(rig: AgentRig, kind: str = CHANGE_KIND) -> list[str]:
    return [str(e.detail) for e in rig.runtime.journal.events(kinds=[kind], limit=100)]


async def test_a_model_trained_while_the_agent_runs_places_the_next_lease(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await agent(tmp_path, aiohttp_client)
    assert rig.runtime.placer.model_version is None
    assert (await placed_by(rig)).startswith("rule=cold-start (no active model)")
    assert await change_rows(rig) == []
    cli = Elsewhere(rig, tmp_path)
    try:
        version = await cli.train()
        await follows(rig, version)
        assert rig.runtime.placement_rule == "model"
        assert scored_by(version) in await placed_by(rig)
        want = (f"placement model none (cold-start rule) -> {version}: followed the store: a newer model was trained "
                "and activated (hostagent model train, or another agent's retraining)")
        assert journaled(rig) == [want]
        (row,) = await change_rows(rig)
        assert row[0].endswith(" UTC") and row[1:] == ["none (cold-start rule)", version, want.split(": ", 1)[1]]
        page = await (await rig.client.get("/ui/model")).text()
        assert f'<dd class="mono">{version}</dd>' in page  # the model in use
        # the active version is read from its metadata at each check; its artifact only when it changed
        reads: list[bool] = []
        real = rig.runtime.store.store.get_model_version

        def spy(*args: Any, **kw: Any) -> Any:
            reads.append(kw.get("with_artifact", True))
            return real(*args, **kw)

        rig.runtime.store.store.get_model_version = spy
        seen = rig.runtime.models.checks
        await until(lambda: rig.runtime.models.checks >= seen + 3, FOLLOW_WAIT_S, "three more checks")
        assert reads and not any(reads)
    finally:
        cli.close()


async def test_a_rollback_is_followed_back(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await agent(tmp_path, aiohttp_client)
    cli = Elsewhere(rig, tmp_path)
    try:
        first = await cli.train()
        await follows(rig, first)
        second = await cli.train(60)
        assert second != first
        await follows(rig, second)
        assert scored_by(second) in await placed_by(rig)
        assert await cli.rollback() == first
        await follows(rig, first)
        assert scored_by(first) in await placed_by(rig)
        rows = await change_rows(rig)
        assert [r[1:3] for r in rows] == [[second, first], [first, second], ["none (cold-start rule)", first]]
        assert rows[0][3] == "followed the store: an older version was activated again (hostagent model rollback)"
        assert rows[1][3].startswith("followed the store: a newer model was trained")
        assert journaled(rig)[-1].startswith(f"placement model {second} -> {first}: followed the store: an older")
        changes = list(rig.runtime.models.changes)
        assert [c.how for c in changes] == ["trained", "trained", "rolled back"]
        assert changes[0].at <= changes[1].at <= changes[2].at
    finally:
        cli.close()


async def test_deactivating_every_model_returns_to_the_cold_start_rule(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await agent(tmp_path, aiohttp_client)
    cli = Elsewhere(rig, tmp_path)
    try:
        version = await cli.train()
        await follows(rig, version)
        db = sqlite3.connect(rig.settings.store_url[len("sqlite:///"):])
        with db:
            db.execute("UPDATE model_versions SET active = 0")
        db.close()
        await follows(rig, None)
        assert rig.runtime.placement_rule == "cold-start"
        assert (await placed_by(rig)).startswith("rule=cold-start (no active model)")
        assert journaled(rig)[-1] == (f"placement model {version} -> none (cold-start rule): followed the store: no "
                                      "model is active any more (deactivated or removed), the cold-start rule decides")
        rows = await change_rows(rig)
        assert rows[0][1:3] == [version, "none (cold-start rule)"] and len(rows) == 2
        page = await (await rig.client.get("/ui/model")).text()
        assert "none (cold-start rule)</dd>" in page
    finally:
        cli.close()


async def test_a_version_that_does_not_load_keeps_the_model_in_use(tmp_path: Path, aiohttp_client: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hostagent.placement")
    rig = await agent(tmp_path, aiohttp_client)
    cli = Elsewhere(rig, tmp_path)
    try:
        good = await cli.train()
        await follows(rig, good)
        await asyncio.to_thread(cli.store.save_model_version, "placement-broken", artifact=b"not a model",
                                activate=True, created_at=time.time())
        follower = rig.runtime.models
        await until(lambda: "placement-broken" in follower.failed, FOLLOW_WAIT_S, "the failed load")
        seen = follower.checks
        await until(lambda: follower.checks >= seen + 5, FOLLOW_WAIT_S, "five more checks")
        assert rig.runtime.placer.model_version == good
        assert scored_by(good) in await placed_by(rig)
        warned = [r for r in caplog.records if "cannot load placement model placement-broken" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]  # once, not at every check
        (failed,) = journaled(rig, FAILED_KIND)
        assert failed.startswith("placement model placement-broken could not be loaded (") and failed.endswith(
            f"kept {good}")
        assert journaled(rig) == [journaled(rig)[0]]  # no switch was recorded
        page = await (await rig.client.get("/ui/model")).text()
        assert "The store&#39;s active model placement-broken could not be loaded" in page
        # the follower goes on: the next training (which does not need the broken artifact: it trains as if no
        # model were active) is followed
        again = await cli.train()
        await follows(rig, again)
    finally:
        cli.close()


async def test_the_check_interval_is_placement_model_check_interval_s(tmp_path: Path, aiohttp_client: Any) -> None:
    """Two agents on one store: the one that checks every 0.1 s follows a new model, the one that checks every hour
    (its start check done) is still on the cold-start rule after the first has checked many times more."""
    fast = await agent(tmp_path / "fast", aiohttp_client, check_s=CHECK_S)
    url = fast.settings.store_url
    slow = await agent(tmp_path / "slow", aiohttp_client, check_s=3600.0, store={"url": url},
                       agent={"host_id": "slow-host"})
    assert slow.settings.placement.model_check_interval_s == 3600.0 and slow.settings.store_url == url
    cli = Elsewhere(fast, tmp_path)
    try:
        version = await cli.train()
        await follows(fast, version)
        seen = fast.runtime.models.checks
        await until(lambda: fast.runtime.models.checks >= seen + 10, FOLLOW_WAIT_S, "ten more checks")
        assert slow.runtime.models.checks == 1 and slow.runtime.placer.model_version is None
        assert (await placed_by(slow)).startswith("rule=cold-start (no active model)")
        # its next check (the periodic one, or its retraining's) follows the store
        await slow.runtime.models.check()
        assert slow.runtime.placer.model_version == version
    finally:
        cli.close()


def test_the_key_defaults_to_30_s_and_must_be_positive() -> None:
    assert Settings().placement.model_check_interval_s == 30.0
    for bad in (0, -1.0):
        with pytest.raises(ConfigError) as info:
            settings_from_dict({"placement": {"model_check_interval_s": bad}})
        assert info.value.field == "placement.model_check_interval_s"
