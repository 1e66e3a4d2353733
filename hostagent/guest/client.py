"""HTTP client of the host agent's lease API, with retries, backoff and one clear error per refusal.

Standard library only (``http.client`` on worker threads of the client's own): a guest image needs nothing installed
but Python to run the guest agent, and the client imports in a fraction of the time aiohttp took (the whole guest
CLI: about 0.1 s against 0.5 s here, minutes inside a nested emulated guest). Connections are kept alive and reused.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import random
import ssl
import threading
import urllib.parse
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

from hostagent.guest.errors import ApiError, HostUnreachable

log = logging.getLogger("hostagent.guest.client")

RETRY_STATUSES = frozenset({429, 502, 503, 504})  # 429: this tenant asked for more than its share; wait
WORKERS = 4  # requests of one client in flight at once (each waits on its own thread)
# a kept-alive connection the server has closed meanwhile fails like this before any answer: sent again at once
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def ssl_context(ca_file: str | None, insecure: bool) -> ssl.SSLContext | bool:
    """TLS settings: a private CA bundle, verification off (explicitly asked), or the system defaults."""
    if insecure:
        return False
    if ca_file:
        return ssl.create_default_context(cafile=ca_file)
    return True


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the agent sends delta-seconds; an HTTP date is treated as unknown)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


class _Unanswered(Exception):
    """A request that got no HTTP answer: ``failure`` says why, in the guest's terms."""

    def __init__(self, failure: str) -> None:
        super().__init__(failure)
        self.failure = failure


class HostClient:
    """The lease API as coroutines (use `async with`); requests run on the client's own threads."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0, retries: int = 4, backoff_max_s: float = 30.0,
                 ssl: ssl.SSLContext | bool = True, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.url = url.rstrip("/")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the host agent's URL must be http:// or https:// with a host, got {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path
        self._headers = {"Authorization": f"Bearer {token}", "User-Agent": "hostagent-guest"}
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_max_s = backoff_max_s
        self._ssl = ssl
        self._sleep = sleep
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._pool: ThreadPoolExecutor | None = None

    async def __aenter__(self) -> HostClient:
        # its own threads: a client in the agent's process (the demo's guests) never waits on the agent's executor
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="hostagent-guest-http")
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the kept-alive connections and stop the client's threads."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown)
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds before retry `attempt` (0-based): the server's Retry-After, else capped exponential with jitter."""
        if retry_after is not None:
            return min(retry_after, self.backoff_max_s)
        return float(min(self.backoff_max_s, 0.5 * 2.0 ** attempt) * random.uniform(0.5, 1.0))

    async def request(self, method: str, path: str, body: Any = None, *, retries: int | None = None) -> tuple[int, Any]:
        """Send one API call; retry connection failures and 429/502/503/504; raise ApiError / HostUnreachable."""
        if self._pool is None:
            raise RuntimeError("HostClient used outside `async with`")
        retries = self.retries if retries is None else retries
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                status, raw, retry_after = await loop.run_in_executor(self._pool, self._send, method, path, data,
                                                                      headers)
            except _Unanswered as exc:
                failure = exc.failure
            else:
                payload = _decode(raw)
                if status < 400:
                    return status, payload
                err = _error(status, payload, retry_after)
                if status not in RETRY_STATUSES or attempt >= retries:
                    raise err
                log.info("%s %s: %s; retrying", method, path, err.message)
                await self._sleep(self.backoff(attempt, retry_after))
                attempt += 1
                continue
            if attempt >= retries:
                raise HostUnreachable(failure + (f" (after {attempt + 1} attempts)" if attempt else ""))
            log.info("%s; retrying", failure)
            await self._sleep(self.backoff(attempt))
            attempt += 1

    # -- one exchange, on a worker thread --------------------------------------------------------------------------
    def _send(self, method: str, path: str, data: bytes | None,
              headers: dict[str, str]) -> tuple[int, bytes, float | None]:
        """One request and its answer: (status, body, Retry-After); _Unanswered or HostUnreachable (TLS) else."""
        conn, reused = self._checkout()
        try:
            try:
                return self._exchange(conn, method, path, data, headers)
            except _STALE:
                if not reused:
                    raise
                conn.close()  # the server closed it while idle; nothing was answered: once more on a new one
                conn = self._connect()
                return self._exchange(conn, method, path, data, headers)
        except (_Unanswered, HostUnreachable):
            conn.close()
            raise
        except ssl.SSLError as exc:
            conn.close()
            raise HostUnreachable(f"TLS with {self.url} failed: {exc}") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Unanswered(f"no answer from the host agent at {self.url}: {type(exc).__name__} {exc}".rstrip()) \
                from None

    def _exchange(self, conn: http.client.HTTPConnection, method: str, path: str, data: bytes | None,
                  headers: dict[str, str]) -> tuple[int, bytes, float | None]:
        if conn.sock is None:
            self._open(conn)
        conn.request(method, self._prefix + path, body=data, headers={**self._headers, **headers})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.will_close:
            conn.close()
        else:
            self._checkin(conn)
        return resp.status, raw, _retry_after(resp.getheader("Retry-After"))

    def _open(self, conn: http.client.HTTPConnection) -> None:
        """Connect (and for https, the TLS handshake), each failure said as the guest needs to hear it."""
        try:
            conn.connect()
        except ssl.SSLError as exc:  # a certificate problem does not heal by retrying
            raise HostUnreachable(f"TLS handshake with {self.url} failed: {exc} (see ca_file / --ca-file)") from None
        except ConnectionRefusedError:
            raise _Unanswered(f"connection refused by {self.url}: is the host agent running and listening there?") \
                from None
        except TimeoutError as exc:
            raise _Unanswered(f"no answer from the host agent at {self.url}: {type(exc).__name__} {exc}".rstrip()) \
                from None
        except OSError as exc:
            raise _Unanswered(f"cannot connect to the host agent at {self.url}: {exc.strerror or exc}") from None

    def _checkin(self, conn: http.client.HTTPConnection) -> None:
        """Keep an answered connection for the next request (closed instead once the client is closing)."""
        with self._lock:
            if self._pool is not None:
                self._idle.append(conn)
                return
        conn.close()

    def _checkout(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _connect(self) -> http.client.HTTPConnection:
        if not self._https:
            return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
        if isinstance(self._ssl, ssl.SSLContext):
            ctx = self._ssl
        elif self._ssl:
            ctx = ssl.create_default_context()
        else:  # verification off, as the operator asked (--insecure)
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout_s, context=ctx)

    # -- the API --------------------------------------------------------------------------------------------------
    async def create_lease(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST /v1/leases: (201, ACTIVE lease) or (202, QUEUED lease). Send an idempotency_key so retries are safe."""
        status, body = await self.request("POST", "/v1/leases", request)
        return status, body

    async def get_lease(self, lease_id: str) -> dict[str, Any]:
        """GET /v1/leases/{id}."""
        return dict((await self.request("GET", f"/v1/leases/{lease_id}"))[1])

    async def list_leases(self, states: list[str] | None = None) -> list[dict[str, Any]]:
        """GET /v1/leases (a guest token sees its own VM's leases)."""
        query = f"?state={','.join(states)}" if states else ""
        return list((await self.request("GET", f"/v1/leases{query}"))[1].get("leases", []))

    async def release(self, lease_id: str) -> tuple[int, dict[str, Any]]:
        """DELETE /v1/leases/{id}: (200, RELEASED) or (202, DETACH_PENDING)."""
        return await self.request("DELETE", f"/v1/leases/{lease_id}")

    async def renew(self, lease_id: str, duration_s: int | None = None) -> dict[str, Any]:
        """POST /v1/leases/{id}/renew."""
        body = {} if duration_s is None else {"duration_s": duration_s}
        return dict((await self.request("POST", f"/v1/leases/{lease_id}/renew", body))[1])

    async def heartbeat(self, lease_id: str, samples: list[dict[str, Any]], *, retries: int | None = None) -> dict[str, Any]:
        """POST /v1/leases/{id}/heartbeat with up to 1000 samples; the reply carries warnings and notices."""
        return dict((await self.request("POST", f"/v1/leases/{lease_id}/heartbeat", {"samples": samples},
                                        retries=retries))[1])


def _decode(raw: bytes) -> Any:
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return {"raw": raw.decode(errors="replace")[:500]}


def _error(status: int, payload: Any, retry_after: float | None) -> ApiError:
    """The server's error model, or a stand-in when something else (a proxy) answered."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return ApiError(status, str(err.get("code", "error")), str(err.get("message", "")), err.get("field"),
                        retry_after, payload)
    text = payload.get("raw", "") if isinstance(payload, dict) else str(payload)
    return ApiError(status, "http_error", text or "no error body (not the host agent?)", None, retry_after, payload)
