"""The libvirt adapter: one connection per process, libvirt events on the asyncio loop, blocking calls in threads.

This is the only module that catches `libvirt.libvirtError`; it re-raises NotFound (unknown domain),
HypervisorUnavailable (the connection is down) or HypervisorError (anything else, with libvirt's code and
message). A dropped connection is re-opened with backoff, callbacks are registered again, and subscribers get a
`reconnected` event so the services layer re-reads what it may have missed.

Deadlines: a blocking call runs in a worker thread, and a caller with a deadline stops waiting for it when the
deadline comes (a thread cannot be cancelled: libvirt finishes the call by itself, and its late result or error is
logged when it comes, never dropped). A detach runs under one deadline, its timeout, from lookup to final re-read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid as uuidlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import libvirt  # type: ignore[import-untyped]

from hostagent.domain.errors import HostAgentError, HypervisorError, HypervisorUnavailable, NotFound
from hostagent.domain.hostdev import HostdevPci, parse_domain_hostdevs
from hostagent.domain.pci import PciAddress
from hostagent.virt.libvirt_events import ensure_event_impl
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

# The final XML re-read of a detach may run this long past the detach's deadline (so a detach returns within
# timeout_s + _LAST_READ_S): a read that waits for no domain job answers in milliseconds, and without this slack a
# detach whose calls used up its whole budget would have only the events to go by, never the domain's XML.
_LAST_READ_S = 0.25


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


def _timed_out(exc: HostAgentError) -> bool:
    """True for the error `LibvirtHypervisor._call` raises when a call's deadline came before libvirt answered."""
    return bool(exc.details.get("timed_out"))


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
        # Detach sequences (the detach calls of one _detach, in order) that may outlive the detach that started them:
        # the newest per domain (the next one for that domain waits for it), and all of them (close() stops them).
        self._detach_tail: dict[str, asyncio.Task[None]] = {}
        self._detach_tasks: set[asyncio.Task[None]] = set()
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
        ensure_event_impl(loop)
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

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, deadline: float | None = None,
                    **details: Any) -> T:
        """Run a blocking libvirt call in a worker thread; translate its errors.

        `deadline` (the loop's clock, absolute; None: wait as long as libvirt takes): when it comes first, the
        caller stops waiting and gets HypervisorError with details `timed_out=True` (no call is started once the
        deadline has passed). The thread cannot be cancelled: libvirt finishes the call by itself, and its result
        or error is taken and logged when it comes (a connection error then still starts the reconnect). The same
        holds when the caller is cancelled while it waits.
        """
        loop = asyncio.get_running_loop()
        if deadline is not None and loop.time() >= deadline:
            raise HypervisorError(f"{what}: not started, its deadline had passed", timed_out=True, **details)
        generation, started = self._generation, loop.time()
        task = loop.create_task(asyncio.to_thread(fn, *args))
        late = functools.partial(self._late_answer, what, details, generation, started)
        try:
            await asyncio.wait({task}, timeout=None if deadline is None else max(0.0, deadline - started))
        except asyncio.CancelledError:
            task.add_done_callback(late)
            raise
        if not task.done():
            task.add_done_callback(late)
            raise HypervisorError(f"{what}: libvirt did not answer within {loop.time() - started:.1f}s (the call goes "
                                  "on in libvirt; its outcome is logged)", timed_out=True, **details)
        try:
            return task.result()
        except libvirt.libvirtError as exc:
            raise self._failed(exc, what, details, generation) from exc

    def _failed(self, exc: libvirt.libvirtError, what: str, details: dict[str, Any], generation: int) -> HostAgentError:
        """The project's error for a failed call; a lost connection starts the reconnect at once."""
        err = translate(exc, what, **details)
        if isinstance(err, HypervisorUnavailable) and self._conn is not None:
            # Do not wait for the close callback: start reconnecting now (unless it is a connection since replaced).
            self._connection_lost(generation, -1)
        return err

    def _late_answer(self, what: str, details: dict[str, Any], generation: int, started: float,
                     task: asyncio.Task[Any]) -> None:
        """Take the outcome of a call whose caller stopped waiting (runs on the loop when the thread is done)."""
        if task.cancelled():  # the loop is shutting down: its tasks are cancelled, the thread is not ours to wait for
            return
        took = asyncio.get_running_loop().time() - started
        exc = task.exception()
        if exc is None:
            log.info("%s: libvirt answered after %.1fs, after its caller had stopped waiting", what, took)
        elif isinstance(exc, libvirt.libvirtError):
            err = self._failed(exc, what, details, generation)
            log.warning("%s (after %.1fs, after its caller had stopped waiting)", err.message, took)
        else:
            log.error("%s: raised after %.1fs, after its caller had stopped waiting", what, took, exc_info=exc)

    async def _connection_by(self, deadline: float | None, what: str) -> Any:
        """The connection; with a deadline, stop waiting for a (re)connect still under way when it comes."""
        if deadline is None or self._conn is not None:
            return await self._connection()
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._connection())

        def late(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.info("%s: connecting to %s failed after its caller had stopped waiting: %s", what, self.uri,
                         t.exception())

        try:
            await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:
            task.add_done_callback(late)
            raise
        if not task.done():
            task.add_done_callback(late)
            raise HypervisorError(f"{what}: no connection to {self.uri} before the deadline", timed_out=True,
                                  uri=self.uri)
        return task.result()

    async def _lookup(self, name_or_uuid: str, *, deadline: float | None = None) -> Any:
        conn = await self._connection_by(deadline, f"looking up domain {name_or_uuid!r}")
        try:
            uid = str(uuidlib.UUID(name_or_uuid))
        except ValueError:
            return await self._call(f"looking up domain {name_or_uuid!r}", conn.lookupByName, name_or_uuid,
                                    deadline=deadline, domain=name_or_uuid)
        return await self._call(f"looking up domain {uid}", conn.lookupByUUIDString, uid, deadline=deadline,
                                domain=uid)

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
        """Attach live + persistent (running; live only where the persistent definition holds the device already)
        or persistent (shut off); verify in XML; undo on failure.

        The attach and its verification run without a deadline (the port gives none, and an attach whose outcome
        is unknown cannot be undone safely: one that lands after the undo would leave a device in the guest). The
        undo is a detach under `rollback_timeout_s`: what it could not confirm by then is in the error's details.
        """
        dom = await self._lookup(uuid)
        info = await self._call(f"reading domain {uuid}", _domain_info, dom, domain=uuid)
        live = info.state is not DomainState.SHUT_OFF and info.state is not DomainState.CRASHED
        flags = (libvirt.VIR_DOMAIN_AFFECT_LIVE if live else 0) | (
            libvirt.VIR_DOMAIN_AFFECT_CONFIG if info.persistent or not live else 0)
        defined: set[PciAddress] = set()
        if live and flags & libvirt.VIR_DOMAIN_AFFECT_CONFIG:
            # A device the persistent definition holds already (the guest let go of it live; a re-attach) goes in
            # live only: libvirt refuses a second copy in the definition (VIR_ERR_OPERATION_INVALID).
            xml = await self._call(f"reading XML of {info.name}", dom.XMLDesc, libvirt.VIR_DOMAIN_XML_INACTIVE,
                                   domain=info.name)
            defined = {h.source for h in parse_domain_hostdevs(xml)}
        done: list[HostdevPci] = []
        try:
            for hd in hostdevs:
                hd_flags = flags & ~libvirt.VIR_DOMAIN_AFFECT_CONFIG if hd.source in defined else flags
                await self._call(f"attaching {hd.source} to {info.name}", dom.attachDeviceFlags, hd.to_xml(),
                                 hd_flags, domain=info.name, address=str(hd.source))
                done.append(hd)
            await self._verify_attached(dom, info, hostdevs, live, flags)
        except HostAgentError as exc:
            if done and not isinstance(exc, (NotFound, HypervisorUnavailable)):
                by = asyncio.get_running_loop().time() + max(0.0, self.rollback_timeout_s)
                undo = await self._detach(dom, info, done, by, live, flags)
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
        """Detach; for a running domain wait for DEVICE_REMOVED of each hostdev.

        timeout_s bounds the whole detach, every libvirt call in it included (the lookup, the detach calls, the wait
        for the events, the final re-read; this returns within timeout_s + _LAST_READ_S). Running out of time is
        never an error here: what libvirt has not confirmed removed by then is in `pending`, and the detach calls
        go on in the background (see _detach).
        """
        deadline = asyncio.get_running_loop().time() + max(0.0, timeout_s)
        try:
            dom = await self._lookup(uuid, deadline=deadline)
            info = await self._call(f"reading domain {uuid}", _domain_info, dom, deadline=deadline, domain=uuid)
        except HypervisorError as exc:
            if not _timed_out(exc):
                raise
            return DetachResult(removed=(), pending=tuple(hostdevs), errors=(exc.message,))
        live = info.state is not DomainState.SHUT_OFF and info.state is not DomainState.CRASHED
        flags = (libvirt.VIR_DOMAIN_AFFECT_LIVE if live else 0) | (
            libvirt.VIR_DOMAIN_AFFECT_CONFIG if info.persistent or not live else 0)
        return await self._detach(dom, info, hostdevs, deadline, live, flags)

    async def _detach(self, dom: Any, info: DomainInfo, hostdevs: Sequence[HostdevPci], deadline: float,
                      live: bool, flags: int) -> DetachResult:
        """Detach `hostdevs` and wait for their removal until `deadline` (the loop's clock).

        libvirt's detachDeviceFlags itself blocks (the qemu driver waits up to 5 s per device for QEMU's
        DEVICE_DELETED), so the calls run, one after the other as libvirt wants them per domain, in a background task
        that this stops waiting for at the deadline. That task goes on: every hostdev asked for gets its request
        (its DEVICE_REMOVED then reaches the subscribers), outcomes that come after this returned are logged, and
        the next detach of the same domain sends its calls only after it. A hostdev is `removed` only when the final
        re-read of the domain XML shows it gone (or, if that read cannot finish within _LAST_READ_S past the
        deadline, when its DEVICE_REMOVED came, or its call returned for a device without a live part to wait for);
        every other one is `pending`. Running out of time raises nothing: NotFound and HypervisorUnavailable from a
        call answered in time do, as before.
        """
        loop = asyncio.get_running_loop()
        try:
            xml = await self._call(f"reading XML of {info.name}", dom.XMLDesc, 0, deadline=deadline, domain=info.name)
        except HypervisorError as exc:
            if not _timed_out(exc):
                raise
            return DetachResult(removed=(), pending=tuple(hostdevs), errors=(exc.message,))
        current = {h.source: h for h in parse_domain_hostdevs(xml)}
        plan: list[tuple[HostdevPci, HostdevPci | None, asyncio.Future[bool] | None]] = []
        for hd in hostdevs:
            attached = current.get(hd.source)
            fut: asyncio.Future[bool] | None = None
            if live and attached is not None and attached.alias:
                # Wait for the event before asking: DEVICE_REMOVED may arrive before detachDeviceFlags returns.
                fut = loop.create_future()
                self._waiters.setdefault((info.uuid, attached.alias), []).append(fut)
            plan.append((hd, attached, fut))
        errors: list[str] = []
        answered: set[int] = set()  # plan indexes whose detach call returned without an error that counts
        returned = False  # set when the result is built: later outcomes are logged instead
        prev = self._detach_tail.get(info.uuid)

        async def sequence() -> None:
            if prev is not None and not prev.done():
                await asyncio.wait({prev})  # the previous detach of this domain first: one call at a time
            for i, (hd, attached, _fut) in enumerate(plan):
                what = f"detaching {hd.source} from {info.name}"
                try:
                    # libvirt matches a hostdev by its source address; send what is in the domain when we know it.
                    # One not in the running domain (the guest let go of it) may still be in its persistent
                    # definition: that part alone, as libvirt refuses a LIVE|CONFIG detach missing either half.
                    hd_flags = flags & ~libvirt.VIR_DOMAIN_AFFECT_LIVE if live and attached is None else flags
                    await self._call(what, dom.detachDeviceFlags, (attached or hd).to_xml(), hd_flags,
                                     domain=info.name, address=str(hd.source))
                except (NotFound, HypervisorUnavailable) as exc:
                    if returned:
                        log.warning("%s (after the detach had returned)", exc.message)
                    raise  # the domain or the connection is gone: the rest would fail the same way
                except HypervisorError as exc:
                    if attached is not None or exc.details.get("libvirt_code") != libvirt.VIR_ERR_DEVICE_MISSING:
                        if returned:
                            log.warning("%s (after the detach had returned)", exc.message)
                        else:
                            errors.append(exc.message)
                        continue
                answered.add(i)
                if returned:
                    log.info("%s: libvirt answered after the detach had returned (its deadline had come)", what)

        seq = loop.create_task(sequence(), name=f"detach from {info.name}")
        self._detach_tail[info.uuid] = seq
        self._detach_tasks.add(seq)

        def sequence_done(task: asyncio.Task[None]) -> None:
            self._detach_tasks.discard(task)
            if self._detach_tail.get(info.uuid) is task:
                del self._detach_tail[info.uuid]
            # Taken here in any case (so asyncio has nothing "never retrieved" to report); before the result is
            # built the detach itself looks at it.
            exc = None if task.cancelled() else task.exception()
            if exc is not None and returned and not isinstance(exc, HostAgentError):  # those were logged above
                log.error("detach from %s failed after the detach had returned", info.name, exc_info=exc)

        seq.add_done_callback(sequence_done)

        def confirmed(i: int, f: asyncio.Future[bool] | None) -> bool:
            """By the events alone: DEVICE_REMOVED came (or, with nothing live to wait for, the call returned)."""
            if f is None:
                return i in answered
            return f.done() and not f.cancelled() and f.result()

        def settle() -> None:  # the result is being built (or the caller left): stop waiting for the events
            nonlocal returned
            returned = True
            for _hd, _attached, f in plan:
                if f is not None and not f.done():
                    f.cancel()
            self._prune_waiters()

        try:
            waiting: set[asyncio.Future[Any]] = {seq, *(f for _, _, f in plan if f is not None)}
            while waiting and loop.time() < deadline:
                _done, waiting = await asyncio.wait(waiting, timeout=deadline - loop.time(),
                                                    return_when=asyncio.FIRST_COMPLETED)
                if seq.done() and not seq.cancelled() and seq.exception() is not None:
                    break
            failure = seq.exception() if seq.done() and not seq.cancelled() else None
            if failure is not None:
                raise failure  # NotFound or HypervisorUnavailable (other libvirt errors are in `errors`)
            # Re-read: a device gone from the live XML is removed even if its event was missed (e.g. reconnecting).
            try:
                xml_now = await self._call(f"reading XML of {info.name}", dom.XMLDesc, 0,
                                           deadline=max(deadline, loop.time() + _LAST_READ_S), domain=info.name)
                still = {h.source for h in parse_domain_hostdevs(xml_now)}
            except NotFound:
                still = set()  # the domain is gone, and its devices with it
            except HostAgentError:  # the read failed or did not finish in time: go by what the events said
                still = {hd.source for i, (hd, _attached, f) in enumerate(plan) if not confirmed(i, f)}
        except BaseException:
            settle()
            raise
        if seq.done() and not seq.cancelled() and seq.exception() is not None:  # it stopped during the re-read
            errors.append(str(seq.exception()))
        removed: list[HostdevPci] = []
        pending: list[HostdevPci] = []
        for hd, _attached, _f in plan:
            (removed if hd.source not in still else pending).append(hd)
        settle()
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
        detaching = list(self._detach_tasks)
        for seq in detaching:
            seq.cancel()  # no further detach calls; one in flight finishes in its thread and is logged
        if detaching:
            await asyncio.wait(detaching)
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
