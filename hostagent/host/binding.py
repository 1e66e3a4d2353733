"""Move a whole IOMMU group to vfio-pci and back, as named steps with postcondition checks and rollback.

The model is driverctl's set_override: unbind, write driver_override, write the address to drivers_probe, then
READ BACK the driver link. `new_id` is never used (it would grab every device with the same ids). Any write that
can hang runs in a worker thread with a timeout. A failed bind undoes what it did, in reverse; a group never stays
half on vfio-pci.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hostagent.domain.errors import HostError, StepTimeout
from hostagent.domain.hostops import HostOpResult, Step
from hostagent.domain.inventory import IommuGroup
from hostagent.domain.pci import PciAddress
from hostagent.host.sysfs import Sysfs
from hostagent.host.uevents import OwnChanges, uevent_of

log = logging.getLogger("hostagent.host.binding")

VFIO_PCI = "vfio-pci"
ANY_HOST_DRIVER = "*"  # give-back target meaning 'whatever host driver the kernel probes'
VFIO_MODULES = ("vfio_pci", "vfio_iommu_type1")

OnStep = Callable[[str, str], None]


BindResult = HostOpResult  # the name the binder and its tests use


class _Failed(Exception):
    """A forward step failed; carries the message for the result."""


def modprobe(name: str) -> None:
    """Load a kernel module on a real host."""
    try:
        subprocess.run(["modprobe", name], check=True, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise HostError(f"modprobe not found while loading {name}", module=name) from exc
    except subprocess.CalledProcessError as exc:
        raise HostError(f"modprobe {name} failed: {exc.stderr.strip() or exc.returncode}", module=name) from exc
    except subprocess.TimeoutExpired as exc:
        raise StepTimeout(f"modprobe {name} did not return in 30 s", module=name) from exc


class VfioBinder:
    """Binds IOMMU groups to vfio-pci and gives them back, through sysfs (real or fake kernel)."""

    def __init__(self, sysfs: Sysfs, dev_root: str | os.PathLike[str] = "/dev", step_timeout_s: float = 10.0,
                 journal: Callable[[Step], None] | None = None,
                 load_module: Callable[[str], None] | None = None, vfio_node_wait_s: float = 2.0,
                 own: OwnChanges | None = None) -> None:
        self.sysfs = sysfs
        self.own = own  # the uevents this binder's writes make the kernel send, for the out-of-band watcher
        self.dev_root = Path(dev_root)
        self.step_timeout_s = step_timeout_s
        self.journal = journal
        # The fake kernel loads modules itself; a real host runs modprobe.
        self.load_module = load_module or getattr(sysfs, "load_module", None) or modprobe
        self.vfio_node_wait_s = vfio_node_wait_s
        # address -> (the step whose write hung, the worker thread still inside it): no operation touches the device
        # until that write has returned
        self._hung: dict[str, tuple[str, threading.Thread]] = {}

    @property
    def stuck(self) -> dict[str, str]:
        """address -> the step whose write hung and has not returned yet."""
        return {addr: step for addr, (step, _) in self._hung.items()}

    def _stuck_error(self, addrs: list[str]) -> str | None:
        """Why these functions cannot be touched now (one is inside a hung write), or None.

        Marks of hung writes that have since returned are dropped first. The mark guards a device while a write may
        still land on it; once the write returned, the device's state is whatever sysfs reads back, like after a
        restart (the mark lives only in memory). Keeping the device out of placement until an operator looks is the
        lease service's quarantine (journaled), not this mark: were the mark kept until the agent restarts, an
        operator's clear of the quarantine would leave a GPU that looks free but fails, and is quarantined again, at
        every grant.
        """
        for addr, entry in list(self._hung.items()):
            if not entry[1].is_alive() and self._hung.pop(addr, None) is entry:  # one caller settles it (threads)
                log.warning("hung %s of %s has returned; the device is on %s now", entry[0], addr,
                            self.driver_of(addr) or "no driver")
        stuck = [a for a in addrs if a in self._hung]
        return f"{stuck[0]} is stuck after a hung {self._hung[stuck[0]][0]}; needs attention" if stuck else None

    # -- reading ------------------------------------------------------------------------------------------------
    def driver_of(self, address: PciAddress | str) -> str | None:
        """The driver bound to a device now (None when unbound)."""
        return self.sysfs.read_link(f"bus/pci/devices/{address}/driver")

    def override_of(self, address: PciAddress | str) -> str | None:
        """driver_override now (None when '(null)')."""
        text = self.sysfs.read_str(f"bus/pci/devices/{address}/driver_override")
        return None if text in (None, "", "(null)") else text

    def vfio_node(self, group: int) -> Path:
        """/dev/vfio/<group>."""
        return self.dev_root / "vfio" / str(group)

    # -- plans (touch nothing) ----------------------------------------------------------------------------------
    def plan_bind(self, group: IommuGroup) -> list[str]:
        """The steps bind_group would take, as human lines, without touching anything."""
        lines = []
        if not self.sysfs.exists(f"bus/pci/drivers/{VFIO_PCI}"):
            lines.append(f"load modules {', '.join(VFIO_MODULES)}")
        for addr in group.addresses:
            drv = self.driver_of(addr)
            if drv == VFIO_PCI:
                lines.append(f"{addr}: already on vfio-pci, leave it")
                continue
            if drv is not None:
                lines.append(f"{addr}: unbind from {drv} (echo {addr} > bus/pci/drivers/{drv}/unbind)")
            lines.append(f"{addr}: echo vfio-pci > bus/pci/devices/{addr}/driver_override")
            lines.append(f"{addr}: echo {addr} > bus/pci/drivers_probe")
            lines.append(f"{addr}: read back bus/pci/devices/{addr}/driver, expect vfio-pci")
        lines.append(f"check {self.vfio_node(group.number)} exists")
        return lines

    def plan_release(self, group: IommuGroup, original_drivers: Mapping[Any, str | None]) -> list[str]:
        """The steps release_group would take, as human lines, without touching anything."""
        original = {str(k): v for k, v in original_drivers.items()}
        lines = []
        for addr in group.addresses:
            if self.driver_of(addr) == VFIO_PCI:
                lines.append(f"{addr}: unbind from vfio-pci (echo {addr} > bus/pci/drivers/vfio-pci/unbind)")
        for addr in group.addresses:
            want = original.get(str(addr), ANY_HOST_DRIVER)
            lines.append(f"{addr}: clear driver_override (echo > bus/pci/devices/{addr}/driver_override)")
            if want is None:
                lines.append(f"{addr}: leave unbound (it had no driver)")
            else:
                lines.append(f"{addr}: echo {addr} > bus/pci/drivers_probe")
                lines.append(f"{addr}: read back driver, expect {'any host driver' if want == ANY_HOST_DRIVER else want}")
        return lines

    # -- bind ---------------------------------------------------------------------------------------------------
    def bind_group(self, group: IommuGroup, on_step: OnStep | None = None) -> BindResult:
        """Move every non-bridge function of the group to vfio-pci; undo everything on any failure."""
        run = _Run(self, on_step)
        addrs = [str(a) for a in group.addresses]
        original = {a: self.driver_of(a) for a in addrs}
        if not addrs:
            return BindResult(False, error=f"group {group.number} has no function to bind", original_drivers=original)
        stuck = self._stuck_error(addrs)
        if stuck:
            return BindResult(False, error=stuck, needs_attention=True, original_drivers=original)
        try:
            self._ensure_modules(run)
            for addr in addrs:
                drv = original[addr]
                if drv == VFIO_PCI:
                    continue  # already there (a retry after a crash): keep it, nothing to undo
                if drv is not None:
                    run.do("unbind", addr, lambda a=addr, d=drv: self._write(run, "unbind", a, f"bus/pci/drivers/{d}/unbind", a),
                           check=lambda a=addr: self.driver_of(a) is None,
                           undo=lambda a=addr, d=drv: self._restore_host(run, a, d))
                run.do("override", addr,
                       lambda a=addr: self._write(run, "override", a, f"bus/pci/devices/{a}/driver_override", VFIO_PCI),
                       check=lambda a=addr: self.override_of(a) == VFIO_PCI,
                       undo=lambda a=addr: self._clear_override(run, a))
                run.do("probe", addr, lambda a=addr: self._write(run, "probe", a, "bus/pci/drivers_probe", a),
                       check=None, undo=lambda a=addr: self._leave_vfio(run, a))
                run.do("read-back", addr, lambda: None,
                       check=lambda a=addr: self.driver_of(a) == VFIO_PCI,
                       explain=lambda a=addr: f"{a} is bound to {self.driver_of(a) or 'no driver'}, not vfio-pci")
            run.do("vfio-node", str(group.number), lambda: None, check=lambda: self._wait_node(group.number),
                   explain=lambda: f"{self.vfio_node(group.number)} did not appear")
        except (_Failed, HostError) as exc:
            message = exc.message if isinstance(exc, HostError) else str(exc)
            run.rollback()
            return BindResult(False, tuple(run.steps), f"{run.stopped_at}: {message}",
                              needs_attention=run.undo_failed or run.hung, drivers=self._drivers(addrs),
                              original_drivers=original, stopped_at=run.stopped_at)
        return BindResult(True, tuple(run.steps), drivers=self._drivers(addrs), original_drivers=original)

    # -- give back ----------------------------------------------------------------------------------------------
    def release_group(self, group: IommuGroup, original_drivers: Mapping[Any, str | None],
                      on_step: OnStep | None = None) -> BindResult:
        """Give every function back to its original driver ('*' = any host driver, None = leave unbound).

        Phase 1 takes every function off vfio-pci, all or none (a refusal re-binds the ones already taken off,
        so the group stays whole on vfio-pci). Phase 2 returns each function to its host driver, best effort:
        a function that does not come back is reported and the group needs attention.
        """
        run = _Run(self, on_step)
        addrs = [str(a) for a in group.addresses]
        original = {str(k): v for k, v in original_drivers.items()}
        stuck = self._stuck_error(addrs)
        if stuck:
            return BindResult(False, error=stuck, needs_attention=True, original_drivers=original,
                              drivers=self._drivers(addrs))
        try:
            for addr in addrs:
                if self.driver_of(addr) == VFIO_PCI:
                    run.do("unbind-vfio", addr,
                           lambda a=addr: self._write(run, "unbind-vfio", a, f"bus/pci/drivers/{VFIO_PCI}/unbind", a),
                           check=lambda a=addr: self.driver_of(a) is None,
                           undo=lambda a=addr: self._back_to_vfio(run, a))
        except (_Failed, HostError) as exc:
            message = exc.message if isinstance(exc, HostError) else str(exc)
            run.rollback()
            return BindResult(False, tuple(run.steps), f"{run.stopped_at}: {message}",
                              needs_attention=run.undo_failed or run.hung, drivers=self._drivers(addrs),
                              original_drivers=original, stopped_at=run.stopped_at)
        errors = []
        for addr in addrs:
            want = original.get(addr, ANY_HOST_DRIVER)
            if want == VFIO_PCI:
                want = ANY_HOST_DRIVER  # a crash mid-bind recorded vfio-pci as 'original': the host gets it back
            try:
                run.do("clear-override", addr,
                       lambda a=addr: self._write(run, "clear-override", a, f"bus/pci/devices/{a}/driver_override", "\n"),
                       check=lambda a=addr: self.override_of(a) is None)
                if want is not None and self.driver_of(addr) is None:
                    run.do("probe", addr, lambda a=addr: self._write(run, "probe", a, "bus/pci/drivers_probe", a))
                    other = self.driver_of(addr)
                    if want != ANY_HOST_DRIVER and other is not None and other != want:
                        # Another loaded driver won the probe (nouveau over nvidia; vfio-pci again through its
                        # ids= option): take the function from it, then ask the original driver by name.
                        unbind = f"bus/pci/drivers/{other}/unbind"
                        run.do("unbind-other", addr,
                               lambda a=addr, u=unbind: self._write(run, "unbind-other", a, u, a),
                               check=lambda a=addr: self.driver_of(a) is None)
                    if want != ANY_HOST_DRIVER and self.driver_of(addr) is None:
                        # The probe found no taker: ask the original driver by name.
                        run.do("bind", addr,
                               lambda a=addr, w=want: self._write(run, "bind", a, f"bus/pci/drivers/{w}/bind", a))
                run.do("read-back", addr, lambda: None,
                       check=lambda a=addr, w=want: self._holds(a, w),
                       explain=lambda a=addr, w=want: f"{a} is on {self.driver_of(a) or 'no driver'}, expected "
                                                      f"{'a host driver' if w == ANY_HOST_DRIVER else w or 'no driver'}"
                                                      + (" (vfio-pci took it back on probe: a vfio-pci ids= module "
                                                         "option or new_id names it)"
                                                         if self.driver_of(a) == VFIO_PCI else ""))
            except (_Failed, HostError) as exc:
                errors.append(f"{run.stopped_at}: {exc.message if isinstance(exc, HostError) else exc}")
        drivers = self._drivers(addrs)
        if errors:
            return BindResult(False, tuple(run.steps), "; ".join(errors), needs_attention=True, drivers=drivers,
                              original_drivers=original, stopped_at=run.stopped_at)
        return BindResult(True, tuple(run.steps), drivers=drivers, original_drivers=original)

    # -- pieces -------------------------------------------------------------------------------------------------
    def _holds(self, addr: str, want: str | None) -> bool:
        drv = self.driver_of(addr)
        if want == ANY_HOST_DRIVER:
            return drv != VFIO_PCI
        return drv == want

    def _drivers(self, addrs: list[str]) -> dict[str, str | None]:
        return {a: self.driver_of(a) for a in addrs}

    def _ensure_modules(self, run: _Run) -> None:
        if self.sysfs.exists(f"bus/pci/drivers/{VFIO_PCI}") and self.sysfs.exists("module/vfio_iommu_type1"):
            return
        for mod in VFIO_MODULES:
            if self.sysfs.exists(f"module/{mod}"):
                continue
            run.do("load-module", mod, lambda m=mod: self.load_module(m),
                   check=lambda m=mod: self.sysfs.exists(f"module/{m}"))
        run.do("vfio-driver", VFIO_PCI, lambda: None, check=lambda: self.sysfs.exists(f"bus/pci/drivers/{VFIO_PCI}"),
               explain=lambda: "vfio-pci driver not registered after loading vfio_pci")

    def _write(self, run: _Run, step: str, address: str, rel: str, value: str) -> None:
        """One sysfs write in a worker thread; a write that does not return in time raises StepTimeout.

        A write that makes the kernel send a uevent (an unbind, a bind, a probe) is announced to `own` first (the
        uevent may arrive before the write returns), and `own` is told whether it sent one (not when it failed or a
        probe bound nothing). A hung write says so when it returns, if ever; its expectation lapses meanwhile."""
        box: dict[str, BaseException] = {}
        action = uevent_of(rel) if self.own is not None else None
        expected = self.own.expect(address, action) if self.own is not None and action is not None else None

        def target() -> None:
            try:
                self.sysfs.write(rel, value)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        # A daemon thread: a write stuck in the kernel must not keep the agent from exiting.
        t = threading.Thread(target=target, name=f"sysfs-{step}-{address}", daemon=True)
        t.start()
        t.join(self.step_timeout_s)
        if t.is_alive():
            self._hung[address] = (step, t)
            run.hung = True
            raise StepTimeout(f"{step} of {address} did not return within {self.step_timeout_s:g} s",
                              address=address, step=step)
        if expected is not None:
            assert self.own is not None
            self.own.done(expected, "error" not in box and (rel != "bus/pci/drivers_probe"
                                                            or self.driver_of(address) is not None))
        if "error" in box:
            raise box["error"]

    def _wait_node(self, group: int) -> bool:
        # devtmpfs creates the node at bind time; udev may still be fixing permissions, so allow a moment.
        deadline = time.monotonic() + self.vfio_node_wait_s
        while True:
            if self.vfio_node(group).exists():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    # undo actions: each raises when the device does not end where it should
    def _restore_host(self, run: _Run, addr: str, driver: str) -> None:
        if self.driver_of(addr) is None:
            self._write(run, "undo-probe", addr, "bus/pci/drivers_probe", addr)
        if self.driver_of(addr) is None:
            self._write(run, "undo-bind", addr, f"bus/pci/drivers/{driver}/bind", addr)
        if self.driver_of(addr) != driver:
            raise HostError(f"{addr} did not return to {driver} (on {self.driver_of(addr) or 'no driver'})",
                            address=addr)

    def _clear_override(self, run: _Run, addr: str) -> None:
        self._write(run, "undo-override", addr, f"bus/pci/devices/{addr}/driver_override", "\n")
        if self.override_of(addr) is not None:
            raise HostError(f"driver_override of {addr} still reads {self.override_of(addr)}", address=addr)

    def _leave_vfio(self, run: _Run, addr: str) -> None:
        if self.driver_of(addr) == VFIO_PCI:
            self._write(run, "undo-unbind-vfio", addr, f"bus/pci/drivers/{VFIO_PCI}/unbind", addr)
        if self.driver_of(addr) == VFIO_PCI:
            raise HostError(f"{addr} is still on vfio-pci", address=addr)

    def _back_to_vfio(self, run: _Run, addr: str) -> None:
        # driver_override still names vfio-pci here, so a probe returns it to vfio-pci.
        self._write(run, "undo-probe", addr, "bus/pci/drivers_probe", addr)
        if self.driver_of(addr) != VFIO_PCI:
            raise HostError(f"{addr} did not return to vfio-pci", address=addr)


class _Run:
    """The steps of one operation: runs them with postconditions, remembers undos, rolls back in reverse."""

    def __init__(self, binder: VfioBinder, on_step: OnStep | None) -> None:
        self.binder = binder
        self.on_step = on_step
        self.steps: list[Step] = []
        self.undos: list[tuple[str, str, Callable[[], None]]] = []
        self.stopped_at: str | None = None
        self.undo_failed = False
        self.hung = False

    def record(self, step: Step) -> None:
        self.steps.append(step)
        if self.binder.journal is not None:
            self.binder.journal(step)
        level = logging.INFO if step.ok else logging.WARNING
        log.log(level, "host step %s %s: %s", step.name, step.address, "ok" if step.ok else step.error)

    def do(self, name: str, address: str, action: Callable[[], None], *, check: Callable[[], bool] | None = None,
           undo: Callable[[], None] | None = None, explain: Callable[[], str] | None = None) -> None:
        """Run one step, then its postcondition; on failure record it and raise _Failed/HostError."""
        if self.on_step is not None:
            self.on_step(name, address)
        try:
            action()
            # The action may have partly happened even when the check fails: undo it all the same.
            if undo is not None:
                self.undos.append((name, address, undo))
            if check is not None and not check():
                raise _Failed(explain() if explain else f"postcondition of {name} not met for {address}")
        except (_Failed, HostError) as exc:
            self.stopped_at = f"{name} {address}"
            self.record(Step(name, address, False, exc.message if isinstance(exc, HostError) else str(exc)))
            raise
        self.record(Step(name, address, True))

    def rollback(self) -> None:
        """Undo every completed step in reverse order, recording each; an undo failure marks needs attention."""
        while self.undos:
            name, address, undo = self.undos.pop()
            if address in self.binder.stuck:
                self.undo_failed = True
                self.record(Step(f"undo-{name}", address, False, f"skipped: a {self.binder.stuck[address]} hung"))
                continue
            try:
                undo()
            except HostError as exc:
                self.undo_failed = True
                self.record(Step(f"undo-{name}", address, False, exc.message))
            else:
                self.record(Step(f"undo-{name}", address, True))
