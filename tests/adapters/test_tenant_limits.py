"""Per-source and per-tenant limits: what one guest (or one client address) sends is bounded, answered 429 with
Retry-After for it alone, and never costs another tenant an error. Connection tests run on the server serve() runs
(start_server and its connection guard), the abuser from a second loopback address (127.0.0.2)."""

from __future__ import annotations

import asyncio
import json
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from hostagent.config import settings_from_dict
from hostagent.domain.errors import ConfigError
from hostagent.runtime import make_app
from hostagent.web import serve
from hostagent.web.openapi import MAX_PAGE
from hostagent.web.serve import CONNECTION_TARPIT_S, start_metrics_server, start_server
from tests.adapters.test_bad_input import read_response
from tests.support.agent import AgentRig, make_rig, start_rig

ABUSER = "127.0.0.2"
Served = Callable[..., Awaitable[tuple[AgentRig, int, web.Application]]]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """An agent served the way serve() serves it, with some settings sections given."""
    runners: list[web.AppRunner] = []

    async def start(**sections: dict[str, Any]) -> tuple[AgentRig, int, web.Application]:
        root = tmp_path / f"agent{len(runners)}"
        root.mkdir()
        agent = {"listen": "127.0.0.1", "port": 0, **sections.pop("agent", {})}
        rig = make_rig(root, agent=agent, **sections)
        app = make_app(rig.runtime)
        runner, url = await start_server(app, rig.settings)
        runners.append(runner)
        return rig, int(url.rsplit(":", 1)[1]), app

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


def test_the_tarpit_is_as_large_as_the_open_file_limit_allows() -> None:
    """The tarpit's bound follows the soft fd limit: half of it past FD_RESERVE, less the admitted connections, capped
    at TARPIT_MAX; nothing when the limit leaves no room. `hostagent serve` raises the soft limit towards
    FD_LIMIT_WANTED, never past the hard limit and never down."""
    agent = settings_from_dict({"agent": {"max_connections": 256}}).agent
    assert serve.tarpit_bound(agent, 20000) == (20000 - serve.FD_RESERVE) // 2 - 256
    assert serve.tarpit_bound(agent, 10**7) == serve.TARPIT_MAX
    assert serve.tarpit_bound(agent, 1024) == 128
    assert serve.tarpit_bound(agent, 600) == 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard))
        assert serve.raise_fd_limit(min(4096, hard)) == min(4096, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert serve.raise_fd_limit(256) == min(4096, hard)  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def get(port: int, path: str, token: str, *, source: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection from `source`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                     "Connection: close\r\n\r\n".encode())
        async with asyncio.timeout(5):
            return await read_response(reader)
    finally:
        writer.close()


def test_limit_keys_are_validated() -> None:
    for raw, key in [({"agent": {"max_connections_per_source": 0}}, "agent.max_connections_per_source"),
                     ({"agent": {"max_inflight_per_token": -1}}, "agent.max_inflight_per_token"),
                     ({"agent": {"metrics_listen": "9470"}}, "agent.metrics_listen"),
                     ({"agent": {"metrics_listen": "127.0.0.1:99999"}}, "agent.metrics_listen"),
                     ({"store": {"samples_per_lease_per_s": 0}}, "store.samples_per_lease_per_s"),
                     ({"store": {"ingest_share": 1.5}}, "store.ingest_share"),
                     ({"store": {"ingest_share": 0}}, "store.ingest_share")]:
        with pytest.raises(ConfigError) as info:
            settings_from_dict(raw)
        assert info.value.field == key, raw


# -- connections per source address --------------------------------------------------------------------------------
async def test_one_address_holds_only_its_share_of_the_connections(served: Served) -> None:
    rig, port, _ = await served(agent={"max_connections_per_source": 4, "idle_timeout_s": 30.0,
                                       "header_timeout_s": 30.0})
    token = rig.tokens["vm-b"]
    held = []
    try:
        for _ in range(4):  # the abuser's share, kept open (each after one request, as keep-alive clients do)
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ABUSER, 0))
            writer.write(f"GET /v1/gpus HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
            assert (await read_response(reader))[0] == 200
            held.append((reader, writer))
        started = time.monotonic()
        for status, headers, body in await asyncio.gather(*(get(port, "/v1/gpus", token, source=ABUSER)
                                                            for _ in range(3))):
            assert status == 429 and headers.get("Retry-After") == "1", body
            assert json.loads(body)["error"]["code"] == "rate_limited"
        assert time.monotonic() - started >= CONNECTION_TARPIT_S * 0.9  # answered after the tarpit, not at once
        for _ in range(6):  # the well-behaved tenant from its own address: never refused
            assert (await get(port, "/v1/gpus", rig.tokens["vm-a"]))[0] == 200
        held.pop()[1].close()  # one of the abuser's ends: it may connect again
        deadline = time.monotonic() + 5
        while (status := (await get(port, "/v1/gpus", token, source=ABUSER))[0]) != 200:
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.02)
    finally:
        for _, writer in held:
            writer.close()


async def test_refused_connections_wait_in_a_bounded_tarpit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections over an address's share wait CONNECTION_TARPIT_S for their 429, at most tarpit_bound of them at
    once (what the open-file limit leaves); one more is answered at once, and a client that hangs up leaves the
    tarpit."""
    monkeypatch.setattr(serve, "CONNECTION_TARPIT_S", 30.0)
    # 3 admitted connections per listener, and room for 3 more in its tarpit
    monkeypatch.setattr(serve, "fd_limit", lambda: serve.FD_RESERVE + 2 * (3 + 3))
    rig = make_rig(tmp_path, agent={"listen": "127.0.0.1", "port": 0, "max_connections": 3,
                                    "max_connections_per_source": 1, "header_timeout_s": 30.0})
    runner, url = await start_server(make_app(rig.runtime), rig.settings)
    port = int(url.rsplit(":", 1)[1])
    server = runner.server
    assert isinstance(server, serve.GuardedServer)
    assert server.tarpit_bound == 3
    opened = []
    try:
        for _ in range(4):  # one admitted, three refused into the tarpit
            opened.append(await asyncio.open_connection("127.0.0.1", port, local_addr=(ABUSER, 0)))
        deadline = time.monotonic() + 5
        while server.tarpitted < 3:
            assert time.monotonic() < deadline, server.tarpitted
            await asyncio.sleep(0.01)
        started = time.monotonic()
        status, _, _ = await get(port, "/v1/gpus", rig.tokens["vm-a"], source=ABUSER)  # the tarpit is full
        assert status == 429 and time.monotonic() - started < 5.0
        for _, writer in opened[1:]:
            writer.close()
        while server.tarpitted:
            assert time.monotonic() < deadline + 5, server.tarpitted
            await asyncio.sleep(0.01)
    finally:
        for _, writer in opened:
            writer.close()
        await runner.cleanup()


# -- in-flight requests per guest ------------------------------------------------------------------------------------
async def test_a_guest_has_a_bounded_number_of_requests_in_progress(served: Served) -> None:
    """vm-b starts heartbeats whose bodies never come (each stays in progress until body_timeout_s): past its
    in-flight cap it is answered 429 at once, while vm-a's requests are served."""
    rig, port, _ = await served(agent={"max_inflight_per_token": 3, "body_timeout_s": 5.0})
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
        r = await s.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-b"))
        lease = (await r.json())["id"]
        stalled = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ABUSER, 0))
            writer.write(f"POST /v1/leases/{lease}/heartbeat HTTP/1.1\r\nHost: x\r\n"
                         f"Authorization: Bearer {rig.tokens['vm-b']}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 100\r\n\r\n{".encode())
            await writer.drain()
            stalled.append(writer)
        try:
            deadline = time.monotonic() + 5
            while True:  # the three reach their handlers
                r = await s.get("/v1/leases", headers=rig.auth("vm-b"))
                if r.status == 429:
                    break
                assert time.monotonic() < deadline, "vm-b was never limited"
                await asyncio.sleep(0.02)
            assert r.headers["Retry-After"] == "1" and (await r.json())["error"]["code"] == "rate_limited"
            for _ in range(5):
                r = await s.get("/v1/leases", headers=rig.auth("vm-a"))
                assert r.status == 200
            r = await s.get("/v1/leases", headers=rig.auth("operator"))  # the operator is not a tenant
            assert r.status == 200
        finally:
            for writer in stalled:
                writer.close()
        deadline = time.monotonic() + 5
        while (await s.get("/v1/leases", headers=rig.auth("vm-b"))).status != 200:  # its requests ended
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)


# -- heartbeat samples ----------------------------------------------------------------------------------------------
def samples(gpu: str, n: int, start: float | None = None, **extra: Any) -> list[dict[str, Any]]:
    # 10 ms apart: the store keeps samples to the millisecond and drops one that lands on another's (1 ms steps
    # could round onto the same millisecond now and then, and the counts below would be one short)
    t0 = time.time() - n * 0.01 if start is None else start
    return [{"ts": t0 + i * 0.01, "gpu": gpu, "util_pct": 50.0, "mem_used_bytes": 2**30, **extra}
            for i in range(n)]


async def leased(rig: AgentRig, vm: str) -> tuple[str, str]:
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth(vm))
    body = await r.json()
    assert r.status == 201, body
    return body["id"], body["devices"][0]["gpu_id"]


async def beat(rig: AgentRig, vm: str, lease: str, batch: list[dict[str, Any]]) -> aiohttp.ClientResponse:
    return await rig.client.post(f"/v1/leases/{lease}/heartbeat", json={"samples": batch}, headers=rig.auth(vm))


async def test_a_lease_sends_samples_at_its_rate(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, store={"samples_per_lease_per_s": 1.0}), aiohttp_client)
    a, ga = await leased(rig, "vm-a")
    b, gb = await leased(rig, "vm-b")
    assert (await beat(rig, "vm-a", a, samples(ga, 60))).status == 200  # a burst of 60 s of its rate
    r = await beat(rig, "vm-a", a, samples(ga, 5))
    assert r.status == 429 and int(r.headers["Retry-After"]) >= 4, await r.text()
    err = (await r.json())["error"]
    assert "samples_per_lease_per_s" in err["message"] and err["field"] == "samples", err
    r = await rig.client.post(f"/v1/leases/{a}/heartbeat", data=b"[" * 5000, headers={
        **rig.auth("vm-a"), "Content-Type": "application/json"})
    assert r.status == 429, "told to wait, it is refused before its body is even parsed"
    assert (await r.json())["error"]["field"] == "samples"
    assert (await beat(rig, "vm-b", b, samples(gb, 60))).status == 200  # another lease has its own rate
    await asyncio.sleep(5.1)
    r = await beat(rig, "vm-a", a, samples(ga, 61))
    assert r.status == 400 and "at most 60" in (await r.json())["error"]["message"]
    assert (await beat(rig, "vm-a", a, samples(ga, 2))).status == 200  # it came back at 1 per second
    await rig.runtime.ingestor.flush()
    stored = await rig.runtime.store.lease_usage_summary(a)
    assert stored["total"]["n"] == 62, "every accepted sample stored once, none of the refused ones"
    assert rig.runtime.sample_buckets[a].refused_for(time.time() + 3600) == 0.0


async def test_one_vm_fills_only_its_share_of_the_sample_queue(tmp_path: Path, aiohttp_client: Any) -> None:
    """The queue flushes only when asked here: vm-a fills its share (10 % of 1,000) and is told to retry; vm-b's
    heartbeats still go in; after a flush vm-a may send again, and the store has each accepted sample once."""
    rig = await start_rig(make_rig(tmp_path, store={"queue_max": 1000, "ingest_share": 0.1, "flush_batch": 5000,
                                                    "flush_interval_s": 3600.0}), aiohttp_client)
    a, ga = await leased(rig, "vm-a")
    b, gb = await leased(rig, "vm-b")
    sent_a = sent_b = 0
    for _ in range(2):
        assert (await beat(rig, "vm-a", a, samples(ga, 50, time.time() - 100 + sent_a))).status == 200
        sent_a += 50
    r = await beat(rig, "vm-a", a, samples(ga, 1))
    assert r.status == 429 and "store.ingest_share" in (await r.json())["error"]["message"]
    assert r.headers["Retry-After"].isdigit()
    for _ in range(2):
        assert (await beat(rig, "vm-b", b, samples(gb, 50, time.time() - 100 + sent_b))).status == 200
        sent_b += 50
    assert rig.runtime.ingestor.figures()["over_share"] == 1
    await rig.runtime.ingestor.flush()
    assert (await beat(rig, "vm-a", a, samples(ga, 50, time.time() - 10))).status == 200
    sent_a += 50
    await rig.runtime.ingestor.flush()
    assert (await rig.runtime.store.lease_usage_summary(a))["total"]["n"] == sent_a
    assert (await rig.runtime.store.lease_usage_summary(b))["total"]["n"] == sent_b
    assert rig.runtime.ingestor.by_tenant == {}


async def test_samples_no_gpu_of_the_lease_could_report_are_refused(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease, gpu = await leased(rig, "vm-a")
    has = rig.runtime.manager.gpus[gpu].memory_bytes
    assert has, "the simulated GPUs know their memory"
    granted = rig.runtime.manager.leases[lease].granted_at
    assert granted is not None
    for batch, field in [(samples(gpu, 1, granted - 3600), "samples[0].ts"),  # before the lease had the GPU
                         (samples(gpu, 1, time.time() - 8 * 86400), "samples[0].ts"),
                         ([dict(samples(gpu, 1)[0], mem_used_bytes=2**40)], "samples[0].mem_used_bytes"),
                         ([dict(samples(gpu, 1)[0], mem_used_bytes=int(has * 1.2))], "samples[0].mem_used_bytes")]:
        r = await beat(rig, "vm-a", lease, samples(gpu, 2) + batch)
        assert r.status == 400 and (await r.json())["error"]["field"] == field.replace("[0]", "[2]"), await r.text()
    assert (await beat(rig, "vm-a", lease, [dict(samples(gpu, 1)[0], mem_used_bytes=has)])).status == 200
    await rig.runtime.ingestor.flush()
    assert (await rig.runtime.store.lease_usage_summary(lease))["total"]["n"] == 1, "a refused body stores nothing"


# -- authenticated reads and the metrics listener --------------------------------------------------------------------
async def test_metrics_on_a_listener_of_their_own(served: Served) -> None:
    rig, port, app = await served(agent={"metrics_listen": "127.0.0.1:0"})
    started = await start_metrics_server(app, rig.settings)
    assert started is not None
    runner, url = started
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url) as r:  # no token: whoever reaches this address may scrape
                assert r.status == 200 and "hostagent_gpus" in await r.text()
            async with s.get(f"http://127.0.0.1:{port}/metrics", headers=rig.auth("operator")) as r:
                assert r.status == 404, "the API's port no longer serves /metrics"
    finally:
        await runner.cleanup()


# -- bounded lists ------------------------------------------------------------------------------------------------
async def test_lease_lists_come_in_pages(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    made = [(await leased(rig, "vm-a"))[0] for _ in range(5)]
    await leased(rig, "vm-b")  # not vm-a's: never on its pages
    seen: list[str] = []
    url = "/v1/leases?limit=2"
    for _ in range(10):
        r = await rig.client.get(url, headers=rig.auth("vm-a"))
        body = await r.json()
        assert r.status == 200 and len(body["leases"]) <= 2, body
        seen += [x["id"] for x in body["leases"]]
        if body["next_cursor"] is None:
            break
        url = f"/v1/leases?limit=2&cursor={body['next_cursor']}"
    assert seen == made[::-1], "newest first, each once, across pages"
    for query, field in [("limit=1001", "limit"), ("cursor=bm9wZQ", "cursor"), ("cursor=%00", "cursor")]:
        r = await rig.client.get(f"/v1/leases?{query}", headers=rig.auth("vm-a"))
        assert r.status == 400 and (await r.json())["error"]["field"] == field, query


async def test_event_lists_come_in_pages(tmp_path: Path, aiohttp_client: Any) -> None:
    """GET /v1/events pages back through the whole journal: each event once, newest page first, filters kept."""
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    for _ in range(3):
        await leased(rig, "vm-a")
    op = rig.auth("operator")
    every = (await (await rig.client.get(f"/v1/events?limit={MAX_PAGE}", headers=op)).json())
    assert every["next_cursor"] is None and len(every["events"]) > 6
    seen: list[int] = []
    url = "/v1/events?limit=4"
    for _ in range(50):
        body = await (await rig.client.get(url, headers=op)).json()
        page = [e["seq"] for e in body["events"]]
        assert page == sorted(page) and len(page) <= 4
        seen = page + seen
        if body["next_cursor"] is None:
            break
        url = f"/v1/events?limit=4&cursor={body['next_cursor']}"
    assert seen == [e["seq"] for e in every["events"]], "each event once, in order, across pages"
    lease_id = every["events"][-1]["lease_id"]
    first = await (await rig.client.get(f"/v1/events?limit=1&lease_id={lease_id}", headers=op)).json()
    rest = await (await rig.client.get(f"/v1/events?lease_id={lease_id}&cursor={first['next_cursor']}",
                                       headers=op)).json()
    assert {e["lease_id"] for e in first["events"] + rest["events"]} == {lease_id}
    for query in ("limit=0", "limit=1001", "cursor=abc", "cursor=-1", "cursor=99999999999999999999",
                  f"cursor={2**63}", "cursor=9950531683176173811"):  # 19 digits, past SQLite's integer (a 500 once)
        r = await rig.client.get(f"/v1/events?{query}", headers=op)
        assert r.status == 400 and (await r.json())["error"]["field"] == query.split("=")[0], query


async def test_refused_requests_whose_bodies_never_come_do_not_hold_the_agent_after_their_clients_leave(
        served: Served) -> None:
    """An anonymous client sends heads of POSTs that announce a body and never send it, and hangs up on the 401:
    each connection is gone from the agent at once (it once lingered 10 s reading a body nobody would send, counted
    against agent.max_connections, so such a client filled the cap for everyone)."""
    rig, port, _ = await served(agent={"max_connections": 40, "max_connections_per_source": 40})
    for _ in range(3):
        for _ in range(40):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ABUSER, 0))
            writer.write(b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            status, _, _ = await read_response(reader)
            assert status in (401, 503), status
            writer.close()
        deadline = time.monotonic() + 2.0  # well under aiohttp's 10 s lingering time
        while (status := (await get(port, "/v1/gpus", rig.tokens["vm-a"]))[0]) != 200:
            assert time.monotonic() < deadline, f"another tenant still refused ({status}) after the abuser left"
            await asyncio.sleep(0.05)


async def test_a_guest_sends_requests_at_its_rate(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, agent={"guest_requests_per_s": 2.0}), aiohttp_client)
    for _ in range(20):  # a burst of 10 s of its rate
        assert (await rig.client.get("/v1/gpus", headers=rig.auth("vm-a"))).status == 200
    t0 = time.monotonic()
    r = await rig.client.get("/v1/gpus", headers=rig.auth("vm-a"))
    assert r.status == 429 and "guest_requests_per_s" in (await r.json())["error"]["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 2
    assert time.monotonic() - t0 >= 0.4, "the refusal is held back (a tarpit), so a tight loop slows itself"
    assert (await rig.client.get("/v1/gpus", headers=rig.auth("vm-b"))).status == 200  # another guest: its own
    assert (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).status == 200
    await asyncio.sleep(1.1)
    assert (await rig.client.get("/v1/gpus", headers=rig.auth("vm-a"))).status == 200


async def test_one_callers_listings_parse_one_at_a_time_and_two_in_all(tmp_path: Path, aiohttp_client: Any,
                                                                        monkeypatch: Any) -> None:
    """A page is parsed in a worker thread holding the GIL the event loop needs: a guest's concurrent listings
    queue behind each other, and at most LISTING_THREADS pages are parsed at once."""
    from hostagent.web import app as web_app

    rig = await start_rig(make_rig(tmp_path, agent={"max_inflight_per_token": 16}), aiohttp_client)
    real = rig.runtime.journal.lease_page
    busy: list[str] = []
    peak = {"all": 0, "vm-a": 0}

    def page(**kw: Any) -> Any:
        who = "vm-a" if kw.get("domain_uuid") == rig.uuids["vm-a"] else "other"
        busy.append(who)
        peak["all"] = max(peak["all"], len(busy))
        peak["vm-a"] = max(peak["vm-a"], busy.count("vm-a"))
        time.sleep(0.05)
        busy.remove(who)
        return real(**kw)

    monkeypatch.setattr(rig.runtime.journal, "lease_page", page)
    calls = [rig.client.get("/v1/leases", headers=rig.auth(vm)) for vm in ["vm-a"] * 6 + ["vm-b", "vm-c", "vm-d"]]
    assert {r.status for r in await asyncio.gather(*calls)} == {200}
    assert peak["vm-a"] == 1 and peak["all"] == web_app.LISTING_THREADS
    assert not rig.client.app[web_app.LISTINGS].callers, "no caller's lock outlives its listings"
