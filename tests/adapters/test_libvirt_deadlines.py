"""The libvirt adapter's deadlines hold even while libvirt's own calls block.

libvirt's qemu driver blocks in detachDeviceFlags until QEMU reports DEVICE_DELETED, up to 5 s a device
(qemuDomainWaitForDeviceRemoval), so a detach that awaited each call in turn overshot its timeout (10.09 s against
8 s). Here the domain object the adapter looks up is wrapped so that its calls first sleep, as the qemu driver does,
and then run libvirt's real call; nothing fake is in the adapter.

Two backends: libvirt's own `test:///default` driver (in process, no daemon; it has no device detach in this
libvirt, so its calls come back refused: the late *errors* must be logged, never lost) and the private libvirtd +
QEMU of tests/support/libvirtd.py (marked libvirtd), where a CONFIG detach of a shut-off domain really removes the
device: the calls that finish after the deadline must still take effect.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import time
import uuid as uuidlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libvirt
import pytest
import pytest_asyncio
from lxml import etree

from hostagent.domain.errors import HypervisorError
from hostagent.domain.hostdev import GuestPciAddress, HostdevPci, hostdevs_for_gpu, parse_domain_hostdevs
from hostagent.domain.pci import PciAddress
from hostagent.virt.libvirt_adapter import LibvirtHypervisor
from tests.support.libvirtd import PrivateLibvirtd, libvirtd, tiny_domain_xml  # noqa: F401 (libvirtd: a fixture)
from tests.support.waits import until

# libvirt binds its event implementation to one asyncio loop per process: every test here runs on the session's.
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(120)]

A = PciAddress.parse
THREE = [A(f"0000:3b:00.{i}") for i in range(3)]
SLOW_S = 2.0  # how long each wrapped detachDeviceFlags blocks before libvirt's real call
LOGGER = "hostagent.virt.libvirt"


# -- the slow domain --------------------------------------------------------------------------------------------
@dataclass
class Call:
    """One detachDeviceFlags the adapter made: the source address it named, when it began and ended."""

    address: str
    began: float
    ended: float | None = None


class SlowDomain:
    """A virDomain whose blocking calls first sleep (in the adapter's worker thread), then run libvirt's own."""

    def __init__(self, dom: Any, *, detach_s: float = 0.0, xml_s: float = 0.0) -> None:
        self._dom, self.detach_s, self.xml_s = dom, detach_s, xml_s
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dom, name)

    def detachDeviceFlags(self, xml: str, flags: int) -> int:  # noqa: N802 - libvirt's name
        call = Call(str(HostdevPci.from_xml(xml).source), time.monotonic())
        self.calls.append(call)
        try:
            time.sleep(self.detach_s)
            return int(self._dom.detachDeviceFlags(xml, flags))
        finally:
            call.ended = time.monotonic()

    def XMLDesc(self, flags: int) -> str:  # noqa: N802 - libvirt's name
        time.sleep(self.xml_s)
        return str(self._dom.XMLDesc(flags))


def slow_lookups(monkeypatch: pytest.MonkeyPatch, hv: LibvirtHypervisor, **slow: float) -> list[SlowDomain]:
    """From now on the adapter's domain lookups hand out SlowDomains (returned, in lookup order)."""
    real = hv._lookup
    made: list[SlowDomain] = []

    async def lookup(name_or_uuid: str, **kwargs: Any) -> SlowDomain:
        dom = SlowDomain(await real(name_or_uuid, **kwargs), **slow)
        made.append(dom)
        return dom

    monkeypatch.setattr(hv, "_lookup", lookup)
    return made


def assert_in_order(calls: list[Call]) -> None:
    """One detach call at a time: each began after the one before it had ended."""
    for before, after in itertools.pairwise(calls):
        assert before.ended is not None and after.began >= before.ended, calls


def late_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The adapter's log lines about outcomes that came after the detach had returned."""
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "after the detach had returned" in
            r.getMessage()]


@pytest_asyncio.fixture(loop_scope="session")
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the loop's exception handler during the test (e.g. "Future exception was never retrieved")."""
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    yield seen
    gc.collect()  # a future nobody retrieved reports itself when it is collected
    loop.set_exception_handler(before)


def assert_nothing_unretrieved(loop_errors: list[dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    gc.collect()
    assert not loop_errors, [ctx.get("message") for ctx in loop_errors]
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


# -- test:///default --------------------------------------------------------------------------------------------
class _NoKeepalive:
    """A connection whose setKeepAlive does nothing: in-process drivers (test:///) have no socket to keep alive
    and refuse the call, which the adapter (written for qemu:///system) treats as a failed connect."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def setKeepAlive(self, _interval: int, _count: int) -> int:  # noqa: N802 - libvirt's name
        return 0


class LocalDriverHypervisor(LibvirtHypervisor):
    """The adapter on libvirt's test:/// driver: the same code, registered without a keepalive."""

    def _register_callbacks(self, conn: Any, generation: int) -> list[int]:
        return super()._register_callbacks(_NoKeepalive(conn), generation)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def local_hv() -> AsyncIterator[LibvirtHypervisor]:
    asyncio.get_running_loop().set_debug(True)  # asyncio raises on loop calls from libvirt's threads: keep it on
    hv = LocalDriverHypervisor("test:///default")
    await hv.connect()
    yield hv
    await hv.close()


@pytest.fixture
def running_with_three() -> Iterator[tuple[str, tuple[HostdevPci, ...]]]:
    """A running test:/// domain whose live XML holds three of our hostdevs (aliases and all)."""
    hds = hostdevs_for_gpu(THREE, 0, 5)
    root = etree.Element("domain", type="test")
    etree.SubElement(root, "name").text = f"deadline-{uuidlib.uuid4().hex[:8]}"
    etree.SubElement(root, "memory", unit="MiB").text = "64"
    etree.SubElement(etree.SubElement(root, "os"), "type").text = "hvm"
    devices = etree.SubElement(root, "devices")
    for hd in hds:
        devices.append(hd.to_element())
    conn = libvirt.open("test:///default")  # the same in-process driver state as the adapter's connection
    dom = conn.defineXML(etree.tostring(root, encoding="unicode"))
    dom.create()
    assert parse_domain_hostdevs(dom.XMLDesc(0)) == hds
    yield dom.UUIDString(), hds
    dom.destroy()
    dom.undefine()
    conn.close()


async def test_detach_returns_at_its_deadline_while_libvirt_still_blocks(
        local_hv: LibvirtHypervisor, running_with_three: tuple[str, tuple[HostdevPci, ...]],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        loop_errors: list[dict[str, Any]]) -> None:
    """3 hostdevs, each detach call blocking 2 s, timeout 2.5 s: back in time with nothing claimed removed, and the
    calls still running then go on, in order, with their outcomes (here libvirt's refusal) logged."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    uid, hds = running_with_three
    made = slow_lookups(monkeypatch, local_hv, detach_s=SLOW_S)
    t0 = time.monotonic()
    result = await local_hv.detach_hostdevs(uid, hds, timeout_s=2.5)
    took = time.monotonic() - t0
    assert took < 3.0, f"detach took {took:.2f}s against a 2.5s timeout"
    (dom,) = made
    assert result.removed == () and result.pending == hds and not result.confirmed
    # The first call came back (refused: test:/// cannot detach devices) before the deadline; the second was in flight.
    assert len(result.errors) == 1 and "not supported" in result.errors[0], result.errors
    assert [c.address for c in dom.calls] == [str(a) for a in THREE[:2]]
    assert local_hv._waiters == {}  # nothing left waiting for a DEVICE_REMOVED
    # After the deadline: the second call ends, then the third is made (never two at once), and both outcomes are
    # taken and logged.
    await until(lambda: len(late_lines(caplog)) >= 2, 10.0, "the late outcomes logged")
    assert [c.address for c in dom.calls] == [str(a) for a in THREE]
    assert_in_order(dom.calls)
    lines = late_lines(caplog)
    assert all("not supported" in line for line in lines), lines
    assert [line.startswith(f"detaching {a} from {dom.name()}:") for a, line in zip(THREE[1:], lines, strict=True)] \
        == [True, True], lines
    # The last outcome is logged inside the sequence task; its done callback (which lets go of it) runs after.
    await until(lambda: not local_hv._detach_tasks, 5.0, "the finished detach sequence let go of")
    assert_nothing_unretrieved(loop_errors, caplog)


async def test_a_detach_whose_first_read_blocks_sends_nothing_and_is_back_in_time(
        local_hv: LibvirtHypervisor, running_with_three: tuple[str, tuple[HostdevPci, ...]],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        loop_errors: list[dict[str, Any]]) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    uid, hds = running_with_three
    made = slow_lookups(monkeypatch, local_hv, xml_s=2.0)
    t0 = time.monotonic()
    result = await local_hv.detach_hostdevs(uid, hds, timeout_s=0.5)
    took = time.monotonic() - t0
    assert took < 1.0, f"detach took {took:.2f}s against a 0.5s timeout"
    assert result.pending == hds and result.removed == ()
    assert len(result.errors) == 1 and "did not answer" in result.errors[0], result.errors
    assert made[0].calls == []  # no detach was asked for: nothing can come of it later
    await until(lambda: any("libvirt answered after" in r.getMessage() for r in caplog.records), 5.0,
                "the late XML read logged")
    assert_nothing_unretrieved(loop_errors, caplog)


async def test_a_call_past_its_deadline_raises_timed_out_and_its_late_error_is_logged(
        local_hv: LibvirtHypervisor, caplog: pytest.LogCaptureFixture, loop_errors: list[dict[str, Any]]) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    loop = asyncio.get_running_loop()

    def refused_late() -> None:
        time.sleep(0.6)
        exc = libvirt.libvirtError("operation failed: late refusal")
        exc.err = (libvirt.VIR_ERR_OPERATION_FAILED, libvirt.VIR_FROM_QEMU, "operation failed: late refusal",
                   libvirt.VIR_ERR_ERROR, None, None, None, -1, -1)
        raise exc

    t0 = time.monotonic()
    with pytest.raises(HypervisorError) as info:
        await local_hv._call("probing vm", refused_late, deadline=loop.time() + 0.2, domain="vm")
    assert time.monotonic() - t0 < 0.5
    assert info.value.details["timed_out"] is True and info.value.details["domain"] == "vm"
    started: list[int] = []
    with pytest.raises(HypervisorError) as info:  # no time left: the call is not even started
        await local_hv._call("probing vm", lambda: started.append(1), deadline=loop.time() - 1, domain="vm")
    assert info.value.details["timed_out"] is True and started == []
    await until(lambda: any("late refusal" in r.getMessage() for r in caplog.records), 5.0, "the late error logged")
    (rec,) = [r for r in caplog.records if "late refusal" in r.getMessage()]
    assert rec.levelno == logging.WARNING and rec.getMessage().startswith("probing vm: operation failed")
    assert "after its caller had stopped waiting" in rec.getMessage()
    assert local_hv.connected  # an ordinary libvirt error: the connection is left alone
    assert_nothing_unretrieved(loop_errors, caplog)


# -- a real libvirtd: the late calls take effect ------------------------------------------------------------------
@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def daemon_hv(libvirtd: PrivateLibvirtd) -> AsyncIterator[LibvirtHypervisor]:  # noqa: F811
    asyncio.get_running_loop().set_debug(True)
    hv = LibvirtHypervisor(libvirtd.uri, reconnect_initial_s=0.1, reconnect_max_s=0.5)
    await hv.connect()
    yield hv
    await hv.close()


@pytest.fixture
def shut_off(libvirtd: PrivateLibvirtd, tmp_path: Path) -> Iterator[str]:  # noqa: F811
    """A defined, shut-off q35 domain (CONFIG hostdevs need no IOMMU); undefined afterwards."""
    uid = str(uuidlib.uuid4())
    f = tmp_path / "vm.xml"
    f.write_text(tiny_domain_xml(f"deadline-{uid[:8]}", uuid=uid, root_ports=4))
    libvirtd.virsh("define", str(f))
    yield uid
    libvirtd.virsh("undefine", uid)


async def _config_hostdevs(hv: LibvirtHypervisor, uid: str) -> tuple[HostdevPci, ...]:
    return parse_domain_hostdevs(await hv.domain_xml(uid, live=False))


def three_on_root_ports() -> tuple[HostdevPci, ...]:
    """Three hostdevs, one per PCIe root port (bus 1..3, slot 0: a root port has one slot)."""
    return tuple(HostdevPci(a, GuestPciAddress(0, bus, 0, 0), alias=f"ua-hostagent-0000-3b-00-{a.function}")
                 for bus, a in enumerate(THREE, start=1))


@pytest.mark.libvirtd
async def test_slow_config_detach_is_back_at_its_deadline_and_finishes_after(
        daemon_hv: LibvirtHypervisor, shut_off: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, loop_errors: list[dict[str, Any]]) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    hds = three_on_root_ports()
    await daemon_hv.attach_hostdevs(shut_off, hds)
    assert await _config_hostdevs(daemon_hv, shut_off) == hds
    made = slow_lookups(monkeypatch, daemon_hv, detach_s=SLOW_S)
    t0 = time.monotonic()
    result = await daemon_hv.detach_hostdevs(shut_off, hds, timeout_s=2.5)
    took = time.monotonic() - t0
    assert took < 3.0, f"detach took {took:.2f}s against a 2.5s timeout"
    # The first call was done at 2 s (and the XML re-read shows it gone); the second was still in libvirt.
    assert result.removed == hds[:1] and result.pending == hds[1:] and result.errors == ()
    # Not lost: the call in flight and the one after it (made only then) take effect a few seconds later.
    await until(lambda: len(late_lines(caplog)) >= 2, 10.0, "the late answers logged")
    assert await _config_hostdevs(daemon_hv, shut_off) == ()
    dom = made[0]  # the detach's lookup (the XML read just now made another)
    assert [c.address for c in dom.calls] == [str(a) for a in THREE]
    assert_in_order(dom.calls)
    assert_nothing_unretrieved(loop_errors, caplog)


@pytest.mark.libvirtd
async def test_detach_without_slow_calls_reports_everything_removed(daemon_hv: LibvirtHypervisor,
                                                                     shut_off: str) -> None:
    hds = three_on_root_ports()
    await daemon_hv.attach_hostdevs(shut_off, hds)
    result = await daemon_hv.detach_hostdevs(shut_off, hds, timeout_s=2.5)
    assert result.removed == hds and result.pending == () and result.errors == () and result.confirmed
    assert await _config_hostdevs(daemon_hv, shut_off) == ()


@pytest.mark.libvirtd
async def test_attach_undo_honours_rollback_timeout(daemon_hv: LibvirtHypervisor, shut_off: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture,
                                                     loop_errors: list[dict[str, Any]]) -> None:
    """The second hostdev clashes with the first: the undo (a detach under rollback_timeout_s) runs out of time
    while libvirt blocks, so the attach fails on time saying the undo is unconfirmed; the undo still completes."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    good = HostdevPci(A("0000:3b:00.0"), GuestPciAddress(0, 1, 0, 0), alias="ua-hostagent-0000-3b-00-0")
    clash = HostdevPci(A("0000:5e:00.0"), GuestPciAddress(0, 1, 0, 0), alias="ua-hostagent-0000-5e-00-0")
    monkeypatch.setattr(daemon_hv, "rollback_timeout_s", 0.5)
    slow_lookups(monkeypatch, daemon_hv, detach_s=SLOW_S)
    t0 = time.monotonic()
    with pytest.raises(HypervisorError, match="double use of PCI Address") as info:
        await daemon_hv.attach_hostdevs(shut_off, [good, clash])
    took = time.monotonic() - t0
    assert took < 1.5, f"attach with its undo took {took:.2f}s against a 0.5s rollback timeout"
    assert info.value.details["rollback_confirmed"] is False
    assert info.value.details["rollback_pending"] == [str(good.source)]
    await until(lambda: len(late_lines(caplog)) >= 1, 10.0, "the late undo logged")
    assert await _config_hostdevs(daemon_hv, shut_off) == ()
    assert_nothing_unretrieved(loop_errors, caplog)
