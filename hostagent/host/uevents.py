"""The kernel's PCI uevents, as they happen: pyudev's netlink monitor on the `kernel` source (the kernel's own
broadcast, not udevd's re-broadcast), so it works on hosts without udevd and sees each event before any udev rule
runs. A driver bind or unbind, a device's removal (a `remove` through sysfs, a surprise removal, a GPU "fallen off
the bus") and its addition (a rescan, a hot-add) each arrive here within milliseconds.

`KernelUevents.start(deliver)` reads in a daemon thread and calls `deliver(action, address, driver, at)` for every
PCI event, `at` the time.monotonic() it arrived (within microseconds of the kernel sending it); `deliver` must be
thread-safe (the runtime posts it into its event loop). The fake kernel's source,
`host.fakekernel.FakeUevents`, has the same two methods.
"""

from __future__ import annotations

import collections
import logging
import re
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("hostagent.uevents")

ACTIONS = ("add", "remove", "bind", "unbind")  # what the agent acts on ("change" and the rest carry no driver news)


_DRIVER_WRITE = re.compile(r"^bus/pci/drivers/[^/]+/(bind|unbind)$")


def uevent_of(rel: str) -> str | None:
    """The uevent a successful write to this sysfs path makes the kernel send (None: none)."""
    if rel == "bus/pci/drivers_probe":
        return "bind"  # when the probe binds a driver; the writer withdraws it when none bound
    m = _DRIVER_WRITE.match(rel)
    return m.group(1) if m else None


@dataclass(eq=False)
class Expected:
    """One uevent the agent expects from its own write; `claimed` by the uevent taken for it (at its `at`)."""

    address: str
    action: str
    since: float
    claimed: tuple[str | None, float | None] | None = None  # (driver, at) of the uevent taken for it
    sent: bool = False  # the write returned having sent it


class OwnChanges:
    """The driver changes the agent is making itself, so that the watcher tells them from anyone else's exactly
    (by count, not by timing): the binder `expect`s a uevent before each write that sends one, and says when the
    write is `done`; the watcher `claim`s one expectation for each uevent it receives. A write that failed (or a
    probe that bound nothing) sent no uevent: if a uevent was claimed for it all the same, that uevent was someone
    else's (another writer's unbind completed just before the agent's own attempt, which then found nothing to
    unbind) and goes to `on_misclaimed` to be judged after all. An expectation never claimed lapses after TTL_S.
    Thread-safe."""

    TTL_S = 120.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], list[Expected]] = {}
        # (address, action, driver, at) of a uevent claimed for a write that turned out to send none
        self.on_misclaimed: Callable[[str, str, str | None, float | None], None] | None = None

    def expect(self, address: str, action: str) -> Expected:
        """The agent is about to make the kernel send `action` for `address`."""
        e = Expected(address, action, self._clock())
        with self._lock:
            self._pending.setdefault((address, action), []).append(e)
        return e

    def done(self, e: Expected, sent: bool) -> None:
        """The write returned: `sent` when it made the kernel send its uevent, False when it failed or bound
        nothing. A sent one stays expected until its uevent is claimed."""
        with self._lock:
            if sent and e.claimed is None:
                e.sent = True  # its uevent is still on its way: the claim takes it out
                return
            entries = self._pending.get((e.address, e.action), [])
            if e in entries:
                entries.remove(e)
            if not entries:
                self._pending.pop((e.address, e.action), None)
        if not sent and e.claimed is not None and self.on_misclaimed is not None:
            self.on_misclaimed(e.address, e.action, *e.claimed)

    def claim(self, address: str, action: str, at: float | None = None, driver: str | None = None) -> bool:
        """A uevent arrived (sent at `at` on this clock, when known): True when it is one the agent expected. An
        expectation made after the uevent was sent is not its."""
        with self._lock:
            entries = self._pending.get((address, action), [])
            now = self._clock()
            entries[:] = [e for e in entries if now - e.since <= self.TTL_S]
            for e in entries:
                if e.claimed is None and (at is None or e.since <= at):
                    e.claimed = (driver, at)
                    if e.sent:  # its write is done: nothing more will be said of it
                        entries.remove(e)
                        if not entries:
                            self._pending.pop((address, action), None)
                    return True
            if not entries:
                self._pending.pop((address, action), None)
            return False


class UeventsUnavailable(RuntimeError):
    """The netlink socket could not be opened (no pyudev or libudev, or no permission)."""


class KernelUevents:
    """PCI uevents from the running kernel (pyudev, netlink, `kernel` source)."""

    POLL_S = 0.5  # how often the reader looks at its stop flag between events

    description = "the kernel's PCI uevents (netlink)"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitor = None

    def start(self, deliver: Callable[[str, str, str | None, float], None]) -> None:
        """Open the netlink socket now (raises UeventsUnavailable) and read it in a thread."""
        try:
            import pyudev

            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
            monitor.filter_by("pci")
            monitor.start()
        except Exception as exc:  # ImportError, OSError (EPERM in a container), libudev missing
            raise UeventsUnavailable(f"cannot watch the kernel's uevents: {exc}") from exc
        self._monitor = monitor
        self._stop.clear()
        self._thread = threading.Thread(target=self._read, args=(monitor, deliver), name="uevents", daemon=True)
        self._thread.start()

    def _read(self, monitor: object, deliver: Callable[[str, str, str | None, float], None]) -> None:
        poller = select.poll()
        poller.register(monitor.fileno(), select.POLLIN)  # type: ignore[attr-defined]
        while not self._stop.is_set():
            if not poller.poll(self.POLL_S * 1000):
                continue
            try:
                device = monitor.poll(timeout=0)  # type: ignore[attr-defined]
            except Exception:  # a message libudev could not parse: skip it, keep reading
                log.exception("reading a uevent failed")
                continue
            if device is None or device.action not in ACTIONS:
                continue
            at = time.monotonic()
            driver = device.properties.get("DRIVER") if device.action in ("bind", "unbind") else None
            try:
                deliver(device.action, device.sys_name, driver, at)
            except Exception:
                log.exception("handling the uevent %s %s failed", device.action, device.sys_name)

    def stop(self) -> None:
        """Stop reading and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        self._monitor = None


__all__ = ["ACTIONS", "Expected", "KernelUevents", "OwnChanges", "UeventsUnavailable", "uevent_of"]
