"""Bad input at every layer: a clean 4xx in the API's error model, nothing of the agent's internals, nothing changed.

Bodies are checked on every operation the served OpenAPI document says takes one, so an endpoint is covered as soon as
it is documented (each one is also checked to be routed: a stale document fails here). What aiohttp's own
parser refuses, slow clients and the connection cap are checked on the server serve() runs (start_server, with the
agent's connection guard), never on aiohttp's test server, which has none of that.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import re
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
from hostagent.web.serve import start_server
from tests.support.agent import AgentRig, make_rig, start_rig

JSON = {"Content-Type": "application/json"}
ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# What an error response must never carry: a traceback or its parts, a Python exception class, an interpreter hint,
# the server's software and version.
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/work/|site-packages|\b[A-Z]\w*(Error|Exception)\b|sys\.|"
                   r"set_int_max_str_digits|aiohttp|Python|CPython", re.IGNORECASE)
ERROR_CODES = {400: "invalid_input", 413: "payload_too_large", 415: "unsupported_media_type"}


@pytest.fixture
async def rig(tmp_path: Path, aiohttp_client: Any) -> AgentRig:
    return await start_rig(make_rig(tmp_path), aiohttp_client)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[tuple[AgentRig, int, web.AppRunner]]]]:
    """Start an agent the way serve() does (start_server: GuardedServer and its limits) with some [agent] keys set."""
    runners: list[web.AppRunner] = []

    async def start(**agent: Any) -> tuple[AgentRig, int, web.AppRunner]:
        root = tmp_path / f"agent{len(runners)}"
        root.mkdir()
        rig = make_rig(root, agent={"listen": "127.0.0.1", "port": 0, **agent})
        runner, url = await start_server(make_app(rig.runtime), rig.settings)
        runners.append(runner)
        return rig, int(url.rsplit(":", 1)[1]), runner

    yield start
    for runner in runners:
        await runner.cleanup()


def assert_clean_error(status: int, headers: Any, raw: bytes, *, code: str | None = None) -> dict[str, Any]:
    """A 4xx in the error model, with nothing of the agent's internals in its body or headers."""
    assert 400 <= status < 500, (status, raw[:300])
    assert headers.get("Content-Type", "").startswith("application/json"), (status, dict(headers))
    assert headers.get("Server") == "hostagent", dict(headers)
    assert not LEAKS.search(raw.decode("utf-8", "replace")), raw[:300]
    assert not any(LEAKS.search(f"{k}: {v}") for k, v in headers.items()), dict(headers)
    body = json.loads(raw)
    assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]) <= {"code", "message", "field"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def vfio_functions(rig: AgentRig) -> set[str]:
    d = rig.tree.sys_root / "bus/pci/drivers/vfio-pci"
    return {p.name for p in d.iterdir() if p.is_symlink() and ADDRESS.match(p.name)} if d.exists() else set()


async def snapshot(rig: AgentRig) -> dict[str, Any]:
    """Everything bad input must not move: leases (with usage), GPU states, the journal, sysfs and the hypervisor."""
    op = rig.auth("operator")
    leases = (await (await rig.client.get("/v1/leases", headers=op)).json())["leases"]
    details = [await (await rig.client.get(f"/v1/leases/{x['id']}", headers=op)).json() for x in leases]
    return {
        "leases": leases,
        # usage grows more keys once the store has caught up with a new lease; its sample count is what must not move
        "details": [{**d, "usage": d["usage"]["samples"]} for d in details],
        "gpus": (await (await rig.client.get("/v1/gpus", headers=op)).json())["gpus"],
        "events": (await (await rig.client.get("/v1/events", headers=op)).json())["events"],
        "vfio": vfio_functions(rig),
        "attached": {vm: await rig.hv.attached_hostdevs(uuid) for vm, uuid in rig.uuids.items()},
    }


async def body_operations(rig: AgentRig) -> list[tuple[str, str, dict[str, Any]]]:
    """(METHOD, path template, operation) for every operation the served OpenAPI document gives a requestBody."""
    doc = await (await rig.client.get("/v1/openapi.json", headers=rig.auth("operator"))).json()
    ops = [(method.upper(), path, op) for path, item in doc["paths"].items() for method, op in item.items()
           if isinstance(op, dict) and "requestBody" in op]
    routed = {(r.method, r.resource.canonical) for r in rig.client.server.app.router.routes() if r.resource}
    assert ops and ("POST", "/v1/leases") in {(m, p) for m, p, _ in ops}, ops
    for method, path, _ in ops:
        assert (method, path) in routed, f"{method} {path} is documented with a body but not routed"
    return ops


def bad_bodies(max_body: int) -> list[tuple[str, str | dict[str, str], bytes, int]]:
    """(case, Content-Type or headers, body, expected status): each is refused before anything happens."""
    gzip_json = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    return [
        ("unterminated object", "application/json", b'{"gpus": 1,', 400),
        ("not JSON at all", "application/json", b"{not json", 400),
        ("a trailing comma", "application/json", b'{"duration_s": 60,}', 400),
        ("invalid UTF-8", "application/json", b'{"task_type": "\xff\xfe"}', 400),
        ("NaN", "application/json", b'{"duration_s": NaN}', 400),
        ("-Infinity", "application/json", b'{"samples": [{"ts": -Infinity}]}', 400),
        ("a 5000-digit integer", "application/json", b'{"duration_s": 1' + b"0" * 5000 + b"}", 400),
        ("100 000 nested arrays", "application/json", b"[" * 100_000, 400),
        ("50 000 nested objects", "application/json", b'{"a":' * 50_000, 400),
        ("5000 nested arrays, closed", "application/json", b"[" * 5000 + b"]" * 5000, 400),
        ("a JSON array", "application/json", b"[]", 400),
        ("a JSON array of objects", "application/json", b'[{"gpus": 1}]', 400),
        ("a JSON number", "application/json", b"1", 400),
        ("a JSON string", "application/json", b'"gpus"', 400),
        ("JSON null", "application/json", b"null", 400),
        ("JSON true", "application/json", b"true", 400),
        ("text/plain", "text/plain", b'{"gpus": 1}', 415),
        ("a form", "application/x-www-form-urlencoded", b"gpus=1", 415),
        ("octet-stream", "application/octet-stream", b'{"gpus": 1}', 415),
        ("multipart", "multipart/form-data; boundary=x", b'--x\r\n\r\n{"gpus": 1}\r\n--x--\r\n', 415),
        ("JSON-ish type", "application/jsonp", b'{"gpus": 1}', 415),
        ("over max_body_bytes", "application/json", b'{"pad": "' + b"x" * max_body + b'"}', 413),
        ("gzip that is not", gzip_json, b'{"gpus": 1}', 400),
        ("gzip over max_body_bytes", gzip_json, gzip.compress(b'{"pad": "' + b"x" * max_body + b'"}'), 413),
    ]


async def test_every_body_endpoint_refuses_bad_bodies_cleanly_and_changes_nothing(rig: AgentRig) -> None:
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    held = await r.json()
    assert r.status == 201, held
    params = {"lease_id": held["id"], "gpu_id": sorted(rig.runtime.manager.gpus)[-1]}
    before = await snapshot(rig)
    cases = bad_bodies(rig.settings.agent.max_body_bytes)
    checked = 0
    for method, template, op in await body_operations(rig):
        path = re.sub(r"\{(\w+)\}", lambda m: params[m.group(1)], template)
        callers = ["operator"] if op.get("summary", "").startswith("operator:") else ["operator", "vm-a"]
        for who in callers:
            for case, ctype, body, status in cases:
                headers = ctype if isinstance(ctype, dict) else {"Content-Type": ctype}
                r = await rig.client.request(method, path, data=body, headers={**rig.auth(who), **headers})
                raw = await r.read()
                where = f"{method} {path} as {who}, {case}"
                assert r.status == status, (where, r.status, raw[:300])
                err = assert_clean_error(r.status, r.headers, raw, code=ERROR_CODES[status])
                if case in ("unterminated object", "not JSON at all", "a trailing comma"):
                    assert re.fullmatch(r"malformed JSON at line 1, column \d+", err["message"]), (where, err)
                checked += 1
    assert checked >= len(cases) * 4
    assert await snapshot(rig) == before  # no lease created, renewed, paused or fed; no GPU moved; no event


async def test_bad_lease_requests_name_the_field_and_change_nothing(rig: AgentRig) -> None:
    h = rig.auth("vm-a")
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "colour": "red"}, headers=h)
    assert r.status == 400 and (await r.json())["error"]["field"] == "colour"
    r = await rig.client.post("/v1/leases", json={"gpus": 99}, headers=h)
    assert r.status == 400 and (await r.json())["error"]["field"] == "gpus"
    r = await rig.client.post("/v1/leases", data=b"[" + b"1," * 600_000 + b"1]", headers={**h, **JSON})
    assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"
    assert rig.runtime.manager.leases == {} and vfio_functions(rig) == set()  # nothing changed


async def test_heartbeat_samples_of_the_wrong_shape_are_400_not_500(rig: AgentRig) -> None:
    held = await (await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))).json()
    gpu = held["devices"][0]["gpu_id"]
    now = time.time()
    before = await snapshot(rig)
    for sample, field in [({"ts": now, "gpu": [[[gpu]]], "util_pct": 5}, "samples[0].gpu"),  # unhashable, deep
                          ({"ts": now, "gpu": {"id": gpu}, "util_pct": 5}, "samples[0].gpu"),
                          ({"ts": 10 ** 400, "gpu": gpu, "util_pct": 5}, "samples[0].ts"),  # overflows a float
                          ({"ts": now, "gpu": gpu, "util_pct": 5, "work_rate": 10 ** 400}, "samples[0].work_rate"),
                          ({"ts": now, "gpu": "x" * 100_000, "util_pct": 5}, "samples[0].gpu")]:
        r = await rig.client.post(f"/v1/leases/{held['id']}/heartbeat", json={"samples": [sample]},
                                  headers=rig.auth("vm-a"))
        raw = await r.read()
        err = assert_clean_error(r.status, r.headers, raw, code="invalid_input")
        assert r.status == 400 and err.get("field") == field, err
        assert len(raw) < 1000, "the error echoes the input back"
    assert await snapshot(rig) == before


# ---- below the app: aiohttp's parser, slow clients, the connection cap (the server serve() runs) ----------------


@pytest.mark.parametrize("agent, key", [({"header_timeout_s": 0}, "agent.header_timeout_s"),
                                        ({"idle_timeout_s": -1.0}, "agent.idle_timeout_s"),
                                        ({"max_connections": 0}, "agent.max_connections"),
                                        ({"header_timeout_s": 90.0, "idle_timeout_s": 60.0}, "agent.header_timeout_s")])
def test_connection_limits_are_validated(agent: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict({"agent": agent})
    assert info.value.field == key


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response off a raw connection: status, headers, body (by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    body = await reader.readexactly(int(headers.get("Content-Length", "0")))
    return status, headers, body


async def exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read the one response; the connection must then be closed by the server."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            response = await read_response(reader)
            assert await reader.read() == b"", "the connection stays open after a refused request"
        return response
    finally:
        writer.close()


MARK = b"ECHO-ME<script>"  # in every malformed request below; must never come back


async def test_parser_level_errors_are_clean_json_and_echo_nothing(served: Any) -> None:
    rig, port, _ = await served()
    token = rig.tokens["vm-a"].encode()
    cases = {
        "over-long header line": (b"GET /v1/gpus HTTP/1.1\r\nHost: x\r\nX-A: " + MARK + b"A" * 9000 + b"\r\n\r\n", 431),
        "over-long URL": (b"GET /" + MARK + b"B" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
        "too many headers": (b"GET /v1/gpus HTTP/1.1\r\nHost: x\r\n"
                             + b"".join(b"X-%d: %s\r\n" % (i, MARK) for i in range(200)) + b"\r\n", 431),
        "bad request line": (b"GET /v1/gpus HTTP/1.1 " + MARK + b"\r\nHost: x\r\n\r\n", 400),
        "not HTTP": (MARK + b"\x00\x01\r\n\r\n", 400),
        "TLS on the plain port": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + MARK + b"\r\n\r\n", 400),
        "bad Content-Length": (b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: 12" + MARK
                               + b"\r\n\r\n", 400),
        "two Content-Lengths": (b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n"
                                b"X-M: " + MARK + b"\r\n\r\n", 400),
        "Content-Length with chunked": (b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        "malformed header": (b"GET /v1/gpus HTTP/1.1\r\nHost: x\r\nBad Header" + MARK + b": v\r\n\r\n", 400),
        "no Host": (b"GET /v1/gpus HTTP/1.1\r\nX-M: " + MARK + b"\r\n\r\n", 400),
        "bad chunk, valid token": (b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   b"Authorization: Bearer " + token + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   b"Z" + MARK + b"\r\n{}\r\n0\r\n\r\n", 400),
    }
    for case, (data, status) in cases.items():
        got, headers, body = await exchange(port, data)
        assert got == status, (case, got, body)
        assert_clean_error(got, headers, body, code={400: "bad_request", 431: "header_fields_too_large"}[status])
        assert MARK not in body and b"ECHO" not in body.upper(), (case, body)
    assert rig.runtime.manager.leases == {} and vfio_functions(rig) == set()  # nothing changed
    # ... and the server still serves.
    status, headers, _ = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200


async def test_a_body_that_fails_to_decode_is_400_at_once_and_closes_the_connection(served: Any) -> None:
    rig, port, runner = await served(body_timeout_s=5.0)
    head = (b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
            + rig.tokens["vm-a"].encode())
    # A Content-Encoding the body is not in (aiohttp decodes it while the handler reads).
    t0 = time.monotonic()
    status, headers, body = await exchange(port, head + b"\r\nContent-Encoding: deflate\r\nContent-Length: 9\r\n\r\n"
                                           + MARK[:9])
    assert status == 400 and time.monotonic() - t0 < 2.0
    assert_clean_error(status, headers, body, code="invalid_input")
    # A bad chunk size arriving after the handler began reading the body: answered now, not body_timeout_s later.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + b"\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n")
        deadline = time.monotonic() + 5.0
        while not any(getattr(h, "_current_request", None) for h in runner.server.connections):  # type: ignore
            assert time.monotonic() < deadline, "the request never reached its handler"
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        writer.write(b"Z" + MARK + b"\r\n\r\n")
        async with asyncio.timeout(5.0):
            status, headers, body = await read_response(reader)
            assert await reader.read() == b""  # closed: the stream is out of step after a broken body
        assert status == 400 and time.monotonic() - t0 < 2.0
        assert_clean_error(status, headers, body, code="invalid_input")
        assert MARK not in body
    finally:
        writer.close()
    assert rig.runtime.manager.leases == {} and vfio_functions(rig) == set()


async def test_no_response_names_the_server_software(served: Any) -> None:
    rig, port, _ = await served()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
        for method, path, kw in [("GET", "/healthz", {}), ("GET", "/v1/gpus", {}), ("GET", "/nope", {}),
                                 ("DELETE", "/healthz", {}), ("GET", "/metrics", {}), ("GET", "/ui/login", {}),
                                 ("POST", "/v1/leases", {"data": b"{", "headers": {**rig.auth("vm-a"), **JSON}}),
                                 ("GET", "/v1/leases", {"headers": {"Authorization": "Bearer nope"}})]:
            async with s.request(method, path, **kw) as r:
                assert r.headers.get("Server") == "hostagent", (method, path, dict(r.headers))
                assert not any(re.search(r"aiohttp|python", f"{k}: {v}", re.I) for k, v in r.headers.items())


async def slow_head(port: int, *, first_request: bool = False, byte_every_s: float = 0.1,
                    give_up_s: float = 10.0) -> tuple[float, bytes]:
    """A client that trickles a request head one byte at a time and never finishes it (optionally after one whole
    request on the same connection); returns how long after its first head byte the server hung up, and what it
    sent before hanging up."""
    start = time.monotonic()  # before connect: the server's deadline may start as soon as it accepts
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if first_request:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, _ = await read_response(reader)
            assert status == 200
            start = time.monotonic()  # the deadline starts at the first byte of the next head, sent below
        received = b""
        trickle = iter(b"GET /v1/gpus HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000)
        while time.monotonic() - start < give_up_s:
            if not writer.is_closing():
                try:
                    writer.write(bytes([next(trickle)]))
                except (ConnectionError, RuntimeError):
                    pass
            try:
                chunk = await asyncio.wait_for(reader.read(65536), byte_every_s)  # the trickle's pace
            except TimeoutError:
                continue
            except ConnectionError:
                break
            if not chunk:
                break
            received += chunk
        return time.monotonic() - start, received
    finally:
        writer.close()


async def test_slow_headers_are_cut_off_while_a_normal_client_is_served(served: Any) -> None:
    header_timeout = 1.0
    rig, port, _ = await served(header_timeout_s=header_timeout, idle_timeout_s=30.0)
    slow = [asyncio.create_task(slow_head(port, first_request=i % 2 == 1)) for i in range(6)]
    latencies = []
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
        while not all(t.done() for t in slow):
            t0 = time.monotonic()
            async with s.get("/v1/gpus", headers=rig.auth("operator")) as r:  # not a tenant: no rate limit
                assert r.status == 200
                await r.read()
            latencies.append(time.monotonic() - t0)
    for elapsed, received in [t.result() for t in slow]:
        # Cut off at the deadline (never before it), from connect or from the first byte of a keep-alive request ...
        assert header_timeout <= elapsed < header_timeout + 2.0, elapsed
        # ... with a 408 in the error model, readable before the close.
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), received[:200]
        headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
        assert_clean_error(408, headers, body, code="request_timeout")
    # The normal client never waited on them: it was served throughout, hundreds of times (a server that waited on
    # the slow heads would answer it a few times, each once one of them was cut off). A stall of the shared 2-CPU
    # machine now and then is not the server's (CI on 2026-11-30: one request of 1,260 at 1.3 s, the rest under
    # 3 ms): at most one in a hundred over 0.5 s.
    stalled = [x for x in latencies if x >= 0.5]
    assert len(latencies) >= 20 and len(stalled) <= len(latencies) // 100, (len(latencies), stalled)


async def test_idle_connections_are_closed_after_idle_timeout_and_a_silent_one_at_the_head_deadline(
        served: Any) -> None:
    _, port, _ = await served(header_timeout_s=0.5, idle_timeout_s=1.5)
    # Connected but silent: the first request's head is due header_timeout_s after connect.
    t0 = time.monotonic()
    status, headers, body = await exchange(port, b"", timeout=5.0)
    assert status == 408 and 0.5 <= time.monotonic() - t0 < 2.5
    assert_clean_error(status, headers, body, code="request_timeout")
    # Idle between keep-alive requests: the head deadline does not apply, the idle timeout does (a silent close).
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        t0 = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5.0) == b""
        assert 1.3 <= time.monotonic() - t0 < 3.5
    finally:
        writer.close()


async def test_connection_cap_refuses_more_with_503_and_established_clients_go_on(served: Any) -> None:
    _, port, runner = await served(max_connections=3, header_timeout_s=30.0, idle_timeout_s=30.0)
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    held = []
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        assert (await read_response(reader))[0] == 200
        held.append((reader, writer))
    try:
        for _ in range(3):  # more connections than the cap: each answered 503 at once and closed
            t0 = time.monotonic()
            status, headers, body = await exchange(port, request, timeout=3.0)
            assert status == 503 and time.monotonic() - t0 < 1.0
            assert headers.get("Retry-After") == "1" and headers.get("Server") == "hostagent"
            assert json.loads(body)["error"]["code"] == "unavailable"
        assert runner.server is not None and runner.server.refused >= 3  # type: ignore[attr-defined]
        for reader, writer in held:  # the established ones were not stalled
            t0 = time.monotonic()
            writer.write(request)
            assert (await read_response(reader))[0] == 200 and time.monotonic() - t0 < 0.5
        # One leaves: a new connection gets in (once the server has seen the close).
        held.pop()[1].close()
        deadline = time.monotonic() + 5.0
        while True:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            status = (await read_response(reader))[0]
            writer.close()
            if status == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert status == 200
    finally:
        for _, writer in held:
            writer.close()
