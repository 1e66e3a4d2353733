"""A small 'kernel' for fake sysfs trees: writes to bind/unbind/driver_override/drivers_probe do what Linux does.

Semantics copied from drivers/base/bus.c, drivers/base/dd.c and drivers/pci/pci-driver.c:
- `drivers/D/unbind ADDR` detaches when ADDR is bound to D, else ENODEV.
- `devices/ADDR/driver_override` holds a driver name; a lone newline clears it (reads back "(null)").
- `drivers_probe ADDR` attaches an unbound device to the override driver when set (and loaded), else to a driver
  whose id table matches (the native driver, or one that was given the ids through `new_id`).
- `drivers/D/bind ADDR`: EBUSY when already bound, ENODEV when D does not match (override names another driver).
- vfio-pci's probe fails for a device without an IOMMU group; binding the first member of a group creates
  /dev/vfio/<group>, unbinding the last removes it.
Faults, read from files so another process sharing the tree sees them: `<sys>/.fault/<kind>/<addr>` with kind
`hang_unbind` (content: seconds), `fail_unbind`, `fail_override`, `fail_bind` (vfio-pci probe fails),
`no_rebind` (a host driver's probe fails) and `probe_winner` (content: a driver name; a probe with no override
attaches that driver first, as the kernel does when two loaded drivers match, e.g. nouveau over nvidia, or vfio-pci
through its `ids=` option; binding to a driver by name is unaffected) and `fail_reset` (the function does not
come back from a reset: ENOTTY, as pci_dev_wait gives up). While a hung unbind is blocked,
`<sys>/.fault-hanging/<addr>` exists (see `FakeKernel.hanging`), so a test can wait until the hang has begun, or has
ended, instead of guessing with sleeps.

Every write to one device (its bind, unbind, probe, driver_override, remove...) holds that device's lock throughout,
as the driver core's device_lock does: a second writer waits while an unbind is blocked inside the device (hung, or
waiting for the vfio user), then finds what the first one left (an unbind by then is ENODEV).

A device its user holds open blocks its unbind from vfio-pci, as in Linux: vfio_unregister_group_dev waits until the
last open file is closed, and meanwhile the driver signals the user's request notifier ("Relaying device request to
user", drivers/vfio/pci/vfio_pci_core.c), on which QEMU asks the guest to unplug the device. Here the user is the
simulated hypervisor: it marks the functions a running domain holds in `<sys>/.vfio-open/<addr>` and answers the
requests this kernel leaves in `<sys>/.vfio-request/<addr>` (hostagent.virt.sim_rules keeps the same names). The
unbind waits until the device is closed, at most VFIO_RELEASE_WAIT_S (the real kernel waits for ever), then fails
with EBUSY; while it waits, `.fault-hanging/<addr>` says so.

Uevents: every driver bind and unbind, and a device's removal and return, appends the kernel's uevent for it to
`<sys>/.uevents` (a JSON line: action, the device's address, and for a bind its driver; an unbind names none, as
the kernel's KOBJ_UNBIND is sent once the driver is gone), in the order the kernel emits them
(`unbind` before `remove`, `add` before the `bind` of its probe); `FakeUevents` reads them as the agent's netlink
source reads the real kernel's. `devices/ADDR/remove` (remove_store, drivers/pci/pci-sysfs.c) takes the device off
the bus (unbound first; a device its vfio user holds blocks as an unbind does) and `bus/pci/rescan` brings every
removed device back and probes its driver (drivers_autoprobe).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hostagent.domain.errors import HostError
from hostagent.host.fakesysfs import (
    DRIVER_MODULES,
    NATIVE_DRIVER_FILE,
    RESET_SUPPORTED_FILE,
    make_driver_dir,
    make_module_dir,
    relative_symlink,
)
from hostagent.host.sysfs import Sysfs

VFIO_PCI = "vfio-pci"
LOCK_FILE = ".fake-kernel.lock"
NEW_ID_LOG = ".fake_new_id_log"
FAULT_DIR = ".fault"
FAULT_KINDS = ("hang_unbind", "fail_unbind", "fail_override", "fail_bind", "no_rebind", "probe_winner",
               "fail_reset")
HANGING_DIR = ".fault-hanging"  # outside FAULT_DIR: clear_faults must not make an in-flight hang look finished
VFIO_OPEN_DIR = ".vfio-open"  # <addr>: the holder (a domain's name) has the function's vfio device open
VFIO_REQUEST_DIR = ".vfio-request"  # <addr>: this kernel asked the holder to let go (vfio's request notifier)
VFIO_RELEASE_WAIT_S = 30.0  # a blocked unbind of a held device gives up (EBUSY) after this long
VFIO_RELEASE_POLL_S = 0.01
UEVENT_LOG = ".uevents"  # the kernel's PCI uevents, a JSON line each (FakeUevents reads them)
DEVICE_LOCK_DIR = ".device-lock"  # <addr>: the device's lock (the driver core's device_lock), as an flock
REMOVED_DIR = ".removed"  # <addr>/: a device taken off the bus, kept for a rescan to bring back

# modprobe name -> modules it brings in (hard dependencies first), as modules.dep says.
MODULE_DEPS: dict[str, tuple[str, ...]] = {
    "vfio_pci": ("irqbypass", "vfio", "vfio_pci_core", "vfio_pci"),
    "vfio_iommu_type1": ("vfio_iommu_type1",),
    "vfio": ("irqbypass", "vfio"),
}


class FakeKernel(Sysfs):
    """Sysfs whose writes behave like the kernel's PCI core, for trees built by `fakesysfs.build_tree`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self._root_real = Path(os.path.realpath(self.root))
        self.dev_root = self._root_real.parent / "dev"
        self.proc_root = self._root_real.parent / "proc"

    # -- faults (tests set them; a separate agent process sees them too) -----------------------------------------
    def set_fault(self, kind: str, address: str, value: str = "") -> None:
        """Arm a fault for one device (see the module docstring)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULT_KINDS)}")
        p = self._root_real / FAULT_DIR / kind / address
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(value)

    def clear_fault(self, kind: str, address: str) -> None:
        """Disarm a fault."""
        with contextlib.suppress(FileNotFoundError):
            (self._root_real / FAULT_DIR / kind / address).unlink()

    def clear_faults(self) -> None:
        """Disarm every fault."""
        for p in list((self._root_real / FAULT_DIR).glob("*/*")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def _fault(self, kind: str, address: str) -> str | None:
        p = self._root_real / FAULT_DIR / kind / address
        try:
            return p.read_text().strip()
        except OSError:
            return None

    def hanging(self) -> dict[str, str]:
        """address -> the write blocked in the 'kernel' right now ('DRIVER/unbind').

        A file per blocked write (like the faults), so a test (or another process sharing the tree) can tell a hang
        that has begun from one still to come, and a write that finally returned from one still blocked."""
        out = {}
        for p in (self._root_real / HANGING_DIR).glob("*"):
            with contextlib.suppress(FileNotFoundError):
                out[p.name] = p.read_text()
        return out

    @contextlib.contextmanager
    def _blocked(self, address: str, what: str) -> Iterator[None]:
        p = self._root_real / HANGING_DIR / address
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(what)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def holder(self, address: str) -> str | None:
        """Who holds the function's vfio device open (a running domain's name), or None."""
        try:
            return (self._root_real / VFIO_OPEN_DIR / address).read_text().strip() or "?"
        except OSError:
            return None

    def _wait_released(self, address: str, holder: str, target: Path) -> None:
        """Ask the holder to let go, then wait until it has (see the module docstring)."""
        request = self._root_real / VFIO_REQUEST_DIR / address
        request.parent.mkdir(parents=True, exist_ok=True)
        request.write_text(holder)
        deadline = time.monotonic() + VFIO_RELEASE_WAIT_S
        while self.holder(address) is not None:
            if time.monotonic() >= deadline:
                with contextlib.suppress(FileNotFoundError):
                    request.unlink()
                raise self._err(errno.EBUSY, f"vfio-pci: {address} is still held by {holder} after "
                                f"{VFIO_RELEASE_WAIT_S:g} s", target)
            time.sleep(VFIO_RELEASE_POLL_S)

    def new_id_writes(self) -> list[str]:
        """Every write to some driver's new_id so far ('driver: ids'); our binder must never make one."""
        try:
            return (self._root_real / NEW_ID_LOG).read_text().splitlines()
        except OSError:
            return []

    # -- modules ------------------------------------------------------------------------------------------------
    def loaded_modules(self) -> list[str]:
        """Names under sys/module."""
        return self.listdir("module")

    def load_module(self, name: str) -> None:
        """What `modprobe NAME` does here: register the module (and vfio-pci's driver), update /proc/modules."""
        name = name.replace("-", "_")
        with self._locked():
            for mod in MODULE_DEPS.get(name, (name,)):
                if (self._root_real / "module" / mod).exists():
                    continue
                make_module_dir(self._root_real, mod)
                if mod == "vfio_pci":
                    make_driver_dir(self._root_real, VFIO_PCI)
                if mod == "vfio":
                    self.dev_root.joinpath("vfio").mkdir(parents=True, exist_ok=True)
                    self.dev_root.joinpath("vfio", "vfio").write_text("")
                modules = self.proc_root / "modules"
                if modules.exists():
                    with modules.open("a") as f:
                        f.write(f"{mod} 65536 0 - Live 0x0000000000000000\n")

    # -- writes -------------------------------------------------------------------------------------------------
    def write(self, rel: str, value: str) -> None:
        """Write an attribute; control files act like the kernel, other files are plain writes."""
        target = self.path(rel)
        parent = Path(os.path.realpath(target.parent))
        attr = target.name
        drivers_dir = self._root_real / "bus/pci/drivers"
        arg = value.strip()
        with contextlib.ExitStack() as blocked:
            device = (arg if (parent.parent == drivers_dir and attr in ("bind", "unbind"))
                      or (parent == self._root_real / "bus/pci" and attr == "drivers_probe")
                      else parent.name if (parent / NATIVE_DRIVER_FILE).exists() else None)
            if device:  # device_lock(dev): a write waits while another is inside the same device (a blocked unbind)
                blocked.enter_context(self._device_locked(device))
            if parent.parent == drivers_dir and attr == "unbind":
                hang = self._fault("hang_unbind", arg)
                if hang is not None:
                    # Outside the lock: a hung unbind in the kernel holds only that device's lock. The marker stays
                    # until the write has had its effect, so once it is gone the device's end state is readable.
                    blocked.enter_context(self._blocked(arg, f"{parent.name}/unbind"))
                    time.sleep(float(hang or "3600"))
                holder = self.holder(arg) if parent.name == VFIO_PCI else None
                if holder is not None:
                    blocked.enter_context(self._blocked(arg, f"{parent.name}/unbind (held by {holder})"))
                    self._wait_released(arg, holder, target)
            elif attr == "remove" and (parent / NATIVE_DRIVER_FILE).exists() and self._current(parent) == VFIO_PCI:
                holder = self.holder(parent.name)  # the driver's remove waits for the vfio user as an unbind does
                if holder is not None:
                    blocked.enter_context(self._blocked(parent.name, f"remove (held by {holder})"))
                    self._wait_released(parent.name, holder, target)
            with self._locked():
                if parent == self._root_real / "bus/pci" and attr == "drivers_probe":
                    self._probe(arg)
                elif parent == self._root_real / "bus/pci" and attr == "rescan":
                    self._rescan(value, target)
                elif parent == self._root_real / "bus/pci" and attr == "drivers_autoprobe":
                    return
                elif parent.parent == drivers_dir and attr in ("bind", "unbind", "new_id", "remove_id"):
                    getattr(self, f"_{attr}")(parent.name, arg, target)
                elif (parent / NATIVE_DRIVER_FILE).exists():
                    self._device_attr(parent, attr, value, target)
                else:
                    super().write(rel, value)

    def _device_locked(self, address: str) -> contextlib.AbstractContextManager[None]:
        locks = self._root_real / DEVICE_LOCK_DIR
        locks.mkdir(exist_ok=True)
        return _flocked(locks / address)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return _flocked(self._root_real / LOCK_FILE)

    @staticmethod
    def _err(code: int, what: str, target: Path) -> HostError:
        return HostError(f"{what}: {errno.errorcode[code]} {os.strerror(code)}", path=str(target), errno=code)

    def _dev(self, address: str, target: Path) -> Path:
        link = self._root_real / "bus/pci/devices" / address
        if not address or not os.path.lexists(link):
            raise self._err(errno.ENODEV, f"no PCI device {address!r}", target)
        return Path(os.path.realpath(link))

    def _device_attr(self, dev: Path, attr: str, value: str, target: Path) -> None:
        if attr == "driver_override":
            if self._fault("fail_override", dev.name) is not None:
                raise self._err(errno.EINVAL, f"driver_override of {dev.name} refused", target)
            name = value.strip()
            (dev / "driver_override").write_text((name or "(null)") + "\n")
        elif attr == "reset":
            self._reset(dev, value, target)
        elif attr == "reset_method":
            self._reset_method(dev, value, target)
        elif attr == "remove":
            self._remove(dev, value, target)
        elif attr == "rescan":
            return
        else:
            raise self._err(errno.EACCES, f"{attr} of {dev.name} is read-only", target)

    def _reset(self, dev: Path, value: str, target: Path) -> None:
        """`reset` (reset_store, drivers/pci/pci-sysfs.c): "1" resets the function by the first method in
        reset_method that works; none left (an operator emptied the list) is ENOTTY, as is a device that does not
        come back from its reset (the `fail_reset` fault: pci_dev_wait's "not ready after FLR; giving up")."""
        if not (dev / "reset").exists():
            raise self._err(errno.ENOENT, f"{dev.name} has no reset attribute (no reset method)", target)
        if value.strip() != "1":
            raise self._err(errno.EINVAL, f"reset of {dev.name} takes 1", target)
        if not (dev / "reset_method").read_text().split():
            raise self._err(errno.ENOTTY, f"{dev.name}: every reset method is disabled", target)
        if self._fault("fail_reset", dev.name) is not None:
            raise self._err(errno.ENOTTY, f"{dev.name} not ready after reset; giving up", target)

    def _reset_method(self, dev: Path, value: str, target: Path) -> None:
        """`reset_method` (reset_method_store, drivers/pci/pci.c): "default" restores every method the device has;
        an empty line disables them all; otherwise a list of supported methods, in the order to try them."""
        supported = (dev / RESET_SUPPORTED_FILE).read_text().split()
        names = value.split()
        if names == ["default"]:
            names = supported
        unknown = [n for n in names if n not in supported]
        if unknown:
            raise self._err(errno.EINVAL, f"{dev.name} does not support reset method(s) {unknown}", target)
        (dev / "reset_method").write_text(" ".join(names) + "\n" if names else "\n")

    def _remove(self, dev: Path, value: str, target: Path) -> None:
        """`remove`: "1" unbinds the device (its uevent first), takes it off the bus and out of its IOMMU group,
        and says so (`remove`); the device is kept under REMOVED_DIR for a rescan."""
        if value.strip() != "1":
            raise self._err(errno.EINVAL, f"remove of {dev.name} takes 1", target)
        address = dev.name
        self._detach(dev)
        group = self._group(dev)
        keep = self._root_real / REMOVED_DIR / address
        keep.mkdir(parents=True, exist_ok=True)
        (keep / "path").write_text(str(dev))
        (keep / "group").write_text(group or "")
        with contextlib.suppress(FileNotFoundError):
            (self._root_real / "bus/pci/devices" / address).unlink()
        if group is not None:
            with contextlib.suppress(FileNotFoundError):
                (self._root_real / "kernel/iommu_groups" / group / "devices" / address).unlink()
        shutil.move(str(dev), str(keep / "device"))
        self._uevent("remove", address, None)

    def _rescan(self, value: str, target: Path) -> None:
        """`bus/pci/rescan`: "1" brings back every removed device (`add`), then probes its driver."""
        if value.strip() != "1":
            raise self._err(errno.EINVAL, "rescan takes 1", target)
        for keep in sorted((self._root_real / REMOVED_DIR).glob("*")):
            address = keep.name
            dev = Path((keep / "path").read_text())
            shutil.move(str(keep / "device"), str(dev))
            relative_symlink(self._root_real / "bus/pci/devices" / address, dev)
            group = (keep / "group").read_text()
            if group:
                relative_symlink(self._root_real / "kernel/iommu_groups" / group / "devices" / address, dev)
            shutil.rmtree(keep)
            self._uevent("add", address, None)
            self._probe(address)

    def _uevent(self, action: str, address: str, driver: str | None) -> None:
        """Append the kernel's uevent (under the tree's lock, so in the order the changes happened)."""
        with (self._root_real / UEVENT_LOG).open("a") as f:
            f.write(json.dumps({"action": action, "address": address, "driver": driver, "at": time.monotonic()})
                    + "\n")

    def _unbind(self, driver: str, address: str, target: Path) -> None:
        dev = self._dev(address, target)
        if self._current(dev) != driver:
            raise self._err(errno.ENODEV, f"{address} is not bound to {driver}", target)
        if self._fault("fail_unbind", address) is not None:
            raise self._err(errno.EBUSY, f"{driver} refused to release {address}", target)
        self._detach(dev)

    def _bind(self, driver: str, address: str, target: Path) -> None:
        dev = self._dev(address, target)
        if self._current(dev) is not None:
            raise self._err(errno.EBUSY, f"{address} is already bound to {self._current(dev)}", target)
        if not self._matches(driver, dev):
            raise self._err(errno.ENODEV, f"{driver} does not match {address}", target)
        if not self._attach(driver, dev):
            raise self._err(errno.EINVAL, f"{driver} probe of {address} failed", target)

    def _new_id(self, driver: str, ids: str, target: Path) -> None:
        with (self._root_real / NEW_ID_LOG).open("a") as f:
            f.write(f"{driver}: {ids}\n")
        with (self._root_real / "bus/pci/drivers" / driver / ".fake_new_ids").open("a") as f:
            f.write(" ".join(ids.split()[:2]).lower() + "\n")
        # The kernel then probes every unbound device the new id matches.
        for addr in self.listdir("bus/pci/devices"):
            dev = self._dev(addr, target)
            if self._current(dev) is None and self._matches(driver, dev):
                self._attach(driver, dev)

    def _remove_id(self, driver: str, ids: str, target: Path) -> None:
        p = self._root_real / "bus/pci/drivers" / driver / ".fake_new_ids"
        if p.exists():
            want = " ".join(ids.split()[:2]).lower()
            p.write_text("".join(ln + "\n" for ln in p.read_text().splitlines() if ln != want))

    def _probe(self, address: str) -> None:
        dev = self._dev(address, self._root_real / "bus/pci/drivers_probe")
        if self._current(dev) is not None:
            return
        override = self._override(dev)
        if override is not None:
            candidates = [override]
        else:
            candidates = [(dev / NATIVE_DRIVER_FILE).read_text().strip()] + self.listdir("bus/pci/drivers")
            winner = self._fault("probe_winner", address)
            if winner and (self._root_real / "bus/pci/drivers" / winner).is_dir():
                self._attach(winner, dev)  # matches the device (its ids= option, or its own id table)
                return
        for driver in candidates:
            if driver and (self._root_real / "bus/pci/drivers" / driver).is_dir() and self._matches(driver, dev):
                if self._attach(driver, dev):
                    return

    # -- state --------------------------------------------------------------------------------------------------
    @staticmethod
    def _current(dev: Path) -> str | None:
        try:
            return os.path.basename(os.readlink(dev / "driver"))
        except OSError:
            return None

    @staticmethod
    def _override(dev: Path) -> str | None:
        text = (dev / "driver_override").read_text().strip()
        return None if text in ("", "(null)") else text

    def _ids(self, dev: Path) -> str:
        return f"{(dev / 'vendor').read_text().strip()[2:]} {(dev / 'device').read_text().strip()[2:]}"

    def _matches(self, driver: str, dev: Path) -> bool:
        override = self._override(dev)
        if override is not None:
            return override == driver
        if (dev / NATIVE_DRIVER_FILE).read_text().strip() == driver:
            return True
        ids = self._root_real / "bus/pci/drivers" / driver / ".fake_new_ids"
        return ids.exists() and self._ids(dev) in ids.read_text().splitlines()

    def _group(self, dev: Path) -> str | None:
        try:
            return os.path.basename(os.readlink(dev / "iommu_group"))
        except OSError:
            return None

    def _attach(self, driver: str, dev: Path) -> bool:
        """Run the driver's probe; False when it fails (the device stays unbound, as in Linux)."""
        address = dev.name
        if driver == VFIO_PCI:
            group = self._group(dev)
            if group is None or self._fault("fail_bind", address) is not None:
                return False
        elif self._fault("no_rebind", address) is not None:
            return False
        ddir = self._root_real / "bus/pci/drivers" / driver
        relative_symlink(dev / "driver", ddir)
        relative_symlink(ddir / address, dev)
        (dev / "enable").write_text("1\n")
        if driver == VFIO_PCI:
            node = self.dev_root / "vfio" / str(self._group(dev))
            node.parent.mkdir(parents=True, exist_ok=True)
            node.touch()
        module = DRIVER_MODULES.get(driver)
        if module and not (self._root_real / "module" / module).exists():
            make_module_dir(self._root_real, module)
        self._uevent("bind", address, driver)
        return True

    def _detach(self, dev: Path) -> None:
        driver = self._current(dev)
        if driver is None:
            return
        (dev / "driver").unlink()
        with contextlib.suppress(FileNotFoundError):
            (self._root_real / "bus/pci/drivers" / driver / dev.name).unlink()
        (dev / "enable").write_text("0\n")
        if driver == VFIO_PCI:
            group = self._group(dev)
            members = self.listdir(f"kernel/iommu_groups/{group}/devices") if group else []
            still = [m for m in members if m != dev.name and self.read_link(f"bus/pci/devices/{m}/driver") == VFIO_PCI]
            if group is not None and not still:
                with contextlib.suppress(FileNotFoundError):
                    (self.dev_root / "vfio" / group).unlink()
        self._uevent("unbind", dev.name, None)  # KOBJ_UNBIND comes after dev->driver = NULL: no DRIVER


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`. flock locks belong to the open file description, so threads and processes
    both serialise here."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class FakeUevents:
    """The fake kernel's uevents as the agent's source (host.uevents.KernelUevents for the real kernel): a thread
    follows `<sys>/.uevents` from its end at `start` and hands each new event to `deliver` (action, address,
    driver, and the time.monotonic() the fake kernel sent it: one clock for every process of the machine), which
    must be thread-safe (the runtime posts it into its event loop). It looks at the log's size every POLL_S and
    reads only when it grew."""

    POLL_S = 0.01

    def __init__(self, sysfs_root: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.realpath(sysfs_root)) / UEVENT_LOG
        self.description = f"the fake kernel's uevents ({self.path})"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, deliver: Callable[[str, str, str | None, float], None]) -> None:
        """Follow the log from its current end."""
        offset = self.path.stat().st_size if self.path.exists() else 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._follow, args=(deliver, offset), name="fake-uevents", daemon=True)
        self._thread.start()

    def _follow(self, deliver: Callable[[str, str, str | None, float], None], offset: int) -> None:
        pending = b""
        while not self._stop.wait(self.POLL_S):
            try:
                if os.stat(self.path).st_size <= offset:
                    continue
                with self.path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            offset += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError, KeyError):
                    ev = json.loads(line)
                    deliver(ev["action"], ev["address"], ev.get("driver"), float(ev["at"]))

    def stop(self) -> None:
        """Stop following (waits for the thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
