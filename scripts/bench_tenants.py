#!/usr/bin/env python3
"""Tenants: a well-behaved guest's latency and errors while another tenant abuses the agent, one abuse at a time.

The agent runs as a subprocess (`hostagent demo`, default settings, 16 simulated GPUs, attach 50 ms, detach
acknowledged after 50 ms) with 24 VMs; a 13-GPU lease held by one VM keeps the host busy, so the abusers' big
requests queue instead of taking free GPUs (taking free GPUs within one's quota is not an abuse). The victim VM,
from 127.0.0.1, loops: POST /v1/leases (1 GPU, 300 s), three heartbeats of 16 samples, DELETE. Each phase runs
it for the same time: alone (the baseline, after a warm-up), then beside one abuser, a separate process on
127.0.0.2 with other VMs' tokens: (a) queue flood, 16 loops posting deferred 16-GPU requests at priority 1000;
(b) idempotency storm, rounds of 50 concurrent POSTs with one key; (c) connection hog, 300 connections held,
reopened as soon as closed; (d) heartbeat flood, 8 loops of 1000-sample heartbeats; (e) slow bodies, 64
connections sending heartbeat heads whose bodies never come; (f) read hammer, 16 loops of GET
/v1/leases?limit=1000 and GET /v1/gpus/{id}, with 512 requests queued and ~500 leases in the hammer's history.

Per phase: the victim's p50/p99 per operation, its p99 against the baseline's, its errors, the abuser's statuses;
a third tenant on 127.0.0.3 opening a new connection for each of its requests (4 a second), and how long after
the abuser stops 24 new connections at once are served again. Afterwards, with the agent stopped: every accepted
sample in the usage store once, and one lease per idempotency key in the journal. Verdicts are printed, never
turned into an exit status (benchmarks report; they are not tests).

    python scripts/bench_tenants.py [--duration 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import resource
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostagent.bench.agentproc import AgentProcess, prepare_host, read_cpu_s  # noqa: E402
from hostagent.bench.machine import header_line, load_average  # noqa: E402
from hostagent.bench.stats import percentile  # noqa: E402

VICTIM_ADDR, ABUSER_ADDR, BYSTANDER_ADDR = "127.0.0.1", "127.0.0.2", "127.0.0.3"
VMS = 24
VICTIM, FILLER, FLOOD, STORM, HOG, BEATS, SLOW, HAMMER = range(8)  # index of each role's VM in the credentials
QUEUERS = range(HAMMER, HAMMER + 16)  # VMs whose deferred requests fill the queue for the read hammer
BYSTANDER = HAMMER + 16  # a third tenant opening a fresh connection 4 times a second
PROBE_EVERY_S = 0.25
RECOVERY_BURST = 24  # fresh connections at once that must all be served once an abuser stops
FILLER_GPUS = 13  # held all run: 3 GPUs stay free for the victim (and an abuser's one-GPU lease)
VICTIM_DURATION_S = 300  # ends long before the filler's lease: backfilled behind a queued 16-GPU head
FILLER_DURATION_S = 3600
SAMPLES_PER_BEAT, BEATS_PER_LEASE = 16, 3
RATIO_MAX = 3.0
OPS = ("create", "heartbeat", "release")
EXPECTED = {"create": {201}, "heartbeat": {200}, "release": {200, 202}, "fresh": {200}}
LIVE = "QUEUED,BINDING,ATTACHING,ACTIVE,RELEASING,DETACHING,DETACH_PENDING,REBINDING"


# -- the victim ----------------------------------------------------------------------------------------------------
@dataclass
class Victim:
    """What one tenant (the victim, or the third tenant's fresh connections) saw in one phase."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    statuses: dict[str, collections.Counter[int | str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    errors: list[str] = field(default_factory=list)

    def record(self, op: str, status: int | str, seconds: float, detail: str = "") -> None:
        self.latencies[op].append(seconds)
        self.statuses[op][status] += 1
        if status not in EXPECTED[op]:
            self.errors.append(f"{op} {status} {detail[:160]}".strip())


@dataclass
class Ledger:
    """The victim's whole run: idempotency key -> lease id of each 201; lease id -> samples accepted."""

    created: dict[str, str] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))


async def call(session: aiohttp.ClientSession, method: str, url: str, token: str,
               body: Any = None) -> tuple[int | str, Any, float]:
    """(status or exception name, JSON body or None, seconds)."""
    t0 = time.perf_counter()
    try:
        async with session.request(method, url, json=body, headers={"Authorization": f"Bearer {token}"}) as r:
            data = await r.json(content_type=None) if r.content_length != 0 else None
            status: int | str = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        status, data = type(exc).__name__, None
    return status, data, time.perf_counter() - t0


def beat_samples(gpu: str, cursor_ms: list[int], n: int) -> list[dict[str, Any]]:
    """n samples of one GPU at whole, strictly increasing milliseconds (the store keys a sample by its ms)."""
    start = max(cursor_ms[0] + 1, int(time.time() * 1000) - n)
    cursor_ms[0] = start + n - 1
    return [{"ts": (start + i) / 1000.0, "gpu": gpu, "util_pct": 70.0, "mem_used_bytes": 1 << 30} for i in range(n)]


async def victim_loop(session: aiohttp.ClientSession, url: str, token: str, deadline: float, phase: str,
                      v: Victim, ledger: Ledger) -> None:
    """Lease one GPU, three heartbeats, release; until the deadline (the lease in hand is always released)."""
    n = 0
    while time.monotonic() < deadline:
        key = f"victim-{phase}-{n}"
        n += 1
        status, body, dt = await call(session, "POST", url + "/v1/leases", token,
                                      {"gpus": 1, "idempotency_key": key, "duration_s": VICTIM_DURATION_S})
        v.record("create", status, dt, json.dumps(body)[:160] if body else "")
        if status != 201 or not isinstance(body, dict):
            await asyncio.sleep(0.05)
            continue
        lid = body["id"]
        ledger.created[key] = lid
        gpu = body["devices"][0]["gpu_id"]
        cursor = [0]
        for _ in range(BEATS_PER_LEASE):
            status, hb, dt = await call(session, "POST", f"{url}/v1/leases/{lid}/heartbeat", token,
                                        {"samples": beat_samples(gpu, cursor, SAMPLES_PER_BEAT)})
            v.record("heartbeat", status, dt, json.dumps(hb)[:160] if hb else "")
            if status == 200 and isinstance(hb, dict):
                ledger.accepted[lid] += int(hb["accepted"])
        for _ in range(50):
            status, rb, dt = await call(session, "DELETE", f"{url}/v1/leases/{lid}", token)
            if status != 409:
                break
            await asyncio.sleep(0.05)  # still being set up: not the victim's error yet
        v.record("release", status, dt, json.dumps(rb)[:160] if rb else "")


async def fresh_request(host: str, port: int, token: str | None) -> tuple[int | str, float]:
    """GET /v1/leases?limit=1 with the token (GET /healthz without one) on a new connection from BYSTANDER_ADDR
    (Connection: close): (status, seconds)."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port, local_addr=(BYSTANDER_ADDR, 0))
    except OSError as exc:
        return type(exc).__name__, time.perf_counter() - t0
    try:
        what = f"/v1/leases?limit=1 HTTP/1.1\r\nAuthorization: Bearer {token}" if token else "/healthz HTTP/1.1"
        writer.write(f"GET {what}\r\nHost: agent\r\nConnection: close\r\n\r\n".encode())
        status = await asyncio.wait_for(read_head(reader), 30)
    except (asyncio.TimeoutError, OSError, ValueError, IndexError) as exc:
        status = type(exc).__name__
    finally:
        writer.close()
    return status, time.perf_counter() - t0


async def bystander_loop(host: str, port: int, token: str, deadline: float, v: Victim) -> None:
    """A third tenant that connects afresh for each request, 4 times a second: are new connections served?"""
    start = time.monotonic()
    k = 0
    while time.monotonic() < deadline:
        status, dt = await fresh_request(host, port, token)
        v.record("fresh", status, dt)
        k += 1
        await asyncio.sleep(max(0.0, start + k * PROBE_EVERY_S - time.monotonic()))


async def wait_accepting(host: str, port: int, limit_s: float = 30.0) -> float | None:
    """Seconds until RECOVERY_BURST fresh connections opened together are all answered 200 (None: not within
    limit_s). One lucky connection is not enough: the agent may be a few connections under its cap."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        got = await asyncio.gather(*(fresh_request(host, port, None) for _ in range(RECOVERY_BURST)))
        if all(status == 200 for status, _ in got):
            return time.monotonic() - t0
        await asyncio.sleep(0.25)
    return None


# -- the abusers (each in a process of its own, `--abuser KIND --plan FILE`) -----------------------------------------
class Tally:
    """An abuser's counts: 'what status' -> n, plus free-form extras."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.extra: dict[str, Any] = {}

    def add(self, what: str, status: int | str) -> None:
        self.counts[f"{what} {status}"] += 1


def abuser_session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(ABUSER_ADDR, 0), limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=30))


async def abuse_queue_flood(plan: dict[str, Any], deadline: float, t: Tally) -> None:
    token, url = plan["tokens"][FLOOD], plan["url"]
    priorities: collections.Counter[int] = collections.Counter()
    async with abuser_session() as s:
        async def worker() -> None:
            while time.monotonic() < deadline:
                status, body, _ = await call(s, "POST", url + "/v1/leases", token,
                                             {"gpus": 16, "accept_deferred": True, "priority": 1000,
                                              "duration_s": 3600})
                t.add("POST /v1/leases", status)
                if status == 202 and isinstance(body, dict):
                    priorities[body["request"]["priority"]] += 1
        await asyncio.gather(*(worker() for _ in range(16)))
    t.extra["priority_given_to_queued"] = dict(priorities)


async def abuse_idempotency_storm(plan: dict[str, Any], deadline: float, t: Tally) -> None:
    token, url = plan["tokens"][STORM], plan["url"]
    rounds: list[dict[str, Any]] = []
    async with abuser_session() as s:
        r = 0
        while time.monotonic() < deadline:
            key = f"storm-{r}"
            # even rounds: one GPU, granted now (attach in flight while duplicates arrive); odd: 16 GPUs, queued
            body = ({"gpus": 1, "duration_s": 300} if r % 2 == 0 else
                    {"gpus": 16, "accept_deferred": True, "duration_s": 3600})
            body["idempotency_key"] = key
            got = await asyncio.gather(*(call(s, "POST", url + "/v1/leases", token, body) for _ in range(50)))
            ids = sorted({b["id"] for st, b, _ in got if st in (201, 202) and isinstance(b, dict)})
            for st, _, _ in got:
                t.add("POST /v1/leases", st)
            rounds.append({"key": key, "ids": ids, "answered": sum(1 for st, _, _ in got if st in (201, 202))})
            for lid in ids:  # release (or cancel) it so the next round starts from the same place
                for _ in range(50):
                    st, _, _ = await call(s, "DELETE", f"{url}/v1/leases/{lid}", token)
                    if st not in (409, 429):
                        break
                    await asyncio.sleep(0.05)
                t.add("DELETE /v1/leases/{id}", st)
            r += 1
    t.extra["rounds"] = rounds


async def read_head(reader: asyncio.StreamReader) -> int | str:
    """The status of one HTTP response (its body read and dropped); 'eof' when the connection closed first."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return "eof"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    if length:
        await reader.readexactly(length)
    return status


async def connect_as_abuser(host: str, port: int,
                            t: Tally) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A connection from the abuser's address, or None (counted in `t` as the error's name) after a short pause."""
    try:
        return await asyncio.open_connection(host, port, local_addr=(ABUSER_ADDR, 0))
    except OSError as exc:
        t.add("connect", type(exc).__name__)
        await asyncio.sleep(0.01)
        return None

async def abuse_connection_hog(plan: dict[str, Any], deadline: float, t: Tally) -> None:
    """300 connections, each: connect, one keep-alive GET /healthz, then hold it idle until the agent closes it;
    reconnect at once (a refused connection too: no back-off, Retry-After ignored)."""
    host, port = plan["host"], plan["port"]
    held = [0]
    peak = [0]
    held_samples: list[int] = []

    async def one() -> None:
        while time.monotonic() < deadline:
            conn = await connect_as_abuser(host, port, t)
            if conn is None:
                continue
            reader, writer = conn
            try:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
                left = deadline - time.monotonic()
                status = await asyncio.wait_for(read_head(reader), max(0.01, left))
                t.add("GET /healthz", status)
                if status == 200:
                    held[0] += 1
                    peak[0] = max(peak[0], held[0])
                    try:
                        await asyncio.wait_for(reader.read(), max(0.01, deadline - time.monotonic()))
                        t.add("held, then closed by the agent", "eof")
                    finally:
                        held[0] -= 1
            except (asyncio.TimeoutError, OSError, ValueError, IndexError):
                pass
            finally:
                writer.close()

    async def sample() -> None:
        while time.monotonic() < deadline:
            held_samples.append(held[0])
            await asyncio.sleep(0.25)

    await asyncio.gather(sample(), *(one() for _ in range(300)))
    t.extra["held_peak"] = peak[0]
    t.extra["held_mean"] = round(sum(held_samples) / max(1, len(held_samples)), 1)


async def abuse_heartbeat_flood(plan: dict[str, Any], deadline: float, t: Tally) -> None:
    token, url, lid, gpu = plan["tokens"][BEATS], plan["url"], plan["lease"], plan["gpu"]
    accepted = [0]
    async with abuser_session() as s:
        async def worker() -> None:
            while time.monotonic() < deadline:
                now_ms = int(time.time() * 1000)
                batch = [{"ts": (now_ms - 1000 + i) / 1000.0, "gpu": gpu, "util_pct": 99.0,
                          "mem_used_bytes": 1 << 30} for i in range(1000)]
                status, body, _ = await call(s, "POST", f"{url}/v1/leases/{lid}/heartbeat", token, {"samples": batch})
                t.add("POST /v1/leases/{id}/heartbeat", status)
                if status == 200 and isinstance(body, dict):
                    accepted[0] += int(body["accepted"])
        await asyncio.gather(*(worker() for _ in range(8)))
    t.extra["accepted"] = {lid: accepted[0]}


async def abuse_slow_bodies(plan: dict[str, Any], deadline: float, t: Tally) -> None:
    """64 connections, each sending a heartbeat's head with Content-Length: 1000 and one byte of body, then nothing;
    a new one as soon as the agent answers (408 after agent.body_timeout_s, or 429 at once)."""
    host, port, token, lid = plan["host"], plan["port"], plan["tokens"][SLOW], plan["lease"]
    head = (f"POST /v1/leases/{lid}/heartbeat HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()

    async def one() -> None:
        while time.monotonic() < deadline:
            conn = await connect_as_abuser(host, port, t)
            if conn is None:
                continue
            reader, writer = conn
            try:
                writer.write(head)
                status = await asyncio.wait_for(read_head(reader), max(0.01, deadline - time.monotonic()))
                t.add("POST /v1/leases/{id}/heartbeat (no body)", status)
            except asyncio.TimeoutError:
                t.add("POST /v1/leases/{id}/heartbeat (no body)", "still waiting at the end")
            except (OSError, ValueError, IndexError) as exc:
                t.add("POST /v1/leases/{id}/heartbeat (no body)", type(exc).__name__)
            finally:
                writer.close()

    await asyncio.gather(*(one() for _ in range(64)))


async def abuse_read_hammer(plan: dict[str, Any], deadline: float, t: Tally) -> None:
    token, url = plan["tokens"][HAMMER], plan["url"]
    longest = [0]
    async with abuser_session() as s:
        async def worker(i: int) -> None:
            k = i
            while time.monotonic() < deadline:
                if k % 2 == 0:
                    status, body, _ = await call(s, "GET", url + "/v1/leases?limit=1000", token)
                    t.add("GET /v1/leases?limit=1000", status)
                    if status == 200 and isinstance(body, dict):
                        longest[0] = max(longest[0], len(body["leases"]))
                else:
                    gpu = plan["gpus"][k % len(plan["gpus"])]
                    status, _, _ = await call(s, "GET", f"{url}/v1/gpus/{gpu}", token)
                    t.add("GET /v1/gpus/{id}", status)
                k += 1
        await asyncio.gather(*(worker(i) for i in range(16)))
    t.extra["longest_list"] = longest[0]


ABUSES = {"queue_flood": abuse_queue_flood, "idempotency_storm": abuse_idempotency_storm,
          "connection_hog": abuse_connection_hog, "heartbeat_flood": abuse_heartbeat_flood,
          "slow_bodies": abuse_slow_bodies, "read_hammer": abuse_read_hammer}


async def abuser_main(kind: str, plan_path: str) -> int:
    """Child process: say 'ready', wait for 'go' on stdin, abuse for plan['seconds'], print the tally as JSON."""
    plan = json.loads(Path(plan_path).read_text())
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    t = Tally()
    await ABUSES[kind](plan, time.monotonic() + plan["seconds"], t)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - t0
    cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    print(json.dumps({"counts": dict(t.counts), "extra": t.extra, "wall_s": wall, "cpu_s": cpu}), flush=True)
    return 0


# -- phases ----------------------------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    abuse: str | None
    what: str
    victim: Victim = field(default_factory=Victim)
    bystander: Victim = field(default_factory=Victim)
    recovery_s: float | None = 0.0
    abuser: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    agent_cpu_s: float = 0.0


PHASES = (
    ("idle", None, "the victim alone"),
    ("a. queue flood", "queue_flood", "16 loops: POST deferred 16-GPU requests, priority 1000"),
    ("b. idempotency storm", "idempotency_storm", "rounds of 50 concurrent POSTs with one idempotency key"),
    ("c. connection hog", "connection_hog", "300 connections held, reopened at once when closed"),
    ("d. heartbeat flood", "heartbeat_flood", "8 loops: 1000-sample heartbeats back to back"),
    ("e. slow bodies", "slow_bodies", "64 connections: heartbeat heads, body never sent"),
    ("f. read hammer", "read_hammer", "16 loops: GET /v1/leases?limit=1000, GET /v1/gpus/{id}"),
)


async def run_phase(p: Phase, *, url: str, plan: dict[str, Any], tmp: Path, seconds: float, agent_pid: int,
                    session: aiohttp.ClientSession, ledger: Ledger) -> None:
    """Start the abuser (if any) in its own process, run the victim beside it for `seconds`, collect both."""
    proc = None
    if p.abuse:
        plan_path = tmp / f"plan-{p.abuse}.json"
        plan_path.write_text(json.dumps({**plan, "seconds": seconds}))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--abuser", p.abuse, "--plan", str(plan_path),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if line.strip() != b"ready":
            raise RuntimeError(f"abuser {p.abuse} did not start: {line!r}")
    cpu0, t0 = read_cpu_s(agent_pid) or 0.0, time.perf_counter()
    if proc is not None:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    deadline = time.monotonic() + seconds
    await asyncio.gather(
        victim_loop(session, url, plan["tokens"][VICTIM], deadline, p.name.split(".")[0], p.victim, ledger),
        bystander_loop(plan["host"], plan["port"], plan["tokens"][BYSTANDER], deadline, p.bystander))
    if proc is not None:
        assert proc.stdout is not None
        out = await asyncio.wait_for(proc.stdout.readline(), seconds + 60)
        await proc.wait()
        p.abuser = json.loads(out) if out.strip() else {"counts": {}, "extra": {"crashed": proc.returncode}}
    p.wall_s = time.perf_counter() - t0
    p.agent_cpu_s = (read_cpu_s(agent_pid) or 0.0) - cpu0
    if proc is not None:  # the abuser is gone: how long until a new connection is served again
        p.recovery_s = await wait_accepting(plan["host"], plan["port"])


async def api(session: aiohttp.ClientSession, method: str, url: str, token: str, body: Any = None,
              want: tuple[int, ...] = (200, 201, 202)) -> Any:
    """A setup call that must succeed (after waiting out a 429's Retry-After: setup sends a guest's requests faster
    than agent.guest_requests_per_s allows, and waits as a guest would)."""
    for _ in range(100):
        status, data, _ = await call(session, method, url, token, body)
        if status != 429:
            break
        await asyncio.sleep(1.0)
    if status not in want:
        raise RuntimeError(f"setup: {method} {url} answered {status}: {data}")
    return data


async def end_abusers_leases(session: aiohttp.ClientSession, url: str, operator: str, keep: set[str]) -> int:
    """The operator releases (or cancels) every live lease not in `keep`; returns how many."""
    leases: list[dict[str, Any]] = []
    cursor = ""
    while True:  # pages of at most 1000, newest first, on with next_cursor
        page = await api(session, "GET", f"{url}/v1/leases?state={LIVE}&limit=1000{cursor}", operator)
        leases += page["leases"]
        if not page.get("next_cursor"):
            break
        cursor = f"&cursor={page['next_cursor']}"
    ended = 0
    for x in leases:
        if x["id"] in keep:
            continue
        for _ in range(100):
            status, _, _ = await call(session, "DELETE", f"{url}/v1/leases/{x['id']}", operator)
            if status != 409:
                break
            await asyncio.sleep(0.05)
        ended += 1
    return ended


async def fill_queue(session: aiohttp.ClientSession, url: str, tokens: list[str], history_rounds: int) -> int:
    """Queue 32 deferred 16-GPU requests from each queuing VM; before that the hammer's VM queues and cancels 32 at
    a time `history_rounds` times, so its own list is long. Returns the number queued."""
    body = {"gpus": 16, "accept_deferred": True, "duration_s": 3600}
    hammer = tokens[HAMMER]
    for _ in range(history_rounds):
        ids = [(await api(session, "POST", url + "/v1/leases", hammer, body))["id"] for _ in range(32)]
        for lid in ids:
            await api(session, "DELETE", f"{url}/v1/leases/{lid}", hammer)

    async def queue(tok: str) -> int:
        for _ in range(32):
            await api(session, "POST", url + "/v1/leases", tok, body, want=(202,))
        return 32

    return sum(await asyncio.gather(*(queue(tokens[i]) for i in QUEUERS)))


# -- report ----------------------------------------------------------------------------------------------------------
def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.2f}"


def p99_ratio(p: Phase, base: Phase, op: str) -> float:
    b = percentile(base.victim.latencies[op], 99)
    return percentile(p.victim.latencies[op], 99) / b if b else math.nan


def met(p: Phase, base: Phase) -> bool:
    return (not p.victim.errors and all(p99_ratio(p, base, op) <= RATIO_MAX for op in ("create", "heartbeat"))
            and all(p.victim.latencies[op] for op in ("create", "heartbeat")))


def fresh_ok(p: Phase) -> bool:
    return not p.bystander.errors and p.recovery_s is not None


def print_phase(p: Phase, base: Phase) -> None:
    v = p.victim
    n_ab = sum(p.abuser.get("counts", {}).values())
    n_429 = sum(n for k, n in p.abuser.get("counts", {}).items() if k.endswith(" 429"))
    print(f"\n[{p.name}] {p.what}; {p.wall_s:.1f} s, agent CPU {p.agent_cpu_s / p.wall_s * 100:.0f} % of one core")
    for op in OPS:
        lat = v.latencies.get(op, [])
        if not lat:
            print(f"  victim {op:<9}      0 calls")
            continue
        st = ", ".join(f"{k}: {n}" for k, n in sorted(v.statuses[op].items(), key=lambda kv: str(kv[0])))
        ratio = "" if op == "release" else f"  p99 = {p99_ratio(p, base, op):.2f} x idle"
        print(f"  victim {op:<9} {len(lat):>6} calls  p50 {ms(percentile(lat, 50)):>7} ms  "
              f"p99 {ms(percentile(lat, 99)):>7} ms  max {ms(max(lat)):>7} ms{ratio}  ({st})")
    print(f"  victim errors: {len(v.errors)}" + (f" (first: {v.errors[0]})" if v.errors else ""))
    fr = p.bystander.latencies.get("fresh", [])
    st = ", ".join(f"{k}: {n}" for k, n in sorted(p.bystander.statuses["fresh"].items(), key=lambda kv: str(kv[0])))
    print(f"  third tenant, a new connection each time ({BYSTANDER_ADDR}): {len(fr)} requests  p50 "
          f"{ms(percentile(fr, 50))} ms  p99 {ms(percentile(fr, 99))} ms  ({st})")
    if p.abuse:
        cpu = p.abuser.get("cpu_s", 0.0)
        print(f"  abuser: {n_ab} answers ({n_ab / p.wall_s:.0f}/s), {n_429} of them 429; its client CPU "
              f"{cpu / p.wall_s * 100:.0f} % of one core")
        for k, n in sorted(p.abuser.get("counts", {}).items()):
            print(f"    {k}: {n}")
        extra = {k: x for k, x in p.abuser.get("extra", {}).items() if k not in ("rounds", "accepted")}
        if extra:
            print("    " + ", ".join(f"{k} {x}" for k, x in extra.items()))
        rounds = p.abuser.get("extra", {}).get("rounds")
        if rounds is not None:
            one = sum(1 for r in rounds if len(r["ids"]) == 1)
            none = sum(1 for r in rounds if not r["ids"])
            many = [r for r in rounds if len(r["ids"]) > 1]
            print(f"    idempotency: {len(rounds)} rounds of 50; one lease id per key in {one}, no lease in {none} "
                  f"(every copy refused), more than one in {len(many)} -> {'MET' if not many else 'NOT MET'}")
            print(f"    copies answered 201/202 per round: mean "
                  f"{sum(r['answered'] for r in rounds) / max(1, len(rounds)):.1f} of 50 (the rest refused 429)")
    verdict = "MET" if met(p, base) else "NOT MET"
    if p is not base:
        rec = "never (30 s)" if p.recovery_s is None else f"{p.recovery_s:.1f} s"
        print(f"  {RECOVERY_BURST} new connections at once all served again {rec} after the abuser stopped")
        print(f"  verdict: p99 within {RATIO_MAX:g}x idle and 0 errors: {verdict}")
        print(f"  verdict: the third tenant's new connections all served: {mark(fresh_ok(p))}")


def store_counts(state: Path) -> dict[str, int]:
    db = sqlite3.connect(f"file:{state / 'usage.sqlite3'}?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT lease_id, COUNT(*) FROM usage_samples GROUP BY lease_id").fetchall())
    finally:
        db.close()


def journal_rows(state: Path) -> list[tuple[str, str, str | None, str]]:
    db = sqlite3.connect(f"file:{state / 'journal.sqlite3'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT id, domain_uuid, idem_key, state FROM leases").fetchall()
    finally:
        db.close()


def mark(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def print_checks(state: Path, creds: dict[str, Any], ledger: Ledger, phases: list[Phase]) -> None:
    stored = store_counts(state)
    rows = journal_rows(state)
    uuid = {i: vm["uuid"] for i, vm in enumerate(creds["vms"])}
    print("\nafter the run (agent stopped; usage store and journal read with sqlite3):")
    # samples: every 200's "accepted" in the store, once
    victim_acc = sum(ledger.accepted.values())
    victim_st = sum(stored.get(lid, 0) for lid in ledger.accepted)
    off = [lid for lid, n in ledger.accepted.items() if stored.get(lid, 0) != n]
    print(f"  victim samples: accepted {victim_acc} (sum of 'accepted' in its 200s), in the store {victim_st}, "
          f"leases that differ {len(off)} -> {mark(victim_acc == victim_st and not off)}")
    flood: dict[str, int] = {}
    for p in phases:
        flood.update(p.abuser.get("extra", {}).get("accepted", {}))
    for lid, n in flood.items():
        print(f"  heartbeat flood's samples: accepted {n}, in the store {stored.get(lid, 0)} -> "
              f"{mark(stored.get(lid, 0) == n)}")
    # leases: the victim's 201s are its journal rows, one per key
    mine = {r[0]: r[2] for r in rows if r[1] == uuid[VICTIM]}
    answered = set(ledger.created.values())
    keys = collections.Counter(k for k in mine.values() if k)
    extra_rows = set(mine) - answered
    print(f"  victim leases: {len(answered)} answered 201, {len(mine)} in the journal, in the journal but never "
          f"answered {len(extra_rows)}, answered but not journaled {len(answered - set(mine))}, keys with more "
          f"than one lease {sum(1 for n in keys.values() if n > 1)} -> "
          f"{mark(set(mine) == answered and all(n == 1 for n in keys.values()))}")
    storm = {r[2]: [] for r in rows if r[1] == uuid[STORM]}
    for r in rows:
        if r[1] == uuid[STORM]:
            storm[r[2]].append(r[0])
    rounds = [r for p in phases for r in p.abuser.get("extra", {}).get("rounds", [])]
    bad = [r["key"] for r in rounds if len(storm.get(r["key"], [])) > 1 or (r["ids"] and storm.get(r["key"]) != r["ids"])
           or (not r["ids"] and storm.get(r["key"]))]
    if any(p.abuse == "idempotency_storm" for p in phases):
        print(f"  idempotency storm: {len(rounds)} keys, journal rows {sum(len(v) for v in storm.values())}, keys "
              f"whose journal rows are not exactly the one id answered {len(bad)} -> {mark(not bad and bool(rounds))}")
    dup = collections.Counter((r[1], r[2]) for r in rows if r[2])
    print(f"  whole journal: {len(rows)} leases, (VM, idempotency key) pairs with more than one lease "
          f"{sum(1 for n in dup.values() if n > 1)} -> {mark(all(n == 1 for n in dup.values()))}")


def print_summary(phases: list[Phase]) -> None:
    base = phases[0]
    print("\nsummary (victim latencies in ms; x idle: its p99 over the idle phase's p99; fresh refused: the third "
          "tenant's new\n connections not served; back in: until 24 new connections at once are served after the abuser "
          "stopped)")
    print(f"  {'phase':<22} {'create p50':>10} {'p99':>7} {'x idle':>6}  {'beat p50':>8} {'p99':>7} {'x idle':>6} "
          f"{'errors':>6}  {'abuser/s':>8} {'429s':>7}  {'fresh refused':>13} {'back in':>7}  verdict (victim; fresh)")
    for p in phases:
        c, h = p.victim.latencies["create"], p.victim.latencies["heartbeat"]
        counts = p.abuser.get("counts", {})
        n_ab = sum(counts.values())
        n_429 = sum(n for k, n in counts.items() if k.endswith(" 429"))
        verdict = "(baseline)" if p is base else f"{mark(met(p, base))}; {mark(fresh_ok(p))}"
        refused = f"{len(p.bystander.errors)}/{len(p.bystander.latencies['fresh'])}"
        back = "-" if not p.abuse else ("never" if p.recovery_s is None else f"{p.recovery_s:.1f} s")
        abuser = f"{n_ab / p.wall_s:>8.0f} {n_429:>7}" if p.abuse else f"{'-':>8} {'-':>7}"
        print(f"  {p.name:<22} {ms(percentile(c, 50)):>10} {ms(percentile(c, 99)):>7} {p99_ratio(p, base, 'create'):>6.2f}  "
              f"{ms(percentile(h, 50)):>8} {ms(percentile(h, 99)):>7} {p99_ratio(p, base, 'heartbeat'):>6.2f} "
              f"{len(p.victim.errors):>6}  {abuser}  {refused:>13} {back:>7}  {verdict}")


# -- main ------------------------------------------------------------------------------------------------------------
async def main_async(args: argparse.Namespace) -> int:
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmpdir:
        tmp = Path(tmpdir)
        state = tmp / "state"
        creds = prepare_host(state, vms=VMS, scenario="demo16", attach_latency_s=0.05, detach_ack_delay_s=0.05)
        tokens = [vm["token"] for vm in creds["vms"]]
        operator = creds["operator"]["token"]
        agent = AgentProcess(state)
        url = agent.start()
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        phases = [Phase(name, abuse, what) for name, abuse, what in PHASES
                  if abuse is None or not args.phases or name.split(".")[0] in args.phases]
        ledger = Ledger()
        print(f"agent pid {agent.pid} at {url} (default settings); {VMS} VMs, 16 simulated GPUs, {FILLER_GPUS} of them "
              f"held all run by another VM; {len(phases)} phases of {args.duration:g} s; victim from {VICTIM_ADDR}, "
              f"abusers from {ABUSER_ADDR} (a process of their own)")
        try:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8),
                                            timeout=aiohttp.ClientTimeout(total=30))
            async with session:
                filler = await api(session, "POST", url + "/v1/leases", tokens[FILLER],
                                   {"gpus": FILLER_GPUS, "duration_s": FILLER_DURATION_S}, want=(201,))
                keep = {filler["id"]}
                gpus = [g["id"] for g in (await api(session, "GET", url + "/v1/gpus", operator))["gpus"]]
                plan: dict[str, Any] = {"url": url, "host": host, "port": int(port), "tokens": tokens, "gpus": gpus}
                warm = Victim()  # first leases pay for imports and caches: not in the baseline
                await victim_loop(session, url, tokens[VICTIM], time.monotonic() + args.warmup, "warmup", warm, ledger)
                print(f"  warm-up: {len(warm.latencies['create'])} victim leases, {len(warm.errors)} errors")
                for p in phases:
                    if p.abuse in ("heartbeat_flood", "slow_bodies"):
                        who = BEATS if p.abuse == "heartbeat_flood" else SLOW
                        held = await api(session, "POST", url + "/v1/leases", tokens[who],
                                         {"gpus": 1, "duration_s": 300}, want=(201,))
                        plan = {**plan, "lease": held["id"], "gpu": held["devices"][0]["gpu_id"]}
                    if p.abuse == "read_hammer":
                        t0 = time.perf_counter()
                        queued = await fill_queue(session, url, tokens, args.history_rounds)
                        print(f"  (read hammer set-up: {queued} requests queued from {len(QUEUERS)} VMs, the hammer's "
                              f"VM made {args.history_rounds * 32 + 32} leases; {time.perf_counter() - t0:.1f} s)")
                    await run_phase(p, url=url, plan=plan, tmp=tmp, seconds=args.duration, agent_pid=agent.pid,
                                    session=session, ledger=ledger)
                    if p.abuse:
                        await end_abusers_leases(session, url, operator, keep)
                    print(f"  {p.name}: done ({len(p.victim.latencies['create'])} victim leases, "
                          f"{len(p.victim.errors)} errors)", flush=True)
                await asyncio.sleep(2.5)  # the ingest queue flushes every second
        finally:
            agent.stop()
        for p in phases:
            print_phase(p, phases[0])
        print_summary(phases)
        print_checks(state, creds, ledger, phases)
    print(f"\nload average (1/5/15 min): {load_before} before, {load_average()} after")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of each phase (default 20)")
    ap.add_argument("--history-rounds", type=int, default=15,
                    help="the read hammer's VM queues and cancels 32 leases this many times first (default 15)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of victim leases before the baseline (default 3)")
    ap.add_argument("--quick", action="store_true", help="6 s phases, a shorter lease history (a smoke run)")
    ap.add_argument("--phases", type=lambda v: set(v.replace(",", "")), default=set(), metavar="LETTERS",
                    help="run only these abuse phases after the idle baseline, e.g. 'af' or 'a,f' (default: all)")
    ap.add_argument("--abuser", choices=sorted(ABUSES), help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    args = ap.parse_args()
    letters = {name.split(".")[0] for name, abuse, _ in PHASES if abuse}
    if args.phases - letters:
        ap.error(f"--phases: no phase {', '.join(sorted(args.phases - letters))} (there are {''.join(sorted(letters))})")
    if args.abuser:
        return asyncio.run(abuser_main(args.abuser, args.plan))
    if args.quick:
        args.duration, args.history_rounds = 6.0, 3
    print(header_line())
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
