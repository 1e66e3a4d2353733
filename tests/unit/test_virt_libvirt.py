"""libvirt adapter pieces that need no daemon: error translation and the thread-safe event implementation."""

from __future__ import annotations

import asyncio
import socket
import threading

import libvirt
import pytest

from hostagent.domain.errors import HypervisorError, HypervisorUnavailable, NotFound
from hostagent.virt.libvirt_adapter import translate
from hostagent.virt.libvirt_events import _ThreadSafeAsyncIOImpl


def _error(code: int, domain: int, message: str) -> libvirt.libvirtError:
    exc = libvirt.libvirtError(message)
    exc.err = (code, domain, message, libvirt.VIR_ERR_ERROR, None, None, None, -1, -1)
    return exc


def test_translation_of_libvirt_errors() -> None:
    nf = translate(_error(libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_FROM_QEMU, "Domain not found"), "looking up vm",
                   domain="vm")
    assert isinstance(nf, NotFound) and nf.field == "domain" and nf.details["domain"] == "vm"
    for code, dom in ((libvirt.VIR_ERR_NO_CONNECT, libvirt.VIR_FROM_NONE),
                      (libvirt.VIR_ERR_INVALID_CONN, libvirt.VIR_FROM_NONE),
                      (libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_FROM_RPC)):
        err = translate(_error(code, dom, "client socket is closed"), "listing")
        assert isinstance(err, HypervisorUnavailable) and err.retryable
    other = translate(_error(libvirt.VIR_ERR_CONFIG_UNSUPPORTED, libvirt.VIR_FROM_QEMU,
                             "host doesn't support VFIO PCI passthrough"), "attaching 0000:3b:00.0")
    assert type(other) is HypervisorError
    assert "VFIO" in other.message and other.details["libvirt_code"] == libvirt.VIR_ERR_CONFIG_UNSUPPORTED
    # A local system error (not the connection) stays a plain HypervisorError.
    assert type(translate(_error(libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_FROM_QEMU, "EPERM"), "x")) is HypervisorError


async def test_event_impl_runs_thread_calls_on_the_loop_in_order() -> None:
    loop = asyncio.get_running_loop()
    was_debug = loop.get_debug()
    loop.set_debug(True)  # debug mode raises on loop calls from other threads: the case being guarded
    impl = _ThreadSafeAsyncIOImpl(loop)
    fired: list[tuple[str, bool]] = []
    done = asyncio.Event()
    on_loop = threading.get_ident()
    freed: list[tuple[object, bool]] = []
    # libvirt's free callback expects its own opaque objects; record the call (and its thread) instead.
    impl.schedule_ff_callback = lambda _iden, opaque: freed.append((opaque, threading.get_ident() == on_loop))

    def timer_cb(_iden: int, opaque: str) -> None:
        fired.append((opaque, threading.get_ident() == on_loop))
        done.set()

    a, b = socket.socketpair()
    try:
        def from_worker() -> tuple[int, int, int]:
            never = impl._add_timeout(-1, timer_cb, "never")
            soon = impl._add_timeout(-1, timer_cb, "soon")
            impl._update_timeout(soon, 0)  # queued after its add: must not be lost or reordered
            impl._remove_timeout(never)
            watch = impl._add_handle(a.fileno(), libvirt.VIR_EVENT_HANDLE_READABLE, handle_cb, "fd")
            return never, soon, watch

        def handle_cb(_watch: int, _fd: int, _events: int, opaque: str) -> None:
            fired.append((opaque, threading.get_ident() == on_loop))
            a.recv(16)
            done.set()

        _never, soon, watch = await asyncio.to_thread(from_worker)
        await asyncio.wait_for(done.wait(), 5)
        done.clear()
        b.send(b"x")
        await asyncio.wait_for(done.wait(), 5)
        assert fired[0] == ("soon", True) and ("fd", True) in fired
        assert all(name != "never" for name, _ in fired)
        await asyncio.to_thread(impl._remove_handle, watch)
        await asyncio.to_thread(impl._remove_timeout, soon)
        await asyncio.sleep(0.05)
        assert a.fileno() not in impl.descriptors
        assert impl._remove_timeout(soon) == -1
        assert sorted(freed, key=str) == [("fd", True), ("never", True), ("soon", True)]
    finally:
        loop.set_debug(was_debug)
        a.close()
        b.close()


def test_the_adapter_needs_no_connection_to_be_built() -> None:
    from hostagent.virt.libvirt_adapter import LibvirtHypervisor

    hv = LibvirtHypervisor("qemu:///system")
    assert not hv.connected


@pytest.mark.parametrize("state,expected", [(libvirt.VIR_DOMAIN_RUNNING, "running"),
                                            (libvirt.VIR_DOMAIN_SHUTOFF, "shut-off"),
                                            (libvirt.VIR_DOMAIN_PAUSED, "paused"),
                                            (libvirt.VIR_DOMAIN_CRASHED, "crashed")])
def test_domain_state_mapping(state: int, expected: str) -> None:
    from hostagent.virt.libvirt_adapter import _domain_info

    class Dom:
        def state(self) -> list[int]:
            return [state, 0]

        def name(self) -> str:
            return "vm"

        def UUIDString(self) -> str:  # noqa: N802 - libvirt's name
            return "u"

        def isPersistent(self) -> int:  # noqa: N802 - libvirt's name
            return 1

    assert _domain_info(Dom()).state == expected
