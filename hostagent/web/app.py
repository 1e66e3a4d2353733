"""The aiohttp application: JSON API under /v1, health, metrics. Errors become HTTP in exactly one middleware."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from hostagent.domain.admission import TokenBucket
from hostagent.domain.errors import (Conflict, Forbidden, HostAgentError, InvalidInput, NotFound, TooManyRequests,
                                     Unauthorized)
from hostagent.domain.lease import LeaseState, parse_lease_request
from hostagent.services.fleet import fleet_view, read_fleet
from hostagent.services.leases import lease_view
from hostagent.store.lease_listing import sqlite_integer
from hostagent.web.auth import Identity, bearer, require
from hostagent.web.keys import IDENTITY, RUNTIME, SAMPLES_ACCEPTED
from hostagent.web.lease_json import LeaseJson, listing_body
from hostagent.web.openapi import MAX_PAGE, MAX_WORK_RATE, STATE_FILTER_PATTERN

log = logging.getLogger("hostagent.web")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_SAMPLES_PER_HEARTBEAT = 1000
SAMPLE_FUTURE_SKEW_S = 300.0
SAMPLE_MAX_AGE_S = 7 * 24 * 3600.0
MEMORY_SLACK = 1.05  # a GPU's memory size may be an estimate (from its name or BAR): refuse only what is clearly more


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """The one error model of the API."""
    err: dict[str, Any] = {"code": code, "message": message}
    if field:
        err["field"] = field
    return {"error": err}


_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 408: "request_timeout", 409: "conflict", 413: "payload_too_large",
               415: "unsupported_media_type", 429: "rate_limited", 431: "header_fields_too_large",
               503: "unavailable", 504: "timeout"}
BODY_ABANDONED: web.RequestKey[bool] = web.RequestKey("hostagent.body_abandoned")  # set by read_json (abandon_body)
_STATE_FILTER = re.compile(STATE_FILTER_PATTERN)  # the document's pattern for GET /v1/leases?state=
SERVER_HEADER = "hostagent"  # the Server header of every response: the product, not its Python or aiohttp version


def http_code(status: int) -> str:
    """The error model's code for an HTTP status the agent answers itself (not for a domain error)."""
    return _HTTP_CODES.get(status, "http_error")


async def hide_server_version(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: replace aiohttp's `Server: Python/3.x aiohttp/3.x`, which tells a scanner what to try."""
    response.headers["Server"] = SERVER_HEADER


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn domain errors and aiohttp's HTTP exceptions into the error model; hide internals on 500."""
    try:
        return await handler(request)
    except HostAgentError as exc:
        headers = {"Retry-After": str(max(1, math.ceil(exc.details.get("retry_after", 1))))} if exc.retryable else None
        resp = web.json_response({"error": exc.to_dict()}, status=exc.http_status, headers=headers)
        if request.get(BODY_ABANDONED):
            resp.force_close()  # what is left of a body that failed to decode cannot be told from a next request
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = http_code(exc.status)
        message = exc.reason
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        elif exc.status == 413:
            message = "request body is too large"
        return web.json_response(error_body(code, message), status=exc.status,
                                 headers={k: v for k, v in exc.headers.items() if k == "Allow"})
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response(error_body("internal", "internal error; see the agent's log"), status=500)


INFLIGHT: web.AppKey[dict[str, int]] = web.AppKey("hostagent.inflight", dict)  # guest -> its requests being handled
RATES: web.AppKey[dict[str, TokenBucket]] = web.AppKey("hostagent.rates", dict)  # guest -> its request rate
COST: web.RequestKey[float] = web.RequestKey("hostagent.cost")  # what a request cost beyond 1 (set by its handler)
REQUEST_BURST_S = 10.0  # a guest may send this many seconds of agent.guest_requests_per_s at once
ROWS_PER_REQUEST = 100  # a listing costs one more request per this many rows it returns
TARPIT_S = 1.0  # a guest over its limits hears its 429 after this long
VIEWS_PER_SLICE = 50  # a long listing lets other requests run between slices of this many lease views
EVENTS_PAGE = 500  # GET /v1/events: events per page unless the caller asks for another limit
LISTING_THREADS = 2  # journal pages parsed at once in worker threads: each holds the GIL the event loop needs
LISTINGS: web.AppKey[Listings] = web.AppKey("hostagent.listings")
LEASE_JSON: web.AppKey[LeaseJson] = web.AppKey("hostagent.lease_json")


class Listings:
    """Who may parse a page of leases now: one page per caller at a time, LISTING_THREADS in all. A page of a
    thousand leases is parsed in a worker thread that holds the GIL while it works; eight of them at once (one
    guest's whole in-flight share) left the event loop a ninth of the interpreter, and every other tenant's
    heartbeat waited. With these slots a guest's listings queue behind each other, and another caller waits for
    at most one of them."""

    def __init__(self) -> None:
        self.threads = asyncio.Semaphore(LISTING_THREADS)
        self.callers: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # caller -> its lock, and how many use it

    @contextlib.asynccontextmanager
    async def slot(self, caller: str) -> AsyncIterator[None]:
        """Hold one of the slots while parsing a page for `caller`."""
        lock, users = self.callers.setdefault(caller, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock, self.threads:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self.callers[caller]


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Resolve the caller's identity from its bearer token (None for anonymous); handlers decide what they need.
    A guest has at most agent.max_inflight_per_token requests being handled at once (all its tokens together), and
    sends at most agent.guest_requests_per_s (a long listing counts one more per ROWS_PER_REQUEST rows): past
    either, it is answered 429, so a guest that floods the agent with slow or costly requests waits on itself, not
    on the others. The 429 comes after TARPIT_S (a sleep costs the agent nothing): a client firing requests in a
    loop is slowed to its own concurrency per second instead of making the agent answer thousands of refusals a
    second, which cost the other tenants as much as serving them.

    Only the Authorization header counts: the dashboard's session cookie never authenticates the API, which has no
    CSRF protection (a browser would send the cookie with any site's forged request)."""
    rt = request.app[RUNTIME]
    identity: Identity | None = None
    token = bearer(request)
    if token is not None:
        identity = rt.tokens.resolve(token)
        if identity is None:
            raise Unauthorized("unknown or revoked token", field="Authorization")
    request[IDENTITY] = identity
    if identity is None or identity.is_operator:
        return await handler(request)
    key = identity.domain_uuid or identity.subject
    inflight = request.app[INFLIGHT]
    cap = rt.settings.agent.max_inflight_per_token
    if inflight.get(key, 0) >= cap:
        await asyncio.sleep(TARPIT_S)
        raise TooManyRequests(f"this VM already has {cap} requests in progress (agent.max_inflight_per_token); "
                              "wait for their answers", field="Authorization", retry_after=1)
    rate = rt.settings.agent.guest_requests_per_s
    bucket = request.app[RATES].get(key)
    now = time.monotonic()
    if bucket is None:
        bucket = request.app[RATES][key] = TokenBucket(rate, rate * REQUEST_BURST_S, now)
    wait = bucket.refused_for(now) or bucket.take(1.0, now)
    if wait:
        await asyncio.sleep(TARPIT_S)
        raise TooManyRequests(f"this VM sends requests faster than agent.guest_requests_per_s ({rate:g}/s, long "
                              f"listings counting more); retry in {math.ceil(wait)} s", field="Authorization",
                              retry_after=wait)
    inflight[key] = inflight.get(key, 0) + 1
    try:
        return await handler(request)
    finally:
        bucket.charge(request.get(COST, 0.0), time.monotonic())
        left = inflight[key] - 1
        if left:
            inflight[key] = left
        else:
            del inflight[key]


async def read_json(request: web.Request) -> Any:
    """The body as JSON; clear 415 / 400 errors for wrong content types and malformed JSON."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(reason="Content-Type must be application/json")
    try:
        async with asyncio.timeout(request.app[RUNTIME].settings.agent.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(reason="the request body did not arrive in time") from None
    except (HttpProcessingError, web.RequestPayloadError):  # a bad chunk, or a Content-Encoding it is not in
        abandon_body(request)
        raise InvalidInput("the request body does not match its Transfer-Encoding or Content-Encoding") from None
    if not raw:
        return {}
    return parse_json(raw)


def abandon_body(request: web.Request) -> None:
    """After a body that failed to decode, have the error response close the connection (Connection: close): the
    stream is out of step. And mark the body ended, or aiohttp lingers after the response to read the rest, which
    re-raises the failure and logs it as an unhandled exception."""
    request.content.feed_eof()
    request[BODY_ABANDONED] = True


def _no_constant(name: str) -> Any:
    """json.loads hook: NaN and Infinity are Python's extension, not JSON; a NaN would slip past range checks."""
    raise InvalidInput(f"malformed JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """Strict JSON, every failure a 400 whose message says where the body broke and never quotes the exception:
    its text names Python internals (and once advised calling sys.set_int_max_str_digits())."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"malformed JSON at line {exc.lineno}, column {exc.colno}") from None
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"malformed JSON: the body is not UTF-8 (byte {exc.start})") from None
    except RecursionError:  # ~1000 nested [ or { exhaust the parser's stack well under max_body_bytes
        raise InvalidInput("malformed JSON: arrays or objects are nested too deeply") from None
    except ValueError:  # the json module's one other ValueError: an integer longer than sys.get_int_max_str_digits()
        raise InvalidInput("malformed JSON: a number has too many digits") from None


def ident(request: web.Request, *, operator: bool = False) -> Identity:
    """The caller, requiring a credential."""
    return require(request.get(IDENTITY), operator=operator)


# ---- health ----------------------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: reconciled, hypervisor connected; store degradation is reported but still ready."""
    rt = request.app[RUNTIME]
    checks = rt.readiness()
    ready = all(c["ok"] for c in checks.values() if c.get("required", True))
    return web.json_response({"ready": ready, "degraded": any(not c["ok"] for c in checks.values()),
                              "checks": checks}, status=200 if ready else 503)


# ---- GPUs ------------------------------------------------------------------------------------------------------


async def list_gpus(request: web.Request) -> web.Response:
    """Every GPU on this host with its state (any token may read the inventory)."""
    rt = request.app[RUNTIME]
    who = ident(request)
    await rt.refresh_drivers()
    return web.json_response({"gpus": [rt.gpu_view_for(g, who) for g in sorted(rt.manager.gpus)]})


async def get_gpu(request: web.Request) -> web.Response:
    """One GPU with its lease and history summary."""
    rt = request.app[RUNTIME]
    gpu_id = request.match_info["gpu_id"]
    if gpu_id not in rt.manager.gpus:
        raise NotFound(f"no GPU {gpu_id!r}; list them with GET /v1/gpus", field="gpu_id")
    identity = ident(request)
    return web.json_response(await rt.gpu_detail(gpu_id, identity))


async def clear_quarantine(request: web.Request) -> web.Response:
    """Operator: put a quarantined GPU back into service."""
    who = ident(request, operator=True)
    rt = request.app[RUNTIME]
    gpu_id = request.match_info["gpu_id"]
    await rt.manager.clear_quarantine(gpu_id, actor=who.subject)
    await rt.refresh_drivers()
    return web.json_response(rt.gpu_view_for(gpu_id, who))


# ---- leases ----------------------------------------------------------------------------------------------------


async def create_lease(request: web.Request) -> web.Response:
    """POST /v1/leases: 201 granted, 202 queued, 4xx/409 refused."""
    who = ident(request)
    rt = request.app[RUNTIME]
    body = await read_json(request)
    domain_uuid = who.domain_uuid
    if isinstance(body, dict) and "domain" in body:  # as the document says: a string; a guest's own VM only
        body = dict(body)
        named = body.pop("domain")
        if not isinstance(named, str) or not 1 <= len(named) <= 256:
            raise InvalidInput("domain must be a VM name or UUID", field="domain")
        if who.is_operator:
            domain_uuid = named
        elif named not in (who.domain_uuid, who.domain_name):
            raise Forbidden("a guest may lease only for its own VM", field="domain")
    elif who.is_operator:
        raise InvalidInput("an operator must name the VM with 'domain' (name or UUID)", field="domain")
    req = parse_lease_request(body, now=rt.clock(), max_duration_s=rt.settings.leases.max_duration_s)
    assert domain_uuid is not None
    lease = await rt.manager.request(domain_uuid, req, actor=who.subject, trusted=who.is_operator,
                                     stated=body.get("priority") is not None)
    status = 202 if lease.state is LeaseState.QUEUED else 201
    if lease.state is LeaseState.FAILED:
        return web.json_response(
            {"error": {"code": "lease_failed", "message": lease.error or "lease failed and was rolled back"},
             "lease": lease_view(lease, rt.manager)}, status=500 if lease.error else 409,
        )
    return web.json_response(lease_view(lease, rt.manager), status=status,
                             headers={"Location": f"/v1/leases/{lease.id}"})


async def list_leases(request: web.Request) -> web.Response:
    """Newest first; `state=` and `since=` filters; guests see their own."""
    who = ident(request)
    rt = request.app[RUNTIME]
    states = None
    if "state" in request.query:
        if not _STATE_FILTER.fullmatch(request.query["state"]):
            raise InvalidInput(f"state must be comma-separated names of {', '.join(s.value for s in LeaseState)}",
                               field="state")
        try:
            states = [LeaseState(s.strip().upper()) for s in request.query["state"].split(",") if s.strip()]
        except ValueError:
            raise InvalidInput(f"state must be one of {', '.join(s.value for s in LeaseState)}", field="state") from None
    since = None
    if "since" in request.query:
        try:
            since = float(request.query["since"])
        except ValueError:
            raise InvalidInput("since must be unix seconds", field="since") from None
        if not math.isfinite(since):
            raise InvalidInput("since must be finite unix seconds", field="since")
    limit = _page_limit(request, 200)
    async with request.app[LISTINGS].slot(who.subject):
        leases, after = await rt.run(rt.journal.lease_page, states=states, domain_uuid=who.scope, since=since,
                                     limit=limit, cursor=request.query.get("cursor"))
    request[COST] = len(leases) / ROWS_PER_REQUEST
    encoded = request.app[LEASE_JSON]
    parts = []
    for i, x in enumerate(leases):  # a thousand new views in one go held the event loop ~20 ms: others wait less
        if i and i % VIEWS_PER_SLICE == 0:
            await asyncio.sleep(0)
        parts.append(encoded.encode(rt.manager.leases.get(x.id, x), rt.manager))
    return web.Response(body=listing_body(parts, after), content_type="application/json")


async def get_lease(request: web.Request) -> web.Response:
    """State, devices, usage so far, warnings."""
    who = ident(request)
    rt = request.app[RUNTIME]
    lease = rt.manager.get(request.match_info["lease_id"], domain_uuid=who.scope)
    body = lease_view(lease, rt.manager)
    body["usage"] = await rt.lease_usage(lease.id)
    return web.json_response(body)


async def delete_lease(request: web.Request) -> web.Response:
    """Release: 200 when the GPUs are back on the host, 202 while the detach is pending."""
    who = ident(request)
    rt = request.app[RUNTIME]
    lease = await rt.manager.release(request.match_info["lease_id"], actor=who.subject, reason="released by "
                                     + ("operator" if who.is_operator else "guest"), domain_uuid=who.scope)
    return web.json_response(lease_view(lease, rt.manager), status=202 if lease.state is LeaseState.DETACH_PENDING else 200)


async def renew_lease(request: web.Request) -> web.Response:
    """Extend the TTL."""
    who = ident(request)
    rt = request.app[RUNTIME]
    body = await read_json(request) if request.body_exists else {}  # the body is optional (OpenAPI: required false)
    if not isinstance(body, dict) or set(body) - {"duration_s"}:
        bad = sorted(set(body) - {"duration_s"})[0] if isinstance(body, dict) else None
        raise InvalidInput(f"unknown field {bad!r}" if bad else "body must be a JSON object", field=bad)
    lease = await rt.manager.renew(request.match_info["lease_id"], duration_s=body.get("duration_s"),
                                   actor=who.subject, domain_uuid=who.scope)
    return web.json_response(lease_view(lease, rt.manager))


def _finite(value: Any) -> bool:
    """A JSON number that is finite as a float: a 400-digit integer is not (math.isfinite overflows on it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def parse_samples(body: Any, memory: dict[str, int | None], now: float, not_before: float) -> list[dict[str, Any]]:
    """Validate a heartbeat body completely before anything is written. `memory`: the lease's GPUs and how many
    bytes each has (None: unknown); `not_before`: when the lease got its GPUs (a sample from before is not of this
    lease). What no GPU could report (more memory used than it has) is refused too: samples feed accounting and
    the placement model."""
    if not isinstance(body, dict):
        raise InvalidInput("body must be a JSON object")
    unknown = sorted(set(body) - {"samples"})
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r}", field=unknown[0])
    samples = body.get("samples", [])
    if not isinstance(samples, list):
        raise InvalidInput("samples must be a list", field="samples")
    if len(samples) > MAX_SAMPLES_PER_HEARTBEAT:
        raise InvalidInput(f"at most {MAX_SAMPLES_PER_HEARTBEAT} samples per heartbeat", field="samples")
    out = []
    for i, s in enumerate(samples):
        where = f"samples[{i}]"
        if not isinstance(s, dict):
            raise InvalidInput(f"{where} must be an object", field=where)
        extra = sorted(set(s) - {"ts", "gpu", "util_pct", "mem_used_bytes", "work_rate"})
        if extra:
            raise InvalidInput(f"{where}: unknown field {extra[0]!r}", field=f"{where}.{extra[0]}")
        for key in ("ts", "gpu", "util_pct"):
            if key not in s:
                raise InvalidInput(f"{where}.{key} is required", field=f"{where}.{key}")
        ts, gpu, util = s["ts"], s["gpu"], s["util_pct"]
        if not _finite(ts):
            raise InvalidInput(f"{where}.ts must be unix seconds", field=f"{where}.ts")
        if ts > now + SAMPLE_FUTURE_SKEW_S:
            raise InvalidInput(f"{where}.ts is {ts - now:.0f} s in the future (skew bound {SAMPLE_FUTURE_SKEW_S:.0f} s)",
                               field=f"{where}.ts")
        if ts < now - SAMPLE_MAX_AGE_S:
            raise InvalidInput(f"{where}.ts is older than {SAMPLE_MAX_AGE_S / 86400:.0f} days", field=f"{where}.ts")
        if ts < not_before - SAMPLE_FUTURE_SKEW_S:
            raise InvalidInput(f"{where}.ts is {not_before - ts:.0f} s before this lease got its GPUs",
                               field=f"{where}.ts")
        if not isinstance(gpu, str):  # a list here is unhashable, and its repr could echo a megabyte back
            raise InvalidInput(f"{where}.gpu must be a GPU id (a string)", field=f"{where}.gpu")
        if gpu not in memory:
            raise InvalidInput(f"{where}.gpu {gpu[:64]!r} is not a GPU of this lease", field=f"{where}.gpu")
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 <= util <= 100:
            raise InvalidInput(f"{where}.util_pct must be 0..100", field=f"{where}.util_pct")
        mem = s.get("mem_used_bytes", 0)
        if isinstance(mem, bool) or not isinstance(mem, int) or not 0 <= mem <= 2**50:
            raise InvalidInput(f"{where}.mem_used_bytes must be a non-negative integer", field=f"{where}.mem_used_bytes")
        has = memory[gpu]
        if has is not None and mem > has * MEMORY_SLACK:
            raise InvalidInput(f"{where}.mem_used_bytes is more than {gpu} has ({has} bytes)",
                               field=f"{where}.mem_used_bytes")
        rate = s.get("work_rate")
        if rate is not None and (not _finite(rate) or not 0 <= rate <= MAX_WORK_RATE):
            raise InvalidInput(f"{where}.work_rate must be a number 0..{MAX_WORK_RATE:g}", field=f"{where}.work_rate")
        out.append({"ts": float(ts), "gpu_id": gpu, "util_pct": float(util), "mem_used_bytes": mem,
                    "work_rate": None if rate is None else float(rate)})
    return out


async def heartbeat(request: web.Request) -> web.Response:
    """Usage samples from the guest; the reply carries any warning or reclaim notice."""
    who = ident(request)
    rt = request.app[RUNTIME]
    lease = rt.manager.get(request.match_info["lease_id"], domain_uuid=who.scope)
    wait = rt.samples_refused_for(lease)
    if wait:
        await asyncio.sleep(TARPIT_S)  # in one of its in-flight slots: a flood slows itself down
        raise TooManyRequests(f"this lease was told to wait {wait:.0f} s more before sending samples "
                              "(store.samples_per_lease_per_s)", field="samples", retry_after=wait)
    body = await read_json(request)
    if lease.state.terminal:
        raise Conflict(f"lease {lease.id} has ended ({lease.state.value})", field="lease_id")
    memory = {g: rt.manager.gpus[g].memory_bytes if g in rt.manager.gpus else None for g in lease.gpu_ids}
    samples = parse_samples(body, memory, time.time(), lease.granted_at or lease.created_at)
    accepted = await rt.accept_samples(lease, samples)  # 429 over its rate or share, 503 when the queue is full
    request[SAMPLES_ACCEPTED] = accepted  # hostagent_heartbeat_samples_total (metrics_middleware)
    current = rt.manager.leases.get(lease.id, lease)
    view = lease_view(current, rt.manager)
    return web.json_response({"accepted": accepted, "state": current.state.value, "warnings": view["warnings"],
                              "reclaim": view["reclaim"], "expires_at": current.expires_at,
                              "granted_gpus": current.granted_gpus})


# ---- events, topology, openapi ---------------------------------------------------------------------------------


async def move_lease(request: web.Request) -> web.Response:
    """Operator: make-before-break move of a lease's GPU to another (202 once the new one is attached beside it)."""
    who = ident(request)
    if not who.is_operator:
        raise Forbidden("moving a lease is the operator's", field="lease_id")
    rt = request.app[RUNTIME]
    body = await read_json(request)
    if not isinstance(body, dict) or set(body) - {"to", "from", "deadline_s"} or not isinstance(body.get("to"), str):
        bad = sorted(set(body) - {"to", "from", "deadline_s"})[0] if isinstance(body, dict) and set(body) - {
            "to", "from", "deadline_s"} else "to"
        raise InvalidInput("body: {\"to\": GPU id, \"from\": GPU id (when the lease has several), \"deadline_s\": "
                           "seconds the guest has to move its work}", field=bad)
    src = body.get("from")
    if src is not None and not isinstance(src, str):
        raise InvalidInput("from must be a GPU id", field="from")
    lease = await rt.manager.move(request.match_info["lease_id"], body["to"][:128], src,
                                  deadline_s=body.get("deadline_s", 300), actor=who.subject)
    return web.json_response(lease_view(lease, rt.manager), status=202)


async def move_done(request: web.Request) -> web.Response:
    """The guest moved its work to the new GPU: the old one is detached and given back now."""
    who = ident(request)
    rt = request.app[RUNTIME]
    lease = await rt.manager.move_done(request.match_info["lease_id"], actor=who.subject, domain_uuid=who.scope)
    return web.json_response(lease_view(lease, rt.manager))


async def reclaim_control(request: web.Request) -> web.Response:
    """Operator: pause or resume idle reclaim on a lease."""
    who = ident(request, operator=True)
    rt = request.app[RUNTIME]
    body = await read_json(request)
    if not isinstance(body, dict) or set(body) != {"paused"} or not isinstance(body["paused"], bool):
        raise InvalidInput('body must be {"paused": true|false}', field="paused")
    lease = await rt.reaper.set_paused(request.match_info["lease_id"], body["paused"], actor=who.subject)
    return web.json_response(lease_view(lease, rt.manager))


async def reaper_status(request: web.Request) -> web.Response:
    """Operator: every lease's strike state and next check."""
    ident(request, operator=True)
    rt = request.app[RUNTIME]
    s = rt.reaper.settings
    return web.json_response({"enabled": s.enabled, "check_interval_s": s.check_interval_s, "grace_s": s.grace_s,
                              "notice_window_s": s.notice_window_s,
                              "host_signal": {"trusted": s.policy.host_signal_untrusted is None,
                                              "why_not": s.policy.host_signal_untrusted},
                              "leases": rt.reaper.status()})


async def list_events(request: web.Request) -> web.Response:
    """Operator: the journal's events (transitions, repairs, strikes, quarantines), newest page first (each page
    oldest first); `next_cursor` pages on to older ones, null on the last page."""
    ident(request, operator=True)
    rt = request.app[RUNTIME]
    kinds = request.query.get("kind")
    limit = _page_limit(request, EVENTS_PAGE)
    before = None
    if "cursor" in request.query:
        cursor = request.query["cursor"]
        # a journal sequence number: 19 digits can be more than SQLite binds
        if not cursor.isascii() or not cursor.isdigit() or len(cursor) > 19 or not sqlite_integer(int(cursor)):
            raise InvalidInput("cursor must be a next_cursor this API gave", field="cursor")
        before = int(cursor)
    events = await rt.run(rt.journal.events, lease_id=request.query.get("lease_id"),
                          gpu_id=request.query.get("gpu_id"), kinds=kinds.split(",") if kinds else None,
                          before_seq=before, limit=limit)
    after = str(events[0].seq) if len(events) == limit else None
    return web.json_response({"events": [e.to_dict() for e in events], "next_cursor": after})


async def fleet_status(request: web.Request) -> web.Response:
    """Operator: every host sharing the usage store as each last published itself (services.fleet): GPUs by state,
    utilization, queue, model version, dashboard URL, staleness; the fleet's idle candidates and totals. 503 while
    the store cannot be read; no hosts (`store: false`) for an agent without a store."""
    ident(request, operator=True)
    rt = request.app[RUNTIME]
    kw = {"now": time.time(), "this_host": rt.settings.agent.host_id,
          "interval_s": rt.settings.store.fleet_publish_interval_s}
    if rt.store is None:
        return web.json_response({**fleet_view([], **kw), "store": False})
    return web.json_response({**await read_fleet(rt.store, **kw), "store": True})


def _page_limit(request: web.Request, default: int) -> int:
    """The `limit` query parameter: rows per page, 1..MAX_PAGE (a 400 naming the field otherwise)."""
    if "limit" not in request.query:
        return default
    try:
        limit = int(request.query["limit"])
    except ValueError:
        raise InvalidInput(f"limit must be an integer 1..{MAX_PAGE}", field="limit") from None
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"limit must be an integer 1..{MAX_PAGE} (page on with next_cursor)", field="limit")
    return limit


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI 3 document of this API (any token)."""
    from hostagent.web.openapi import document

    ident(request)
    return web.json_response(document(max_duration_s=request.app[RUNTIME].settings.leases.max_duration_s))


def add_api_routes(app: web.Application) -> None:
    """Register every JSON API route (the OpenAPI test walks these), and hide the server's version on every response
    of the app (make_app calls this for every app it builds, served by serve.py or by a test client)."""
    app.on_response_prepare.append(hide_server_version)
    app[INFLIGHT] = {}
    app[RATES] = {}
    app[LISTINGS] = Listings()
    app[LEASE_JSON] = LeaseJson()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/openapi.json", openapi)
    app.router.add_get("/v1/gpus", list_gpus)
    app.router.add_get("/v1/gpus/{gpu_id}", get_gpu)
    app.router.add_post("/v1/gpus/{gpu_id}/clear-quarantine", clear_quarantine)
    app.router.add_post("/v1/leases", create_lease)
    app.router.add_get("/v1/leases", list_leases)
    app.router.add_get("/v1/leases/{lease_id}", get_lease)
    app.router.add_delete("/v1/leases/{lease_id}", delete_lease)
    app.router.add_post("/v1/leases/{lease_id}/heartbeat", heartbeat)
    app.router.add_post("/v1/leases/{lease_id}/renew", renew_lease)
    app.router.add_post("/v1/leases/{lease_id}/reclaim", reclaim_control)
    app.router.add_post("/v1/leases/{lease_id}/move", move_lease)
    app.router.add_post("/v1/leases/{lease_id}/move/done", move_done)
    app.router.add_get("/v1/reaper", reaper_status)
    app.router.add_get("/v1/events", list_events)
    app.router.add_get("/v1/fleet", fleet_status)
