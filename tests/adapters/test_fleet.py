"""The fleet (issue #20): agents sharing one usage store publish their live state there (services.fleet), and any of
them shows all of them: the fleet page (/ui/fleet), its JSON twin (GET /v1/fleet) and the overview's hosts block.
Three real agents on the real MariaDB (these FAIL, never skip, without it): each host's GPU states after a lease on
one of them, an idle candidate, a host that stopped publishing marked stale, a host stopped cleanly, and the fleet
model trained from every host's records and followed by each. The fast half runs on SQLite."""

from __future__ import annotations

import asyncio
import html
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hostagent.config import Settings, settings_from_dict
from hostagent.domain.errors import ConfigError
from hostagent.domain.reclaim import Action
from hostagent.learn import lifecycle
from hostagent.learn.records import examples_from_records
from hostagent.services.fleet import STALE_INTERVALS, dashboard_url, fleet_view
from hostagent.store.repo import UsageStore
from tests.support.agent import AgentRig, make_rig, operator_login, start_rig
from tests.support.placement import FakeStore, gpu_rows, store_records
from tests.support.store import mysql_database, mysql_query, mysql_url
from tests.support.waits import until

FAST_S = 0.2  # the tests' store.fleet_publish_interval_s
WAIT_S = 30.0  # bound on anything a publish or a model check brings about (busy 2-CPU machines)
DGX8 = 8  # GPUs of the rigs' fake host


# -- helpers ---------------------------------------------------------------------------------------------------------
async def fleet_agent(tmp: Path, aiohttp_client: Any, host: str, url: str, **sections: Any) -> AgentRig:
    """An agent named `host` on the store `url`, publishing every FAST_S unless told, logged in to the dashboard."""
    store = {"url": url, "fleet_publish_interval_s": FAST_S, **sections.pop("store", {})}
    agent = {"host_id": host, **sections.pop("agent", {})}
    rig = await start_rig(make_rig(tmp / host, store=store, agent=agent,
                                   placement={"model_check_interval_s": 3600.0}, **sections), aiohttp_client)
    await operator_login(rig)
    return rig


async def fleet_json(rig: AgentRig) -> dict[str, Any]:
    r = await rig.client.get("/v1/fleet", headers=rig.auth("operator"))
    body = await r.json()
    assert r.status == 200, body
    return dict(body)


def hosts_of(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {h["id"]: h for h in body["hosts"]}


async def lease(rig: AgentRig, vm: str, gpus: int = 1, util: float | None = None, work: float | None = None,
                task: str = "training") -> dict[str, Any]:
    """A granted lease of `vm`; with `util`, one heartbeat of samples of it on each GPU (and 1 GiB of memory in use
    when busy, none when idle: memory in use counts as busy for the reaper)."""
    r = await rig.client.post("/v1/leases", json={"gpus": gpus, "task_type": task}, headers=rig.auth(vm))
    body = await r.json()
    assert r.status == 201, body
    if util is not None:
        now = time.time()
        mem = 2**30 if util > 5 else 0
        samples = [{"ts": now + k * 0.01, "gpu": d["gpu_id"], "util_pct": util, "mem_used_bytes": mem,
                    **({"work_rate": work} if work is not None else {})}
                   for d in body["devices"] for k in range(5)]
        hb = await rig.client.post(f"/v1/leases/{body['id']}/heartbeat", json={"samples": samples},
                                   headers=rig.auth(vm))
        assert hb.status == 200, await hb.text()
    return dict(body)


def publisher_task(rig: AgentRig) -> asyncio.Task[Any]:
    (task,) = [t for t in rig.runtime.tasks if "FleetPublisher.run" in repr(t.get_coro())]
    return task


def row_html(page: str, host: str) -> str:
    """The fleet table's row of one host."""
    m = re.search(rf'<tr data-host="{re.escape(host)}"[^>]*>(.*?)</tr>', page, re.S)
    assert m is not None, f"no row for {host}"
    return m.group(0)


def text_of(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


@pytest.fixture
def mariadb() -> Iterator[tuple[str, str]]:
    """(database, URL) of a fresh database on the real MariaDB. Asked for before aiohttp_client, so that it is
    dropped only after the agents the test started have stopped."""
    with mysql_database("ha_fleet") as name:
        yield name, mysql_url(name)


# -- three hosts on the real MariaDB -----------------------------------------------------------------------------------
async def test_three_hosts_on_mariadb_show_each_others_gpus_idle_candidates_and_staleness(
        tmp_path: Path, mariadb: tuple[str, str], aiohttp_client: Any) -> None:
    db, url = mariadb
    reclaim = {"enabled": True, "check_interval_s": 3600.0, "grace_s": 3600.0, "min_lease_age_s": 0.0,
               "idle_util_pct": 5.0}
    a = await fleet_agent(tmp_path, aiohttp_client, "host-a", url, agent={"public_url": "http://a.example:8470"})
    b = await fleet_agent(tmp_path, aiohttp_client, "host-b", url, agent={"public_url": "https://b.example/"},
                          reclaim=reclaim)
    c = await fleet_agent(tmp_path, aiohttp_client, "host-c", url, agent={"public_url": "http://c.example:8470"})
    # host a: a busy 2-GPU lease; host b: a lease whose guest idles, on strike one
    busy = await lease(a, "vm-a", gpus=2, util=70.0)
    idle = await lease(b, "vm-b", util=1.0)
    verdict = await b.runtime.reaper.check(idle["id"], time.time() + 1.0, b.runtime.host.vfio_interrupts())
    assert verdict is Action.STRIKE_ONE, verdict

    def settled(body: dict[str, Any]) -> bool:
        h = hosts_of(body)
        return (set(h) == {"host-a", "host-b", "host-c"} and h["host-a"]["states"].get("leased") == 2
                and h["host-b"]["states"].get("warned") == 1 and body["totals"]["idle"] == 1
                and h["host-a"].get("util_reporting") == 2)  # a snapshot taken after host a's heartbeat

    seen: dict[str, Any] = {}

    async def poll() -> bool:
        seen["body"] = await fleet_json(c)
        return settled(seen["body"])

    deadline = time.monotonic() + WAIT_S
    while not await poll():
        assert time.monotonic() < deadline, f"the fleet as host c reads it never settled: {seen['body']}"
        await asyncio.sleep(0.05)
    body = seen["body"]
    hosts = hosts_of(body)
    # the store holds what each agent published: its GPUs' states, one hosts row each
    states = dict(((h, g), s) for h, g, s in mysql_query(db, "SELECT host_id, gpu_id, state FROM gpus"))
    assert sum(1 for (h, _), s in states.items() if h == "host-a" and s == "leased") == 2
    assert {g for (h, g), s in states.items() if h == "host-a" and s == "leased"} == \
        {d["gpu_id"] for d in busy["devices"]}
    assert hosts["host-a"]["states"] == {"free": DGX8 - 2, "leased": 2}
    assert hosts["host-b"]["states"] == {"free": DGX8 - 1, "warned": 1}
    assert hosts["host-c"]["states"] == {"free": DGX8}
    assert hosts["host-a"]["util_pct"] == pytest.approx(70.0) and hosts["host-a"]["util_reporting"] == 2
    assert hosts["host-a"]["active_leases"] == 1 and hosts["host-c"]["active_leases"] == 0
    assert [h["queue"] for h in body["hosts"]] == [0, 0, 0]
    assert [h["id"] for h in body["hosts"]] == ["host-c", "host-a", "host-b"]  # the reader first
    assert hosts["host-c"]["this"] and not hosts["host-a"]["this"]
    assert hosts["host-b"]["url"] == "https://b.example"  # the trailing slash dropped
    assert not any(h["stale"] for h in body["hosts"])
    assert body["totals"]["gpus"] == 3 * DGX8 and body["totals"]["states"]["leased"] == 2
    assert body["totals"]["active_leases"] == 2
    (cand,) = body["idle"]
    assert cand["host_id"] == "host-b" and cand["lease_id"] == idle["id"] and cand["strike"] == "one"
    assert cand["lease_url"] == f"https://b.example/ui/leases/{idle['id']}"
    # every agent reads the same fleet
    assert {h["id"]: h["states"] for h in (await fleet_json(a))["hosts"]} == \
        {h: v["states"] for h, v in hosts.items()}

    # the page: one row per host with its GPUs by state, a link to its own dashboard, the idle candidate
    page = await (await c.client.get("/ui/fleet")).text()
    row_a = row_html(page, "host-a")
    assert "2 leased" in text_of(row_a) and f"{DGX8 - 2} free" in text_of(row_a) and "70%" in text_of(row_a)
    assert 'href="http://a.example:8470/"' in row_a and 'href="https://b.example/"' in row_html(page, "host-b")
    assert "(this host)" in row_html(page, "host-c") and "stale" not in row_html(page, "host-a").split(">", 1)[0]
    assert f'<tr data-idle="{idle["id"]}">' in page and f'href="https://b.example/ui/leases/{idle["id"]}"' in page
    assert re.search(r'<time datetime="[^"]+Z" data-style="datetime">[^<]+ UTC</time>', row_a)  # with its zone
    # the overview's hosts block is the same data, and leads to the fleet page
    overview = await (await c.client.get("/")).text()
    assert 'href="/ui/fleet"' in overview and "2 leased" in text_of(row_html(overview, "host-a"))
    fragment = (await (await c.client.get("/ui/api/fleet")).json())["html"]
    assert 'data-host="host-b"' in fragment

    # host b stops publishing (its publisher dies, the agent runs on): stale past 3 intervals, the others not
    publisher_task(b).cancel()
    await asyncio.sleep(STALE_INTERVALS * FAST_S + 0.3)
    body = await fleet_json(c)
    assert {h["id"]: h["stale"] for h in body["hosts"]} == {"host-a": False, "host-b": True, "host-c": False}
    assert body["totals"]["stale"] == 1 and hosts_of(body)["host-b"]["stale_after"] == STALE_INTERVALS * FAST_S
    page = await (await c.client.get("/ui/fleet")).text()
    assert "host-stale" in row_html(page, "host-b").split(">", 1)[0]
    assert "host-stale" not in row_html(page, "host-a").split(">", 1)[0]

    # host a stops cleanly: its last snapshot says so
    await a.client.close()
    body = await fleet_json(c)
    assert hosts_of(body)["host-a"]["stopped"] is True
    assert "stopped" in text_of(row_html(await (await c.client.get("/ui/fleet")).text(), "host-a"))


async def test_the_fleet_model_is_trained_from_every_hosts_records_and_each_host_uses_it(
        tmp_path: Path, mariadb: tuple[str, str], aiohttp_client: Any) -> None:
    db, url = mariadb
    rigs = [await fleet_agent(tmp_path, aiohttp_client, f"host-{x}", url) for x in "abc"]
    per_host = 4
    for i, rig in enumerate(rigs):
        for k in range(per_host):
            x = await lease(rig, "vm-a", util=80.0, work=100.0 * (i + 1) + k, task=("a", "b")[k % 2])
            assert (await rig.client.delete(f"/v1/leases/{x['id']}", headers=rig.auth("vm-a"))).status == 200
        rt = rig.runtime
        await rt.ingestor.flush()
        while await rt.run(rt._mirror_batch):
            pass
        # every sample of this host is in the rollups before training reads them: a write the loaded server
        # turned away (a deadlock with another host's roller) waits in the spool, so replay it first
        assert await rt.run(rt.store.store.replay_spool), "the spool did not drain"
        assert await rt.run(rt.store.store.settle_rollups), "the rollups did not settle"
        assert await rt.run(rt.store.store.rollup_pending) == 0
    cli = UsageStore(url, "operator-laptop", spool_path=tmp_path / "cli-spool.sqlite3")
    try:
        res = await asyncio.to_thread(lifecycle.train, cli, min_records=3 * per_host)
        shown = await asyncio.to_thread(lifecycle.show, cli)  # `hostagent model show --json`
    finally:
        cli.close()
    assert res.decision == "promoted" and res.version, res.metrics
    assert res.metrics["hosts"] == {"host-a": per_host, "host-b": per_host, "host-c": per_host}
    assert shown[0]["version"] == res.version and shown[0]["hosts"] == res.metrics["hosts"]
    # a fleet model: no host of its own, active for every host of the store
    assert mysql_query(db, "SELECT host_id, active FROM model_versions WHERE version = %s", res.version) == \
        [(None, 1)]
    for rig in rigs:
        await rig.runtime.models.check()
        assert rig.runtime.placer.model_version == res.version
        await rig.runtime.fleet.publish()
    body = await fleet_json(rigs[0])
    assert body["active_model"] == res.version
    assert {h["id"]: (h["model_version"], h["model_current"]) for h in body["hosts"]} == \
        {f"host-{x}": (res.version, True) for x in "abc"}
    page = await (await rigs[1].client.get("/ui/fleet")).text()
    assert "trained on the records of 3 hosts (host-a, host-b, host-c)" in text_of(page)
    for x in "abc":
        assert res.version in row_html(page, f"host-{x}")


# -- the configuration keys, through the agents' files (SQLite: fast) ----------------------------------------------------
async def test_the_publish_interval_is_store_fleet_publish_interval_s(tmp_path: Path, aiohttp_client: Any) -> None:
    """Two agents on one store: the one publishing every 0.2 s shows its new lease in the store within a few of its
    intervals; the one publishing every hour still shows what it published at its start (every GPU free)."""
    url = f"sqlite:///{tmp_path / 'fleet.sqlite3'}"
    fast = await fleet_agent(tmp_path, aiohttp_client, "fast", url, store={"fleet_publish_interval_s": FAST_S})
    slow = await fleet_agent(tmp_path, aiohttp_client, "slow", url, store={"fleet_publish_interval_s": 3600.0})
    assert slow.settings.store.fleet_publish_interval_s == 3600.0
    await until(lambda: slow.runtime.fleet.published == 1, WAIT_S, "the slow agent's start publish")
    await lease(fast, "vm-a")
    await lease(slow, "vm-a")
    seen = fast.runtime.fleet.published
    await until(lambda: fast.runtime.fleet.published >= seen + 5, WAIT_S, "five more publishes")
    hosts = hosts_of(await fleet_json(fast))
    assert hosts["fast"]["states"] == {"free": DGX8 - 1, "leased": 1}
    assert hosts["slow"]["states"] == {"free": DGX8} and slow.runtime.fleet.published == 1
    assert hosts["slow"]["interval_s"] == 3600.0 and not hosts["slow"]["stale"]
    await slow.runtime.fleet.publish()  # what its next tick, an hour on, would write
    assert hosts_of(await fleet_json(fast))["slow"]["states"] == {"free": DGX8 - 1, "leased": 1}


async def test_public_url_is_the_link_other_hosts_follow(tmp_path: Path, aiohttp_client: Any) -> None:
    """agent.public_url set: every fleet page links to it; left out (a test server on port 0, never bound by
    `hostagent serve`), the host publishes no address and the page says so."""
    url = f"sqlite:///{tmp_path / 'fleet.sqlite3'}"
    named = await fleet_agent(tmp_path, aiohttp_client, "named", url,
                              agent={"public_url": "https://gpu-07.example.net:8470"})
    plain = await fleet_agent(tmp_path, aiohttp_client, "plain", url, store={"fleet_publish_interval_s": 3600.0})
    await until(lambda: named.runtime.fleet.published and plain.runtime.fleet.published, WAIT_S, "both publish")
    hosts = hosts_of(await fleet_json(plain))
    assert hosts["named"]["url"] == "https://gpu-07.example.net:8470" and hosts["plain"]["url"] is None
    page = await (await plain.client.get("/ui/fleet")).text()
    assert 'href="https://gpu-07.example.net:8470/"' in row_html(page, "named")
    assert "no address published" in text_of(row_html(page, "plain"))
    # once `hostagent serve` has bound the port, the agent links to where it listens
    before = plain.runtime.fleet.published
    plain.runtime.fleet.served("http://0.0.0.0:8471")  # what the server does once bound: publish now, not in an hour
    await until(lambda: plain.runtime.fleet.published > before, WAIT_S, "a publish as soon as the server listens")
    assert hosts_of(await fleet_json(named))["plain"]["url"].endswith(":8471")


def test_the_keys_default_and_are_checked() -> None:
    assert Settings().store.fleet_publish_interval_s == 15.0 and Settings().agent.public_url == ""
    for bad in (0, -1.0):
        with pytest.raises(ConfigError) as info:
            settings_from_dict({"store": {"fleet_publish_interval_s": bad}})
        assert info.value.field == "store.fleet_publish_interval_s"
    for bad in ("gpu-07:8470", "ftp://x", "http://x/?q=1", "http://a b"):
        with pytest.raises(ConfigError) as info:
            settings_from_dict({"agent": {"public_url": bad}})
        assert info.value.field == "agent.public_url"
    assert settings_from_dict({"agent": {"public_url": "https://x.example/hostagent/"}}).agent.public_url


# -- the parts -------------------------------------------------------------------------------------------------------
def test_dashboard_url_from_the_settings_and_the_bound_address() -> None:
    agent = SimpleNamespace(public_url="", tls_cert="", listen="127.0.0.1", port=8470)
    assert dashboard_url(agent, None) == "http://127.0.0.1:8470"
    assert dashboard_url(SimpleNamespace(**{**vars(agent), "port": 0}), None) is None  # not bound yet
    assert dashboard_url(SimpleNamespace(**{**vars(agent), "port": 0}), "http://127.0.0.1:40123") == \
        "http://127.0.0.1:40123"
    wild = dashboard_url(SimpleNamespace(**{**vars(agent), "listen": "0.0.0.0", "tls_cert": "c.pem"}), None)
    assert wild is not None and wild.startswith("https://") and "0.0.0.0" not in wild and wild.endswith(":8470")
    assert dashboard_url(SimpleNamespace(**{**vars(agent), "listen": "::1"}), None) == "http://[::1]:8470"
    assert dashboard_url(SimpleNamespace(**{**vars(agent), "public_url": "https://p.example/x/"}), None) == \
        "https://p.example/x"


def test_the_view_marks_a_host_stale_past_three_of_its_own_intervals() -> None:
    now = 1_800_000_000.0

    def host(name: str, age: float, every: float | None, **info: Any) -> dict[str, Any]:
        return {"id": name, "hostname": name, "last_seen": now - age,
                "info": {"publish_interval_s": every, **info} if every is not None else None,
                "gpus": [{"gpu_id": "g0", "model": "X", "state": "free"}, {"gpu_id": "g1", "model": "X", "state": None}]}

    view = fleet_view([host("b", 44.0, 15.0), host("a", 46.0, 15.0), host("old", 10.0, None),
                       host("slow", 100.0, 60.0, stopped=True)], now, this_host="b", interval_s=3.0)
    rows = {h["id"]: h for h in view["hosts"]}
    assert [h["id"] for h in view["hosts"]] == ["b", "a", "old", "slow"]
    assert (rows["b"]["stale"], rows["a"]["stale"], rows["slow"]["stale"]) == (False, True, False)
    assert rows["old"]["stale"] and not rows["old"]["publishing"]  # the reader's interval for a silent agent
    assert rows["slow"]["stopped"] and rows["b"]["states"] == {"free": 1, "unknown": 1}
    assert view["totals"]["stale"] == 2 and view["totals"]["gpus"] == 8 and view["totals"]["states"]["free"] == 4


def test_publish_writes_one_snapshot_and_reads_back_every_host(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fleet.sqlite3'}"
    stores = [UsageStore(url, f"h{i}", spool_path=tmp_path / f"spool{i}.sqlite3") for i in range(3)]
    try:
        for i, s in enumerate(stores):
            s.upsert_gpus([{"gpu_id": f"g{k}", "address": f"0000:0{k}:00.0", "model": "X"} for k in range(2)])
            s.publish_fleet({"queue": i, "publish_interval_s": 15.0}, {"g0": "leased" if i == 1 else "free",
                                                                       "g1": "free"}, agent_version="9.9")
        rows = {h["id"]: h for h in stores[0].fleet_hosts()}
        assert set(rows) == {"h0", "h1", "h2"} and rows["h2"]["info"]["queue"] == 2
        assert rows["h1"]["agent_version"] == "9.9"
        assert [(g["gpu_id"], g["state"]) for g in rows["h1"]["gpus"]] == [("g0", "leased"), ("g1", "free")]
        # another host's GPU of the same id is its own row
        assert [g["state"] for g in rows["h0"]["gpus"]] == ["free", "free"]
        # an outage spools the publish like any write; the replay applies it
        stores[0]._down = True  # as a failed write leaves it
        stores[0].publish_fleet({"queue": 7}, {"g0": "quarantined", "g1": "free"})
        assert stores[0].spool_depth == 1 and stores[1].fleet_hosts()[0]["info"]["queue"] == 0
        assert stores[0].replay_spool()
        rows = {h["id"]: h for h in stores[1].fleet_hosts()}
        assert rows["h0"]["info"] == {"queue": 7} and rows["h0"]["gpus"][0]["state"] == "quarantined"
        # a tool opening the store as a host keeps what the host's agent published
        UsageStore(url, "h0", spool_path=tmp_path / "tool.sqlite3").close()
        assert {h["id"]: h for h in stores[1].fleet_hosts()}["h0"]["info"] == {"queue": 7}
    finally:
        for s in stores:
            s.close()


def test_training_keeps_apart_leases_of_different_hosts_with_one_id() -> None:
    """Lease ids are unique per host only: a fleet's records of three hosts whose leases share ids (seeded history
    made the same way on each) are three leases each, not one, and the figures say whose records taught the model."""
    base = store_records(40)
    records = [dict(r, host_id=h) for h in ("h1", "h2", "h3") for r in base]
    gpus = [dict(g, host_id=h) for h in ("h1", "h2", "h3") for g in gpu_rows()]
    examples = examples_from_records(records, gpus)
    assert len({e.lease_key for e in examples}) == 120 and len({e.lease_id for e in examples}) == 40
    older, recent = lifecycle.split_recent(examples, 0.2)
    assert len({e.lease_key for e in recent}) == 24 and not {e.lease_key for e in older} & {e.lease_key for e in recent}
    res = lifecycle.train(FakeStore(records, gpus), min_records=30, now=1.7e9)  # type: ignore[arg-type]
    assert res.decision == "promoted" and res.metrics["hosts"] == {"h1": 40, "h2": 40, "h3": 40}
