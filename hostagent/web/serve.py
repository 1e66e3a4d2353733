"""Run the agent's web app: TLS or loopback-only plain HTTP, systemd notify (READY, STOPPING, WATCHDOG)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
import ssl
from collections.abc import AsyncIterator

from aiohttp import web

from hostagent.config import Settings
from hostagent.domain.errors import ConfigError

log = logging.getLogger("hostagent.serve")


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


def serve(settings: Settings, *, banner: str | None = None) -> int:
    """Build the runtime and serve until SIGTERM/SIGINT; print the bound URL (and a banner) once listening."""
    from hostagent.host.memory import limit_arenas
    from hostagent.logs import setup_logging

    setup_logging(settings.agent.log_format, settings.agent.log_level)
    limit_arenas()  # before any worker thread exists: see hostagent.host.memory
    ctx = ssl_context(settings)
    try:
        asyncio.run(_serve(settings, ctx, banner))
    except KeyboardInterrupt:
        pass
    return 0


async def _serve(settings: Settings, ctx: ssl.SSLContext | None, banner: str | None) -> None:
    from hostagent.runtime import build_runtime, make_app

    runtime = build_runtime(settings)
    app = make_app(runtime)
    app.cleanup_ctx.append(_watchdog)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, settings.agent.listen, settings.agent.port, ssl_context=ctx)
    await site.start()
    sockets = site._server.sockets if site._server else []  # noqa: SLF001 - the bound port for port=0
    port = sockets[0].getsockname()[1] if sockets else settings.agent.port
    host = settings.agent.listen if ":" not in settings.agent.listen else f"[{settings.agent.listen}]"
    url = f"{'https' if ctx else 'http'}://{host}:{port}"
    if banner:
        print(banner.replace("{url}", url), flush=True)
    print(f"hostagent: serving on {url}", flush=True)
    log.info("serving on %s", url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
