"""Run the agent's web app: TLS or loopback-only plain HTTP, systemd notify (READY, STOPPING, WATCHDOG), and the
connection-level limits aiohttp leaves open: a deadline for the request head, an idle timeout, a connection cap, and
parser errors in the API's error model."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import ipaddress
import json
import logging
import os
import resource
import signal
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import (BadHttpMethod, BadStatusLine, HttpProcessingError, InvalidHeader, InvalidURLError,
                                     LineTooLong)
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from hostagent.config import AgentSettings, Settings
from hostagent.domain.errors import ConfigError
from hostagent.web.app import SERVER_HEADER, error_body, http_code
from hostagent.web.keys import SERVED

log = logging.getLogger("hostagent.serve")

SHED_GRACE_S = 1.0  # a connection answered 408/503 by the guard gets this long to read it before it is closed hard
CONNECTION_TARPIT_S = 1.0  # a connection refused for its address's share is answered after this long (see admit)
TARPIT_MAX = 16384  # refused connections waiting in one server's tarpit at most, whatever the fd limit allows
FD_RESERVE = 256  # file descriptors kept out of the tarpit's reach: the store, libvirt, sysfs, logs, worker threads
FD_LIMIT_WANTED = 65536  # `hostagent serve` raises its soft RLIMIT_NOFILE towards this (never past the hard limit)
CAP_LOG_INTERVAL_S = 60.0  # "connection cap reached" is logged at most this often (a flood would flood the log)


def sd_notify(message: str) -> bool:
    """Send one sd_notify message when running under systemd (NOTIFY_SOCKET set); False otherwise."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(path)
            s.sendall(message.encode())
        return True
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """TLS from agent.tls_cert/tls_key; refuse plain HTTP off loopback unless agent.allow_plain_http."""
    a = settings.agent
    if a.tls_cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(a.tls_cert, a.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"agent.tls_cert/tls_key: cannot load: {exc}", field="agent.tls_cert") from exc
        return ctx
    if not is_loopback(a.listen) and not a.allow_plain_http:
        raise ConfigError(
            f"agent.listen={a.listen} is not loopback and no TLS is configured: set agent.tls_cert and agent.tls_key, "
            "or agent.allow_plain_http = true if a trusted proxy terminates TLS", field="agent.listen",
        )
    return None


def _raw_response(status: int, message: str, *, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response in the API's error model, for a connection that has no request object to answer."""
    body = json.dumps(error_body(http_code(status), message)).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close", f"Server: {SERVER_HEADER}",
            f"Date: {email.utils.formatdate(usegmt=True)}"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def describe_parse_error(exc: BaseException | None, max_line: int, max_headers: int) -> tuple[int, str]:
    """Status and a fixed message for a request aiohttp's parser refused.

    aiohttp's own answer is text/plain with the parser's message, which quotes the offending input back (an over-long
    header's first 100 bytes, the bad request line); this says what was wrong without repeating any of it. The
    parser's text is only looked at to tell the cases apart, never sent.
    """
    text = (getattr(exc, "message", "") or "").partition(":")[0].lower()
    if isinstance(exc, LineTooLong):
        return 431, f"the request line or a header is longer than {max_line} bytes"
    if "too many headers" in text:
        return 431, f"more than {max_headers} headers"
    if isinstance(exc, BadHttpMethod):
        return 400, "malformed request line: unknown method (is this TLS or non-HTTP traffic?)"
    if isinstance(exc, InvalidURLError):
        return 400, "malformed request line: invalid URL"
    if isinstance(exc, BadStatusLine):
        return 400, "malformed request line: expected METHOD /path HTTP/1.1"
    if "content-length" in text:
        return 400, "invalid Content-Length header"
    if "content-encoding" in text:
        return 400, "unsupported or invalid Content-Encoding"
    if "transfer-encoding" in text or "chunk" in text:
        return 400, "invalid Transfer-Encoding header or chunked body"
    if "host" in text:
        return 400, "an HTTP/1.1 request needs one Host header"
    if isinstance(exc, InvalidHeader) or "header" in text:
        return 400, "malformed header"
    return 400, "malformed HTTP request"


def source_of(transport: asyncio.BaseTransport) -> str:
    """The client address a connection counts against (agent.max_connections_per_source): the peer's IP."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"


def _refusal(status: int) -> str:
    return ("too many connections to the agent; retry shortly" if status == 503 else
            "too many connections from your address; close some, or retry shortly")


def fd_limit() -> int:
    """The process's soft limit on open file descriptors."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit(wanted: int = FD_LIMIT_WANTED) -> int:
    """Raise the soft RLIMIT_NOFILE to `wanted` (at most the hard limit; never lowered) and return the soft limit
    now in force. A server's tarpit holds one descriptor per refused connection (see tarpit_bound): the default
    soft limit of 1024 would leave it little room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def tarpit_bound(agent: AgentSettings, nofile: int) -> int:
    """How many refused connections one server may hold in its tarpit, given the soft fd limit `nofile`: half of
    what is left after FD_RESERVE, less the admitted connections (the API's listener and the metrics listener each
    get this much), at most TARPIT_MAX. A refusal past the bound is answered at once, and a client that reconnects
    the moment it is answered costs the agent thousands of accepts a second, so the bound is as large as the
    descriptors allow."""
    room = (nofile - FD_RESERVE) // 2 - agent.max_connections
    return max(0, min(TARPIT_MAX, room))


class GuardedServer(web.Server):
    """aiohttp's low-level server, making GuardedRequestHandler connections and counting them against the caps:
    agent.max_connections in all, agent.max_connections_per_source from one client address (so one client cannot
    hold the connections every other tenant needs)."""

    def __init__(self, handler: Any, *, agent: AgentSettings, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.agent = agent
        self.refused = 0  # connections refused because the agent was full (503)
        self.refused_source = 0  # connections refused because their address held its share (429)
        self.per_source: dict[str, int] = {}  # open connections by client address
        self.tarpitted = 0  # refused connections waiting CONNECTION_TARPIT_S for their 429 (at most tarpit_bound)
        self.tarpit_bound = tarpit_bound(agent, fd_limit())
        self._cap_logged_at = -CAP_LOG_INTERVAL_S
        self._source_logged_at = -CAP_LOG_INTERVAL_S

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, agent=self.agent, **self._kwargs)

    def admit(self, source: str) -> int | None:
        """Count a new connection from `source` against the caps: None when admitted (then `release(source)` when
        it ends), else the status to refuse it with (503: the agent is full; 429: this address holds its share)."""
        now = time.monotonic()
        if len(self._connections) >= self.agent.max_connections:
            self.refused += 1
            if now - self._cap_logged_at >= CAP_LOG_INTERVAL_S:
                self._cap_logged_at = now
                log.warning("connection cap reached (agent.max_connections=%d): refusing new connections with 503 "
                            "(%d refused so far)", self.agent.max_connections, self.refused)
            return 503
        if self.per_source.get(source, 0) >= self.agent.max_connections_per_source:
            self.refused_source += 1
            if now - self._source_logged_at >= CAP_LOG_INTERVAL_S:
                self._source_logged_at = now
                log.warning("%s holds agent.max_connections_per_source=%d connections: refusing its new ones with "
                            "429 (%d refused so far)", source, self.agent.max_connections_per_source,
                            self.refused_source)
            return 429
        self.per_source[source] = self.per_source.get(source, 0) + 1
        return None

    def release(self, source: str) -> None:
        """A connection admitted for `source` ended."""
        left = self.per_source.get(source, 0) - 1
        if left > 0:
            self.per_source[source] = left
        else:
            self.per_source.pop(source, None)


class GuardedRequestHandler(RequestHandler):
    """One HTTP connection: aiohttp's protocol plus the limits it lacks.

    A slow body is bounded where the handler reads it (read_json's body_timeout_s), but aiohttp has no deadline for
    the request head: a client sending its headers a byte at a time held a connection for as long as aiohttp's
    keep-alive timer (an hour by default). Here the head has its own deadline: header_timeout_s from connect for
    the first request, and from the first byte of each later one; before that byte, a keep-alive connection may
    idle for idle_timeout_s (aiohttp's keep-alive timer, which closes it silently). A head begun while the previous
    request was still being handled (pipelining, which no client of the agent does) is bounded by that idle timer.
    A connection over agent.max_connections is answered 503 before anything is parsed, one over
    agent.max_connections_per_source from its address 429 (after CONNECTION_TARPIT_S). Both answers are written in
    the API's JSON error model, then the write side is shut and the client given SHED_GRACE_S to read it: closing
    at once, with its bytes unread, would reset the connection and could lose the answer.

    Relies on aiohttp's handler internals (_waiter, _request_count, _messages, _current_request, _manager, _loop)
    as of aiohttp 3.14.
    """

    def __init__(self, manager: GuardedServer, *, loop: asyncio.AbstractEventLoop, agent: AgentSettings,
                 **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._agent = agent
        self._head_timer: asyncio.TimerHandle | None = None
        self._shed_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._tarpit = False  # refused, its 429 not yet written (CONNECTION_TARPIT_S)
        self._source: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        source = source_of(transport)
        status = cast(GuardedServer, self._manager).admit(source)
        if status is not None:
            self._refused = True  # never registered with the server, never parsed: it does not count against a cap
            server = cast(GuardedServer, self._manager)
            if status == 429 and server.tarpitted < server.tarpit_bound:
                # A client over its address's share that reconnects the moment it is answered would make the agent
                # accept and refuse thousands of connections a second, costing the other tenants as much as serving
                # them: its 429 waits CONNECTION_TARPIT_S (a timer costs nothing), so it reconnects at most once a
                # second per connection it tries to hold. The waiting connections are bounded by the descriptors
                # the process may open (tarpit_bound); past that they are answered at once.
                server.tarpitted += 1
                self._tarpit = True
                self._shed_timer = self._loop.call_later(CONNECTION_TARPIT_S, self._tarpit_done,
                                                         cast(asyncio.Transport, transport))
                return
            self._shed(cast(asyncio.Transport, transport), status, _refusal(status), retry_after=1)
            return
        self._source = source
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a head arrived (or a parse error, answered by handle_error)
            self._cancel_head_timer()
            self._fail_body_being_read()
        elif data and self._head_timer is None and self._waiter is not None and not self._waiter.done():
            self._arm_head_timer()  # the first byte of a request on an idle keep-alive connection

    def _fail_body_being_read(self) -> None:
        """A parse error in the body of the request being handled (a bad chunk size) is queued by aiohttp as if it were
        the next request, and the handler's read waits for body bytes that will never come: a 408 body_timeout_s
        later. Hand the error to the body being read instead, so read_json answers 400 at once."""
        request = self._current_request
        if request is None or request.content.is_eof() or not self._messages:
            return
        exc = getattr(self._messages[-1][0], "exc", None)  # an aiohttp _ErrInfo, not a RawRequestMessage
        if isinstance(exc, HttpProcessingError):
            request.content.set_exception(exc)

    def _tarpit_done(self, transport: asyncio.Transport) -> None:
        self._shed_timer = None
        self._leave_tarpit()
        if not transport.is_closing():
            self._shed(transport, 429, _refusal(429), retry_after=1)

    def _leave_tarpit(self) -> None:
        if self._tarpit:
            self._tarpit = False
            cast(GuardedServer, self._manager).tarpitted -= 1

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        self._leave_tarpit()
        if self._shed_timer is not None:
            self._shed_timer.cancel()
            self._shed_timer = None
        if self._refused:
            return  # nothing of aiohttp's was set up for it
        if self._source is not None:
            cast(GuardedServer, self._manager).release(self._source)
            self._source = None
        # After answering a request whose body it never read (a 401, a 429), aiohttp lingers up to lingering_time
        # (10 s) reading the rest, and a client that hangs up does not end that read: the connection then counted
        # against agent.max_connections for 10 s with nobody on it, and a client opening such requests and closing
        # them filled the cap for everyone. With no request being handled, nothing is lost by ending the task now.
        task = self._task_handler
        idle = self._current_request is None and task is not None and not task.done()
        super().connection_lost(exc)
        if idle and task is not None:
            task.cancel()

    def _arm_head_timer(self) -> None:
        self._head_timer = self._loop.call_later(self._agent.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport
        if transport is None or self._force_close or self._close:
            return
        log.debug("request head from %s incomplete after %.1f s: 408", transport.get_extra_info("peername"),
                  self._agent.header_timeout_s)
        self.close()  # parse nothing more; the handler's loop, waiting for this head, ends
        self._shed(cast(asyncio.Transport, transport), 408,
                   f"the request line and headers did not arrive within {self._agent.header_timeout_s:g} s")

    def _shed(self, transport: asyncio.Transport, status: int, message: str, *, retry_after: int | None = None) -> None:
        """Answer and hang up, letting the client read the answer (closing on its EOF, or after SHED_GRACE_S)."""
        transport.write(_raw_response(status, message, retry_after=retry_after))
        if transport.can_write_eof():
            transport.write_eof()
            self._shed_timer = self._loop.call_later(SHED_GRACE_S, transport.close)
        else:  # TLS: no half-close; close() still sends what was written first
            transport.close()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The API's error model for what never reached the app: parser errors, and failures outside its middleware.

        aiohttp's version answers text/plain with the parser's message (which quotes the input) and logs a client's
        malformed request as an exception with a traceback; a bad request is the client's problem, logged at debug.
        """
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent in part; cannot send the error")
        if status >= 500:
            log.error("error handling %s %s", request.method, request.path, exc_info=exc)
            text = "the request took too long" if status == 504 else "internal error; see the agent's log"
        else:
            log.debug("malformed request from %s: %s", request.remote, type(exc).__name__)
            status, text = describe_parse_error(exc, max(self.max_line_size, self.max_field_size), self.max_headers)
        resp = web.json_response(error_body(http_code(status), text), status=status,
                                 headers={"Server": SERVER_HEADER})
        resp.force_close()
        return resp


class AgentRunner(web.AppRunner):
    """The app runner serve() uses (and tests of the served limits): GuardedServer with the agent's limits."""

    __slots__ = ("_agent",)

    def __init__(self, app: web.Application, agent: AgentSettings, **kwargs: Any) -> None:
        kwargs.setdefault("access_log", None)
        super().__init__(app, handle_signals=False, keepalive_timeout=agent.idle_timeout_s, **kwargs)
        self._agent = agent

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts the app; the Server it builds only lends its arguments
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation, loop=plain._loop,  # noqa: SLF001
                             agent=self._agent, **plain._kwargs)  # noqa: SLF001


async def start_server(app: web.Application, settings: Settings,
                       ctx: ssl.SSLContext | None = None) -> tuple[web.AppRunner, str]:
    """Start the app (its lifecycle included) on agent.listen:agent.port with the agent's connection limits; return
    the runner (cleanup() stops it) and the bound URL."""
    return await _start(app, settings.agent, settings.agent.listen, settings.agent.port, ctx)


async def start_metrics_server(app: web.Application, settings: Settings) -> tuple[web.AppRunner, str] | None:
    """With agent.metrics_listen set, serve the agent app's metrics there (plain HTTP, no token, the same connection
    limits); None when it is not set (/metrics is then on the API's port, behind the operator's token)."""
    if not settings.agent.metrics_listen:
        return None
    from hostagent.config import metrics_address
    from hostagent.web.metrics import METRICS, listener_app

    host, port = metrics_address(settings.agent.metrics_listen)
    runner, url = await _start(listener_app(app[METRICS]), settings.agent, host, port, None)
    return runner, url + "/metrics"


async def _start(app: web.Application, agent: AgentSettings, listen: str, port: int,
                 ctx: ssl.SSLContext | None) -> tuple[web.AppRunner, str]:
    runner = AgentRunner(app, agent)
    await runner.setup()
    try:
        site = web.TCPSite(runner, listen, port, ssl_context=ctx)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    sockets = site._server.sockets if site._server else []  # noqa: SLF001 - the bound port for port=0
    bound = sockets[0].getsockname()[1] if sockets else port
    host = listen if ":" not in listen else f"[{listen}]"
    return runner, f"{'https' if ctx else 'http'}://{host}:{bound}"


async def _watchdog(app: web.Application) -> AsyncIterator[None]:
    """Ping systemd's watchdog from the event loop (a stuck loop stops the pings)."""
    usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    task = None
    if usec:
        async def ping() -> None:
            while True:
                sd_notify("WATCHDOG=1")
                await asyncio.sleep(usec / 2e6)

        task = asyncio.create_task(ping())
    sd_notify("READY=1\nSTATUS=serving")
    yield
    sd_notify("STOPPING=1")
    if task:
        task.cancel()


def serve(settings: Settings, make_app: Callable[[], web.Application], *, banner: str | None = None,
          on_serving: Callable[[str], Awaitable[None]] | None = None) -> int:
    """Serve the app `make_app` builds until SIGTERM/SIGINT; print the bound URL (and a banner) once listening.
    The composition root passes the factory (:func:`hostagent.runtime.serve`): this module never builds the agent.
    `on_serving(url)` runs as a task once the agent listens (the demo's guests) and is cancelled, and awaited, at
    the stop before the agent itself stops."""
    from hostagent.host.memory import limit_arenas
    from hostagent.logs import setup_logging

    setup_logging(settings.agent.log_format, settings.agent.log_level)
    limit_arenas()  # before any worker thread exists: see hostagent.host.memory
    nofile = raise_fd_limit()
    log.info("open-file limit %d: up to %d refused connections wait in the tarpit", nofile,
             tarpit_bound(settings.agent, nofile))
    ctx = ssl_context(settings)
    try:
        asyncio.run(_serve(settings, make_app, ctx, banner, on_serving))
    except KeyboardInterrupt:
        pass
    return 0


async def _serve(settings: Settings, make_app: Callable[[], web.Application], ctx: ssl.SSLContext | None,
                 banner: str | None, on_serving: Callable[[str], Awaitable[None]] | None = None) -> None:
    app = make_app()
    app.cleanup_ctx.append(_watchdog)
    runner, url = await start_server(app, settings, ctx)
    if SERVED in app:
        app[SERVED](url)  # the agent's own link to itself (the fleet page's), port 0 resolved
    try:
        scrape = await start_metrics_server(app, settings)
    except BaseException:
        await runner.cleanup()
        raise
    if banner:
        print(banner.replace("{url}", url), flush=True)
    print(f"hostagent: serving on {url}", flush=True)
    log.info("serving on %s", url)
    if scrape is not None:
        print(f"hostagent: metrics on {scrape[1]}", flush=True)
        log.info("metrics on %s", scrape[1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    companion = asyncio.create_task(on_serving(url)) if on_serving is not None else None
    try:
        await stop.wait()
    finally:
        if companion is not None:
            companion.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await companion
        if scrape is not None:
            await scrape[0].cleanup()
        await runner.cleanup()
