"""HTTP client of the host agent's lease API, with retries, backoff and one clear error per refusal."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import ssl
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import aiohttp

from hostagent.guest.errors import ApiError, HostUnreachable

log = logging.getLogger("hostagent.guest.client")

RETRY_STATUSES = frozenset({429, 502, 503, 504})  # 429: this tenant asked for more than its share; wait


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


class HostClient:
    """The lease API as coroutines; one aiohttp session per client (use `async with`)."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0, retries: int = 4, backoff_max_s: float = 30.0,
                 ssl: ssl.SSLContext | bool = True, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_max_s = backoff_max_s
        self._ssl = ssl
        self._sleep = sleep
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HostClient:
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self._token}", "User-Agent": "hostagent-guest"},
            timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds before retry `attempt` (0-based): the server's Retry-After, else capped exponential with jitter."""
        if retry_after is not None:
            return min(retry_after, self.backoff_max_s)
        return float(min(self.backoff_max_s, 0.5 * 2.0 ** attempt) * random.uniform(0.5, 1.0))

    async def request(self, method: str, path: str, body: Any = None, *, retries: int | None = None) -> tuple[int, Any]:
        """Send one API call; retry connection failures and 429/502/503/504; raise ApiError / HostUnreachable."""
        if self._session is None:
            raise RuntimeError("HostClient used outside `async with`")
        retries = self.retries if retries is None else retries
        url = self.url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        attempt = 0
        while True:
            try:
                async with self._session.request(method, url, data=data, headers=headers, ssl=self._ssl) as resp:
                    raw = await resp.read()
                    status = resp.status
                    retry_after = _retry_after(resp.headers.get("Retry-After"))
            except aiohttp.ClientConnectorError as exc:
                failure = f"cannot connect to the host agent at {self.url}: {exc.os_error.strerror or exc}"
                if isinstance(exc.os_error, ConnectionRefusedError):
                    failure = f"connection refused by {self.url}: is the host agent running and listening there?"
            except aiohttp.ClientSSLError as exc:  # a certificate problem does not heal by retrying
                raise HostUnreachable(f"TLS handshake with {self.url} failed: {exc} (see ca_file / --ca-file)") from None
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failure = f"no answer from the host agent at {self.url}: {type(exc).__name__} {exc}".rstrip()
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
