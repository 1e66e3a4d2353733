"""libvirt's events on the agent's asyncio loop: libvirtaio's implementation made safe for calls from libvirt's
worker threads, registered once per process (see LibvirtHypervisor, the only user)."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import Any

import libvirt  # type: ignore[import-untyped]
import libvirtaio  # type: ignore[import-untyped]

from hostagent.domain.errors import HypervisorError


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


def ensure_event_impl(loop: asyncio.AbstractEventLoop) -> None:
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
