"""The agent records every lease, event and sample in the usage store (SQLite and the real MariaDB), and keeps
leasing through a MariaDB outage under heartbeat load (a cut connection, and the server really stopped and started
again) without losing or duplicating a sample."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import AgentRig, make_rig, start_rig
from tests.support.store import (
    MYSQL_HOST,
    MYSQL_PORT,
    MariaDBServer,
    TcpProxy,
    mariadb_server,  # noqa: F401 (a fixture)
    mysql_database,
    mysql_query,
    mysql_url,
)
from tests.support.waits import until

SampleKey = tuple[str, str, int]  # (lease id, GPU id, ts_ms): a sample's identity in usage_samples, for one host


@pytest.fixture(params=["sqlite", "mysql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'usage.sqlite3'}"
        return
    with mysql_database("ha_agent") as name:
        yield mysql_url(name)


async def settle(rig: AgentRig) -> None:
    """Flush queued samples and the journal mirror."""
    rt = rig.runtime
    await rt.ingestor.flush()
    while await rt.run(rt._mirror_batch):
        pass


def samples_for(gpu: str, start: float, n: int, util: float = 60.0) -> list[dict[str, Any]]:
    return [{"ts": start + i * 0.01, "gpu": gpu, "util_pct": util, "mem_used_bytes": 2**30} for i in range(n)]


@dataclass
class Ledger:
    """What the agent accepted (HTTP 200) from the guests: the store must hold exactly these samples.

    The raw table's unique key makes a stored duplicate impossible, so counting its rows proves nothing about
    duplicates. The rollups are sums: a sample folded twice (say a batch whose commit reached the server just before
    the connection died, then replayed from the spool) shows there as one too many, in ``n`` and in ``util_sum``.
    """

    keys: set[SampleKey] = field(default_factory=set)
    n: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    util: dict[tuple[str, str], float] = field(default_factory=lambda: collections.defaultdict(float))

    def accept(self, lease_id: str, batch: list[dict[str, Any]]) -> None:
        for smp in batch:
            key = (lease_id, smp["gpu"], int(round(float(smp["ts"]) * 1000)))  # the store's ts_ms
            assert key not in self.keys, f"the test sent {key} twice"
            self.keys.add(key)
            self.n[key[:2]] += 1
            self.util[key[:2]] += smp["util_pct"]


query = mysql_query  # ask MariaDB directly, bypassing the proxy and the store


def assert_mysql_holds(db: str, ledger: Ledger) -> None:
    """The samples table holds exactly the accepted samples, and its rollups count each of them once."""
    stored = {(lid, gpu, int(ts)) for lid, gpu, ts in query(db, "SELECT lease_id, gpu_id, ts_ms FROM usage_samples")}
    lost, extra = ledger.keys - stored, stored - ledger.keys
    assert not lost and not extra, f"{len(lost)} accepted samples missing, e.g. {sorted(lost)[:3]}; " \
                                   f"{len(extra)} never accepted, e.g. {sorted(extra)[:3]}"
    for res in (60, 3600):
        rows = query(db, "SELECT lease_id, gpu_id, SUM(n), SUM(util_sum) FROM usage_rollups WHERE resolution = %s "
                         "GROUP BY lease_id, gpu_id", res)
        counts = {(lid, gpu): int(n) for lid, gpu, n, _ in rows}
        assert counts == dict(ledger.n), f"{res} s rollups count samples other than once"
        assert {(lid, gpu): float(u) for lid, gpu, _, u in rows} == pytest.approx(dict(ledger.util))
    # every stored sample folded: the watermark stands at the newest row
    assert query(db, "SELECT last_id FROM usage_rollup_marks") == query(db, "SELECT MAX(id) FROM usage_samples")


async def test_leases_events_and_samples_reach_the_store(tmp_path: Path, aiohttp_client: Any, store_url: str) -> None:
    rig = await start_rig(make_rig(tmp_path, store={"url": store_url}), aiohttp_client)
    h = rig.auth("vm-a")
    r = await rig.client.post("/v1/leases", json={"gpus": 2, "task_type": "training"}, headers=h)
    lease = await r.json()
    gpu = lease["devices"][0]["gpu_id"]
    now = time.time()
    for k in range(5):
        r = await rig.client.post(f"/v1/leases/{lease['id']}/heartbeat",
                                  json={"samples": samples_for(gpu, now + k, 20)}, headers=h)
        assert r.status == 200
    await rig.client.delete(f"/v1/leases/{lease['id']}", headers=h)
    await settle(rig)
    stored = await rig.runtime.store.get_lease(lease["id"])
    assert stored["state"] == "RELEASED"
    kinds = [e["to_state"] for e in stored["events"] if e["kind"] == "transition"]
    assert kinds == ["REQUESTED", "BINDING", "ATTACHING", "ACTIVE", "RELEASING", "DETACHING", "REBINDING", "RELEASED"]
    usage = await rig.runtime.store.lease_usage_summary(lease["id"])
    assert usage["total"]["n"] == 100 and usage["total"]["util_mean"] == pytest.approx(60.0)
    detail = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=h)).json()
    assert detail["usage"]["samples"] == 100
    assert (await (await rig.client.get("/readyz")).json())["checks"]["store"]["ok"] is True


async def test_mariadb_outage_under_heartbeat_load(tmp_path: Path, aiohttp_client: Any) -> None:
    """A cut connection (a TCP proxy reset): the cheap half of the outage tests; the server stopped for real is
    test_mariadb_stopped_and_restarted_under_heartbeat_load."""
    proxy = TcpProxy(MYSQL_HOST, MYSQL_PORT).start()
    try:
        with mysql_database("ha_outage") as name:
            rig = await start_rig(make_rig(tmp_path, store={"url": mysql_url(name, host="127.0.0.1", port=proxy.port),
                                                            "flush_interval_s": 0.1}), aiohttp_client)
            ledger, leases = await _load_through_outage(rig, proxy)
            assert_mysql_holds(name, ledger)
            # both leases mirrored as they are (nothing was released): the one granted during the outage too
            assert dict(query(name, "SELECT id, state FROM leases")) == {lid: "ACTIVE" for lid in leases}
    finally:
        proxy.close()


async def _load_through_outage(rig: AgentRig, proxy: TcpProxy) -> tuple[Ledger, list[str]]:
    ledger = Ledger()
    leases: list[tuple[str, str, str]] = []  # (lease id, gpu, vm)

    async def new_lease(vm: str) -> None:
        r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth(vm))
        body = await r.json()
        assert r.status == 201 and body["state"] == "ACTIVE", body  # leasing never stops
        leases.append((body["id"], body["devices"][0]["gpu_id"], vm))

    t0 = time.time()

    async def beat(round_: int) -> None:
        for lid, gpu, vm in leases:
            batch = samples_for(gpu, t0 + round_ * 0.1, 10)  # 10 ms apart: every sample key is distinct
            r = await rig.client.post(f"/v1/leases/{lid}/heartbeat", json={"samples": batch}, headers=rig.auth(vm))
            assert r.status == 200, await r.text()
            ledger.accept(lid, batch)

    await new_lease("vm-a")
    for i in range(10):
        await beat(i)
        await asyncio.sleep(0.02)
    proxy.cut()
    for i in range(10, 30):
        if i == 15:
            await new_lease("vm-b")  # a grant during the outage
        await beat(i)
        await asyncio.sleep(0.02)
    await rig.runtime.ingestor.flush()
    ready = await (await rig.client.get("/readyz")).json()
    store = ready["checks"]["store"]
    assert ready["ready"] is True and store["ok"] is False and store["spool_depth"] > 0
    metrics = await (await rig.client.get("/metrics", headers=rig.auth("operator"))).text()
    assert "hostagent_store_degraded 1.0" in metrics
    proxy.restore()
    for i in range(30, 35):
        await beat(i)
    await recover(rig)
    return ledger, [lid for lid, _, _ in leases]


async def recover(rig: AgentRig, *, kick: bool = True, timeout: float = 60.0) -> None:
    """Drain the ingestor, let the spool replay (kicked, or else on the agent's own outage backoff, which reaches
    30 s between tries), settle the mirror; then close the ingestor as the agent's shutdown would, which counts
    anything it could not write as dropped."""
    rt = rig.runtime

    def replayed() -> bool:
        if kick:
            rt.store.kick()
        return not rt.store.status()["degraded"]

    await settle(rig)
    await until(replayed, timeout, "spool replayed")
    await settle(rig)
    await rt.ingestor.close()
    st, fig = rt.store.status(), rt.ingestor.figures()
    assert not st["degraded"] and st["spool_depth"] == 0 and st["spool_dead"] == 0, st
    assert st["ops_replayed"] == st["ops_spooled"] > 0 and st["outages"] >= 1, st  # the outage went through the spool
    assert fig["dropped"] == fig["rejected"] == fig["overloaded"] == fig["queue_depth"] == 0, fig
    assert rt.journal.unmirrored(1) == []


class Guest:
    """A VM's usage monitor: heartbeats of ``PER_BEAT`` samples (each at its own instant) every ``every_s``, from
    the moment it is made until ``halt()``; every reply is kept, and the accepted samples go into the ledger."""

    PER_BEAT = 4

    def __init__(self, rig: AgentRig, vm: str, lease: dict[str, Any], every_s: float, ledger: Ledger) -> None:
        self.rig, self.vm, self.lease_id, self.every_s, self.ledger = rig, vm, lease["id"], every_s, ledger
        self.gpu = lease["devices"][0]["gpu_id"]
        self.t0 = round(time.time(), 3)
        self.n = 0  # samples made so far
        # (time.monotonic() at sending, seconds to the reply, status, body if not 200)
        self.replies: list[tuple[float, float, int, str]] = []
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"guest-{vm}")

    def accepted_since(self, t: float) -> int:
        """Heartbeats sent at or after ``t`` (monotonic) that the agent accepted."""
        return sum(1 for at, _, status, _ in self.replies if at >= t and status == 200)

    async def halt(self) -> None:
        self._stop.set()
        await self._task

    async def _run(self) -> None:
        while not self._stop.is_set():
            batch = []
            for _ in range(self.PER_BEAT):
                batch.append({"ts": self.t0 + self.n * 0.01, "gpu": self.gpu, "util_pct": float(self.n * 37 % 101),
                              "mem_used_bytes": self.n % 16 * 2**28})
                self.n += 1
            at = time.monotonic()
            r = await self.rig.client.post(f"/v1/leases/{self.lease_id}/heartbeat", json={"samples": batch},
                                           headers=self.rig.auth(self.vm))
            body = await r.text()
            self.replies.append((at, time.monotonic() - at, r.status, "" if r.status == 200 else body))
            if r.status == 200:
                self.ledger.accept(self.lease_id, batch)
            with contextlib.suppress(TimeoutError):  # the heartbeat period, cut short by halt()
                async with asyncio.timeout(self.every_s):
                    await self._stop.wait()


async def grant(rig: AgentRig, vm: str) -> dict[str, Any]:
    """A one-GPU lease for ``vm``, which must be granted at once (201, ACTIVE)."""
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth(vm))
    body = await r.json()
    assert r.status == 201 and body["state"] == "ACTIVE", body
    return body


OUTAGE_S = 10.0  # real downtime: from the server no longer answering to its answering again
BEFORE = 7  # leases heartbeating before the outage; the dgx8 tree's 8th GPU is granted during it


@pytest.mark.mysql
@pytest.mark.timeout(180)
async def test_mariadb_stopped_and_restarted_under_heartbeat_load(tmp_path: Path, aiohttp_client: Any,
                                                                  mariadb_server: MariaDBServer) -> None:
    """The acceptance line: MariaDB shut down for real (and started again) while 8 guests heartbeat over the API;
    no sample lost or duplicated, and leasing never stopped: a lease released and one granted during the outage."""
    vms = tuple(f"vm-{i}" for i in range(BEFORE + 1))
    with mysql_database("ha_stop") as name:
        rig = await start_rig(make_rig(tmp_path, vms=vms, store={"url": mysql_url(name), "flush_interval_s": 0.2}),
                              aiohttp_client)
        rt = rig.runtime
        host_driver = {str(f.address): rig.sysfs_driver(str(f.address))
                       for g in rt.manager.gpus.values() for f in g.functions}
        ledger = Ledger()
        guests = [Guest(rig, vm, await grant(rig, vm), 0.2 + 0.1 * i / BEFORE, ledger)
                  for i, vm in enumerate(vms[:BEFORE])]
        await until(lambda: all(g.accepted_since(0) >= 3 for g in guests)
                    and rt.store.status()["samples_inserted"] > 0, 60.0, "heartbeats reaching MySQL")
        inserted_before = rt.store.status()["samples_inserted"]
        try:
            stop_began = time.monotonic()
            down_at = await asyncio.to_thread(mariadb_server.stop)
            await until(lambda: rt.store.degraded, 60.0, "the agent seeing the outage")  # a flush found it gone

            # Leasing goes on. A release: its guest stops first, the GPU goes back to its host driver.
            gone = guests.pop(0)
            await gone.halt()
            t = time.monotonic()
            r = await rig.client.delete(f"/v1/leases/{gone.lease_id}", headers=rig.auth(gone.vm))
            released, release_s = await r.json(), time.monotonic() - t
            assert r.status == 200 and released["state"] == "RELEASED", released
            functions = [f for d in released["devices"] for f in d["functions"]]
            assert functions and all(rig.sysfs_driver(f) == host_driver[f] != "vfio-pci" for f in functions)
            # A grant, on the GPU no one held, and its guest heartbeats at once.
            t = time.monotonic()
            made = await grant(rig, vms[BEFORE])
            grant_s = time.monotonic() - t
            guests.append(Guest(rig, vms[BEFORE], made, 0.25, ledger))
            ready = await (await rig.client.get("/readyz")).json()
            assert ready["ready"] is True and ready["checks"]["store"]["ok"] is False, ready
            assert ready["checks"]["store"]["reachable"] is False and ready["checks"]["store"]["spool_depth"] > 0

            await until(lambda: time.monotonic() - down_at >= OUTAGE_S
                        and all(g.accepted_since(down_at) >= 5 for g in guests), OUTAGE_S + 30, "a long outage")
            assert not await asyncio.to_thread(mariadb_server.alive)  # nothing brought it back behind our back
            up_at = await asyncio.to_thread(mariadb_server.start)
        finally:
            mariadb_server.ensure_running()  # whatever happened above: the database is dropped below, others use it
        await until(lambda: all(g.accepted_since(up_at) >= 3 for g in guests), 60.0, "heartbeats after the restart")
        for g in guests:
            await g.halt()
        await recover(rig, kick=False)  # the agent finds the server back by itself
        recover_s = time.monotonic() - up_at

        replies = [reply for g in (gone, *guests) for reply in g.replies]
        during = [secs for at, secs, _, _ in replies if stop_began <= at < up_at]
        refused = [(status, body) for _, _, status, body in replies if status != 200]
        assert not refused, f"{len(refused)} heartbeats refused, e.g. {refused[:3]}"  # none re-sent: none needed
        assert len(during) >= 5 * len(guests)
        assert rt.ingestor.figures()["flushed"] == len(ledger.keys)  # each accepted sample handed to the store once
        assert_mysql_holds(name, ledger)
        every = [gone.lease_id, *(g.lease_id for g in guests)]
        states = dict(query(name, "SELECT id, state FROM leases"))
        assert states == {lid: "RELEASED" if lid == gone.lease_id else "ACTIVE" for lid in every}
        for lid in every:  # the journal mirror caught up: each lease's transitions in MySQL, in order, once each
            journal = [(e.from_state, e.to_state) for e in rt.journal.events(lease_id=lid) if e.to_state]
            stored = query(name, "SELECT from_state, to_state FROM lease_events WHERE lease_id = %s AND "
                                 "to_state IS NOT NULL ORDER BY id", lid)
            assert [tuple(x) for x in stored] == journal, lid
            if lid == made["id"]:
                assert [to for _, to in journal] == ["REQUESTED", "BINDING", "ATTACHING", "ACTIVE"]

        st = rt.store.status()
        print(f"\noutage: shutdown took {down_at - stop_began:.1f} s, down {up_at - down_at:.1f} s; "
              f"release {release_s * 1000:.0f} ms and grant {grant_s * 1000:.0f} ms during it; "
              f"spool replayed and settled {recover_s:.1f} s after the restart"
              f"\nheartbeats: {len(replies)} all 200 ({len(during)} during the outage, slowest reply "
              f"{max(during) * 1000:.0f} ms) from {len(every)} leases; "
              f"samples accepted {len(ledger.keys)}, stored {st['samples_inserted']} inserted "
              f"({inserted_before} before the outage) + {st['samples_duplicate']} skipped as already stored; "
              f"ops spooled {st['ops_spooled']}, replayed {st['ops_replayed']}; ingest {rt.ingestor.figures()}")


async def test_mirror_writes_a_batch_in_one_store_transaction(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    rt = rig.runtime
    writes: list[tuple[str, Any]] = []
    write = rt.store.store._write

    def counted(op: str, payload: Any, **kw: Any) -> Any:
        writes.append((op, payload))
        return write(op, payload, **kw)

    rt.store.store._write = counted  # type: ignore[method-assign]
    h = rig.auth("vm-a")
    with rt._mirror_lock:  # the mirror waits: the lease's 8 events arrive in one batch, this one
        r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=h)
        lease = await r.json()
        assert (await rig.client.delete(f"/v1/leases/{lease['id']}", headers=h)).status == 200
        writes.clear()
        assert await rt.run(rt._mirror_batch_locked) >= 8
    # one store transaction for the batch: the lease's row once, then its 8 events
    assert [op for op, _ in writes] == ["mirror"]
    assert [x["row"]["id"] for x in writes[0][1]["leases"]] == [lease["id"]]
    assert len(writes[0][1]["events"]) == 8
    stored = await rt.store.get_lease(lease["id"])
    assert stored["state"] == "RELEASED" and len(stored["events"]) == 8
