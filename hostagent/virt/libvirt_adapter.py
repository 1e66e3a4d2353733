"""The libvirt adapter: one connection per process, libvirt events on the asyncio loop, blocking calls in threads.

This is the only module that catches `libvirt.libvirtError`; it re-raises NotFound (unknown domain),
HypervisorUnavailable (the connection is down) or HypervisorError (anything else, with libvirt's code and
message). A dropped connection is re-opened with backoff, callbacks are registered again, and subscribers get a
`reconnected` event so the services layer re-reads what it may have missed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import uuid as uuidlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import libvirt  # type: ignore[import-untyped]
import libvirtaio  # type: ignore[import-untyped]

from hostagent.domain.errors import HostAgentError, HypervisorError, HypervisorUnavailable, NotFound
from hostagent.domain.hostdev import HostdevPci, parse_domain_hostdevs
from hostagent.virt.port import DetachResult, DomainEvent, DomainInfo, DomainState, EventCallback, EventKind

log = logging.getLogger("hostagent.virt.libvirt")

T = TypeVar("T")

_CONNECTION_CODES = frozenset({
    libvirt.VIR_ERR_NO_CONNECT, libvirt.VIR_ERR_INVALID_CONN, libvirt.VIR_ERR_RPC, libvirt.VIR_ERR_AUTH_FAILED,
    libvirt.VIR_ERR_AUTH_UNAVAILABLE,
})
_STATES = {
    libvirt.VIR_DOMAIN_RUNNING: DomainState.RUNNING,
    libvirt.VIR_DOMAIN_BLOCKED: DomainState.RUNNING,
    libvirt.VIR_DOMAIN_SHUTDOWN: DomainState.RUNNING,  # shutting down: the guest still holds its devices
    libvirt.VIR_DOMAIN_PAUSED: DomainState.PAUSED,
    libvirt.VIR_DOMAIN_PMSUSPENDED: DomainState.PAUSED,
    libvirt.VIR_DOMAIN_SHUTOFF: DomainState.SHUT_OFF,
    libvirt.VIR_DOMAIN_NOSTATE: DomainState.SHUT_OFF,
    libvirt.VIR_DOMAIN_CRASHED: DomainState.CRASHED,
}


# -- event loop integration -------------------------------------------------------------------------------------
class _ThreadSafeAsyncIOImpl(libvirtaio.virEventAsyncIOImpl):  # type: ignore[misc]
    """libvirtaio's implementation, safe to call from worker threads.

    libvirt calls the event implementation from whichever thread runs its client code: a thread blocked in an
    RPC reads incoming event messages and re-arms the dispatch timer from there. libvirtaio touches the asyncio
    loop directly, which is only safe on the loop's thread (asyncio debug mode raises). Here ids are allocated
    at once and the loop-side work is queued, in call order, to the loop thread. Never block the calling
    thread waiting for the loop: libvirt holds its client lock while it calls us, and the loop thread may be
    waiting for that same lock inside a libvirt callback.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._ops: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._ops_lock = threading.Lock()

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        with self._ops_lock:
            self._ops.append((fn, args))
        if here:
            self._drain_ops()
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._drain_ops)

    def _drain_ops(self) -> None:
        while True:
            with self._ops_lock:
                if not self._ops:
                    return
                fn, args = self._ops.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("libvirt event loop operation failed")

    def _add_handle(self, fd: int, event: int, cb: Any, opaque: Any) -> int:
        callback = libvirtaio.FDCallback(self, cb, opaque, descriptor=None, event=event)
        self.callbacks[callback.iden] = callback
        self._on_loop(self._install_handle, fd, callback)
        return int(callback.iden)

    def _install_handle(self, fd: int, callback: Any) -> None:
        self._pending_inc()
        callback.descriptor = self.descriptors[fd]
        callback.descriptor.add_handle(callback)

    def _update_handle(self, watch: int, event: int) -> None:
        callback = self.callbacks.get(watch)
        if callback is not None:
            self._on_loop(callback.update, event)

    def _remove_handle(self, watch: int) -> int:
        callback = self.callbacks.pop(watch, None)
        if callback is None:
            return -1
        self._on_loop(self._uninstall_handle, callback)
        return 0

    def _uninstall_handle(self, callback: Any) -> None:
        fd = callback.descriptor.fd
        self.descriptors[fd].remove_handle(callback.iden)
        if not self.descriptors[fd].callbacks:
            del self.descriptors[fd]
        callback.close()

    def _add_timeout(self, timeout: int, cb: Any, opaque: Any) -> int:
        callback = libvirtaio.TimeoutCallback(self, cb, opaque)
        self.callbacks[callback.iden] = callback
        self._on_loop(self._install_timeout, callback, timeout)
        return int(callback.iden)

    def _install_timeout(self, callback: Any, timeout: int) -> None:
        self._pending_inc()
        callback.update(timeout=timeout)

    def _update_timeout(self, timer: int, timeout: int) -> None:
        callback = self.callbacks.get(timer)
        if callback is not None:
            self._on_loop(callback.update, timeout)

    def _remove_timeout(self, timer: int) -> int:
        callback = self.callbacks.pop(timer, None)
        if callback is None:
            return -1
        self._on_loop(callback.close)
        return 0


_impl_lock = threading.Lock()


def _ensure_event_impl(loop: asyncio.AbstractEventLoop) -> None:
    """Register libvirt's asyncio event implementation once per process, before any connection is opened."""
    with _impl_lock:
        current = libvirtaio.getCurrentImpl()
        if current is None:
            # libvirt prints every error to stderr by default; we raise them as our own errors instead.
            libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
            impl = _ThreadSafeAsyncIOImpl(loop).register()
            libvirtaio._current_impl = impl  # so getCurrentImpl() reports the one libvirt calls
            return
        if current.loop is not loop:
            # libvirt accepts one event implementation per process, bound to one loop for good.
            raise HypervisorError("libvirt events are bound to another asyncio event loop in this process",
                                  field="libvirt")


# -- error translation ------------------------------------------------------------------------------------------
def _is_connection_error(exc: libvirt.libvirtError) -> bool:
    code, domain = exc.get_error_code(), exc.get_error_domain()
    return code in _CONNECTION_CODES or (
        code == libvirt.VIR_ERR_SYSTEM_ERROR and domain in (libvirt.VIR_FROM_RPC, libvirt.VIR_FROM_REMOTE)
    )


def translate(exc: libvirt.libvirtError, what: str, **details: Any) -> HostAgentError:
    """The project's error for a libvirt error raised while doing `what`."""
    code = exc.get_error_code()
    message = exc.get_error_message() or str(exc)
    fields = {"libvirt_code": code, "libvirt_domain": exc.get_error_domain(), **details}
    if code == libvirt.VIR_ERR_NO_DOMAIN:
        return NotFound(f"{what}: no such domain ({message})", field="domain", **fields)
    if _is_connection_error(exc):
        return HypervisorUnavailable(f"{what}: libvirt connection unavailable: {message}", **fields)
    return HypervisorError(f"{what}: {message} (libvirt error {code})", **fields)


def probe(uri: str) -> str | None:
    """Open and close a connection to `uri`: None when libvirt answers, else what went wrong (for doctor)."""
    try:
        conn = libvirt.open(uri)
    except libvirt.libvirtError as exc:
        return f"cannot connect to {uri}: {exc.get_error_message() or exc}"
    try:
        conn.getLibVersion()
        return None
    except libvirt.libvirtError as exc:
        return f"{uri} answered but failed: {exc.get_error_message() or exc}"
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            conn.close()


def _domain_info(dom: Any) -> DomainInfo:
    """Blocking: name, UUID, state and persistence of a virDomain."""
    state, _reason = dom.state()
    return DomainInfo(dom.name(), dom.UUIDString(), _STATES.get(state, DomainState.SHUT_OFF),
                      bool(dom.isPersistent()))


class LibvirtHypervisor:
    """The Hypervisor port over libvirt: one connection, events on the asyncio loop, reconnect with backoff."""

    def __init__(self, uri: str, *, reconnect_initial_s: float = 0.5, reconnect_max_s: float = 30.0,
                 keepalive_interval_s: int = 5, keepalive_count: int = 3, rollback_timeout_s: float = 10.0) -> None:
        self.uri = uri
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.keepalive_interval_s = keepalive_interval_s
        self.keepalive_count = keepalive_count
        self.rollback_timeout_s = rollback_timeout_s
        self._conn: Any = None
        self._generation = 0
        self._callback_ids: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._subscribers: list[EventCallback] = []
        self._waiters: dict[tuple[str, str], list[asyncio.Future[bool]]] = {}
        self._reconnect_task: asyncio.Task[None] | None = None
        self._had_connection = False
        self._closed = False

    # -- connection ----------------------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """True while a connection is open."""
        return self._conn is not None

    async def connect(self) -> None:
        """Open the connection now (otherwise the first call opens it); HypervisorUnavailable on failure."""
        await self._connection()

    async def _connection(self) -> Any:
        if self._closed:
            raise HypervisorUnavailable("the libvirt adapter is closed", uri=self.uri)
        conn = self._conn
        if conn is not None:
            return conn
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._conn is None:
                await self._open()
        return self._conn

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        _ensure_event_impl(loop)
        self._loop = loop
        try:
            conn = await asyncio.to_thread(libvirt.open, self.uri)
        except libvirt.libvirtError as exc:
            raise HypervisorUnavailable(f"cannot connect to {self.uri}: {exc.get_error_message() or exc}",
                                        uri=self.uri, libvirt_code=exc.get_error_code()) from exc
        generation = self._generation + 1
        try:
            ids = await asyncio.to_thread(self._register_callbacks, conn, generation)
        except libvirt.libvirtError as exc:
            with contextlib.suppress(libvirt.libvirtError):
                await asyncio.to_thread(conn.close)
            raise translate(exc, f"registering event callbacks on {self.uri}", uri=self.uri) from exc
        self._conn, self._generation, self._callback_ids = conn, generation, ids
        log.info("connected to %s", self.uri)
        if self._had_connection:
            self._emit(DomainEvent("", "", EventKind.RECONNECTED, self.uri))
        self._had_connection = True

    def _register_callbacks(self, conn: Any, generation: int) -> list[int]:
        """Blocking: keepalive (so a hung daemon is noticed), close callback, domain event callbacks."""
        conn.setKeepAlive(self.keepalive_interval_s, self.keepalive_count)
        conn.registerCloseCallback(self._on_close, generation)
        return [
            conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._on_lifecycle, None),
            conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED, self._on_device_removed,
                                        None),
            conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVAL_FAILED,
                                        self._on_device_removal_failed, None),
        ]

    def _on_close(self, _conn: Any, reason: int, generation: int) -> None:
        # libvirt may call this from a worker thread (the one whose RPC saw the socket close).
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._connection_lost, generation, reason)

    def _connection_lost(self, generation: int, reason: int) -> None:
        if generation != self._generation or self._conn is None or self._closed:
            return  # a stale notice about a connection already replaced
        log.warning("libvirt connection to %s lost (reason %d); reconnecting", self.uri, reason)
        self._conn, self._callback_ids = None, []
        self._emit(DomainEvent("", "", EventKind.DISCONNECTED, f"close reason {reason}"))
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.ensure_future(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        delay = self.reconnect_initial_s
        while not self._closed and self._conn is None:
            try:
                await self._connection()
                return
            except HypervisorUnavailable as exc:
                log.info("reconnect to %s failed (%s); next try in %.1fs", self.uri, exc.message, delay)
            except HostAgentError as exc:
                log.warning("reconnect to %s failed: %s", self.uri, exc.message)
            await asyncio.sleep(delay)
            delay = min(self.reconnect_max_s, delay * 2)

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **details: Any) -> T:
        """Run a blocking libvirt call in a thread; translate its errors."""
        try:
            return await asyncio.to_thread(fn, *args)
        except libvirt.libvirtError as exc:
            err = translate(exc, what, **details)
            if isinstance(err, HypervisorUnavailable) and self._conn is not None:
                # Do not wait for the close callback: start reconnecting now.
                self._connection_lost(self._generation, -1)
            raise err from exc

    async def _lookup(self, name_or_uuid: str) -> Any:
        conn = await self._connection()
        try:
            uid = str(uuidlib.UUID(name_or_uuid))
        except ValueError:
            return await self._call(f"looking up domain {name_or_uuid!r}", conn.lookupByName, name_or_uuid,
                                    domain=name_or_uuid)
        return await self._call(f"looking up domain {uid}", conn.lookupByUUIDString, uid, domain=uid)

    # -- the port ------------------------------------------------------------------------------------------------
    async def list_domains(self) -> list[DomainInfo]:
        """Every domain, running or not."""
        conn = await self._connection()

        def collect() -> list[DomainInfo]:
            out = []
            for dom in conn.listAllDomains(0):
                try:
                    out.append(_domain_info(dom))
                except libvirt.libvirtError as exc:
                    if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:  # undefined meanwhile: skip it
                        raise
            return out

        return await self._call("listing domains", collect)

    async def get_domain(self, name_or_uuid: str) -> DomainInfo:
        """One domain by name or UUID; NotFound when unknown."""
        dom = await self._lookup(name_or_uuid)
        return await self._call(f"reading domain {name_or_uuid}", _domain_info, dom, domain=name_or_uuid)

    async def domain_xml(self, uuid: str, live: bool = True) -> str:
        """The live XML (running domain) or the persistent (inactive) XML."""
        dom = await self._lookup(uuid)
        flags = 0 if live else libvirt.VIR_DOMAIN_XML_INACTIVE
        return await self._call(f"reading XML of {uuid}", dom.XMLDesc, flags, domain=uuid)

    async def attached_hostdevs(self, uuid: str) -> tuple[HostdevPci, ...]:
        """PCI hostdevs in the domain now (live XML when running, else persistent XML)."""
        return parse_domain_hostdevs(await self.domain_xml(uuid, live=True))

    async def attach_hostdevs(self, uuid: str, hostdevs: Sequence[HostdevPci]) -> None:
        """Attach live + persistent (running) or persistent (shut off); verify in XML; undo on failure."""
        dom = await self._lookup(uuid)
        info = await self._call(f"reading domain {uuid}", _domain_info, dom, domain=uuid)
        live = info.state is not DomainState.SHUT_OFF and info.state is not DomainState.CRASHED
        flags = (libvirt.VIR_DOMAIN_AFFECT_LIVE if live else 0) | (
            libvirt.VIR_DOMAIN_AFFECT_CONFIG if info.persistent or not live else 0)
        done: list[HostdevPci] = []
        try:
            for hd in hostdevs:
                await self._call(f"attaching {hd.source} to {info.name}", dom.attachDeviceFlags, hd.to_xml(), flags,
                                 domain=info.name, address=str(hd.source))
                done.append(hd)
            await self._verify_attached(dom, info, hostdevs, live, flags)
        except HostAgentError as exc:
            if done and not isinstance(exc, (NotFound, HypervisorUnavailable)):
                undo = await self._detach(dom, info, done, self.rollback_timeout_s, live, flags)
                exc.details["rollback_confirmed"] = undo.confirmed
                if not undo.confirmed:
                    exc.details["rollback_pending"] = [str(h.source) for h in undo.pending]
                    log.error("attach to %s failed and %d hostdev(s) could not be removed again",
                              info.name, len(undo.pending))
            raise

    async def _verify_attached(self, dom: Any, info: DomainInfo, hostdevs: Sequence[HostdevPci], live: bool,
                               flags: int) -> None:
        views = []
        if live:
            views.append(("live", 0))
        if flags & libvirt.VIR_DOMAIN_AFFECT_CONFIG:
            views.append(("persistent", libvirt.VIR_DOMAIN_XML_INACTIVE))
        for view, xml_flags in views:
            xml = await self._call(f"reading XML of {info.name}", dom.XMLDesc, xml_flags, domain=info.name)
            present = {h.source: h for h in parse_domain_hostdevs(xml)}
            missing = [str(hd.source) for hd in hostdevs
                       if hd.source not in present or (hd.guest is not None and present[hd.source].guest != hd.guest)]
            if missing:
                raise HypervisorError(f"libvirt accepted the attach but the {view} XML of {info.name} lacks {missing}",
                                      domain=info.name, missing=missing)

    async def detach_hostdevs(self, uuid: str, hostdevs: Sequence[HostdevPci], timeout_s: float) -> DetachResult:
        """Detach; for a running domain wait up to timeout_s for DEVICE_REMOVED of each hostdev."""
        dom = await self._lookup(uuid)
        info = await self._call(f"reading domain {uuid}", _domain_info, dom, domain=uuid)
        live = info.state is not DomainState.SHUT_OFF and info.state is not DomainState.CRASHED
        flags = (libvirt.VIR_DOMAIN_AFFECT_LIVE if live else 0) | (
            libvirt.VIR_DOMAIN_AFFECT_CONFIG if info.persistent or not live else 0)
        return await self._detach(dom, info, hostdevs, timeout_s, live, flags)

    async def _detach(self, dom: Any, info: DomainInfo, hostdevs: Sequence[HostdevPci], timeout_s: float,
                      live: bool, flags: int) -> DetachResult:
        loop = asyncio.get_running_loop()
        # timeout_s bounds the whole detach: libvirt itself blocks up to ~5 s per unacknowledged device.
        deadline = loop.time() + max(0.0, timeout_s)
        xml = await self._call(f"reading XML of {info.name}", dom.XMLDesc, 0, domain=info.name)
        current = {h.source: h for h in parse_domain_hostdevs(xml)}
        errors: list[str] = []
        waits: list[tuple[HostdevPci, asyncio.Future[bool] | None]] = []
        for hd in hostdevs:
            attached = current.get(hd.source)
            fut: asyncio.Future[bool] | None = None
            if live and attached is not None and attached.alias:
                # Wait for the event before asking: DEVICE_REMOVED may arrive before detachDeviceFlags returns.
                fut = loop.create_future()
                self._waiters.setdefault((info.uuid, attached.alias), []).append(fut)
            try:
                # libvirt matches a hostdev by its source address; send what is in the domain when we know it.
                await self._call(f"detaching {hd.source} from {info.name}", dom.detachDeviceFlags,
                                 (attached or hd).to_xml(), flags, domain=info.name, address=str(hd.source))
            except (NotFound, HypervisorUnavailable):
                if fut is not None:
                    fut.cancel()
                    self._prune_waiters()
                raise
            except HypervisorError as exc:
                if attached is not None or exc.details.get("libvirt_code") != libvirt.VIR_ERR_DEVICE_MISSING:
                    errors.append(exc.message)
            waits.append((hd, fut))
        futures = [f for _, f in waits if f is not None]
        if futures:
            await asyncio.wait(futures, timeout=max(0.0, deadline - loop.time()))
        # Re-read: a device gone from the live XML is removed even if its event was missed (e.g. reconnecting).
        try:
            xml_now = await self._call(f"reading XML of {info.name}", dom.XMLDesc, 0, domain=info.name)
            still = {h.source for h in parse_domain_hostdevs(xml_now)}
        except NotFound:
            still = set()  # the domain is gone, and its devices with it
        except HostAgentError:
            still = {hd.source for hd, f in waits if f is not None and not (f.done() and not f.cancelled() and f.result())}
        removed: list[HostdevPci] = []
        pending: list[HostdevPci] = []
        for hd, fut in waits:
            if fut is not None and not fut.done():
                fut.cancel()
            (removed if hd.source not in still else pending).append(hd)
        self._prune_waiters()
        return DetachResult(removed=tuple(removed), pending=tuple(pending), errors=tuple(errors))

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Call `callback` on the event loop for every DomainEvent; returns an unsubscribe function."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    async def close(self) -> None:
        """Stop reconnecting, deregister callbacks and close the connection."""
        self._closed = True
        task, self._reconnect_task = self._reconnect_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        conn, ids = self._conn, self._callback_ids
        self._conn, self._callback_ids = None, []
        if conn is None:
            return

        def shut() -> None:
            with contextlib.suppress(libvirt.libvirtError):
                for cid in ids:
                    conn.domainEventDeregisterAny(cid)
                conn.unregisterCloseCallback()
            with contextlib.suppress(libvirt.libvirtError):
                conn.close()

        await asyncio.to_thread(shut)
        for futs in self._waiters.values():
            for f in futs:
                f.cancel()
        self._waiters.clear()

    # -- libvirt callbacks (run on the event loop) ---------------------------------------------------------------
    def _on_lifecycle(self, _conn: Any, dom: Any, event: int, detail: int, _opaque: Any) -> None:
        kind = None
        if event == libvirt.VIR_DOMAIN_EVENT_STARTED:
            kind = EventKind.STARTED
        elif event == libvirt.VIR_DOMAIN_EVENT_STOPPED:
            kind = EventKind.CRASHED if detail == libvirt.VIR_DOMAIN_EVENT_STOPPED_CRASHED else EventKind.STOPPED
        elif event == libvirt.VIR_DOMAIN_EVENT_CRASHED:
            kind = EventKind.CRASHED
        elif event == libvirt.VIR_DOMAIN_EVENT_UNDEFINED:
            kind = EventKind.UNDEFINED
        elif event == libvirt.VIR_DOMAIN_EVENT_DEFINED:
            kind = EventKind.DEFINED
        if kind is None:
            return
        uuid = dom.UUIDString()
        if kind in (EventKind.STOPPED, EventKind.CRASHED):
            # The devices left with the guest: any detach still waiting is done.
            for key in [k for k in self._waiters if k[0] == uuid]:
                self._resolve(key, True)
        self._emit(DomainEvent(uuid, dom.name(), kind, str(detail)))

    def _on_device_removed(self, _conn: Any, dom: Any, alias: str, _opaque: Any) -> None:
        uuid = dom.UUIDString()
        self._resolve((uuid, alias), True)
        self._emit(DomainEvent(uuid, dom.name(), EventKind.DEVICE_REMOVED, alias))

    def _on_device_removal_failed(self, _conn: Any, dom: Any, alias: str, _opaque: Any) -> None:
        uuid = dom.UUIDString()
        self._resolve((uuid, alias), False)
        self._emit(DomainEvent(uuid, dom.name(), EventKind.DEVICE_REMOVAL_FAILED, alias))

    def _resolve(self, key: tuple[str, str], value: bool) -> None:
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(value)

    def _prune_waiters(self) -> None:
        for key in [k for k, futs in self._waiters.items() if all(f.done() for f in futs)]:
            del self._waiters[key]

    def _emit(self, event: DomainEvent) -> None:
        for cb in list(self._subscribers):
            try:
                cb(event)
            except Exception:
                log.exception("event subscriber failed on %s", event.kind.value)
