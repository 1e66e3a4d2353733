"""What libvirt's QEMU driver and QEMU refuse when a PCI hostdev is hot-plugged or unplugged, with the error codes
libvirt reports, for the simulated hypervisor. Each rule names the source it follows; the simulator must be no
kinder than the real stack, or the agent's failure paths go untested.

The codes are libvirt's virErrorNumber and virErrorDomain values (include/libvirt/virterror.h); the messages carry
the prefix libvirt's virErrorMsg gives each code, so an operator reads the same text from the simulator as from
libvirtd, and the real adapter's ``libvirt_code`` detail is set the same way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hostagent.domain.errors import HypervisorError

# virErrorNumber (include/libvirt/virterror.h); tests/unit/test_virt_sim_strict.py compares them with libvirt-python
VIR_ERR_INTERNAL_ERROR = 1
VIR_ERR_OPERATION_FAILED = 9
VIR_ERR_XML_ERROR = 27
VIR_ERR_SYSTEM_ERROR = 38
VIR_ERR_OPERATION_INVALID = 55
VIR_ERR_CONFIG_UNSUPPORTED = 67
# virErrorDomain
VIR_FROM_NONE = 0
VIR_FROM_QEMU = 10
VIR_FROM_DOMAIN = 20

# virErrorMsg (src/util/virerror.c): the text libvirt puts before the message for each code
_PREFIX = {
    VIR_ERR_INTERNAL_ERROR: "internal error: ",
    VIR_ERR_OPERATION_FAILED: "operation failed: ",
    VIR_ERR_XML_ERROR: "XML error: ",
    VIR_ERR_SYSTEM_ERROR: "",
    VIR_ERR_OPERATION_INVALID: "Requested operation is not valid: ",
    VIR_ERR_CONFIG_UNSUPPORTED: "unsupported configuration: ",
}

# libvirt's stub drivers for an unmanaged hostdev (virPCIStubDriver, src/util/virpci.h; xen-pciback aside):
# virHostdevPreparePCIDevicesImpl refuses an unmanaged device bound to anything else (src/hypervisor/virhostdev.c).
STUB_DRIVERS = frozenset({"vfio-pci", "pci-stub"})
# The kernel's group viability (drivers/vfio/group.c, vfio_dev_viable and vfio_dev_driver_allowed): every device of
# the group is unbound, bound to a vfio driver, to pci-stub, or is a bridge (pcieport); QEMU's vfio-pci device_add
# fails on a group that is not viable.
VIABLE_DRIVERS = frozenset({"vfio-pci", "pci-stub", "pcieport"})


def libvirt_error(message: str, code: int, origin: int = VIR_FROM_QEMU, **details: Any) -> HypervisorError:
    """A HypervisorError as the real adapter translates a libvirtError: libvirt's text, its code in the message and in
    the ``libvirt_code``/``libvirt_domain`` details."""
    return HypervisorError(f"{_PREFIX.get(code, '')}{message} (libvirt error {code})", libvirt_code=code,
                           libvirt_domain=origin, **details)


def qemu_error(command: str, message: str, **details: Any) -> HypervisorError:
    """QEMU refused a monitor command: libvirt reports VIR_ERR_INTERNAL_ERROR "unable to execute QEMU command"
    (qemuMonitorJSONCheckError, src/qemu/qemu_monitor_json.c)."""
    return libvirt_error(f"unable to execute QEMU command '{command}': {message}", VIR_ERR_INTERNAL_ERROR, **details)


# Who holds a function's vfio device open, and the kernel's requests to let go, as files in the sysfs tree the fake
# kernel reads (hostagent.host.fakekernel keeps the same names): QEMU holds /dev/vfio/N while the device is in a
# running guest; unbinding vfio-pci from it blocks in vfio_unregister_group_dev until QEMU lets go, and meanwhile the
# kernel signals QEMU's request notifier, which asks the guest to unplug the device (vfio_req_notifier_handler,
# hw/vfio/pci.c; "Relaying device request to user" in drivers/vfio/pci/vfio_pci_core.c).
VFIO_OPEN_DIR = ".vfio-open"
VFIO_REQUEST_DIR = ".vfio-request"


class HostDevices:
    """The host side of a hot-plug, read from a sysfs tree (the fake kernel's or the real one): which driver holds a
    function, and which functions share its IOMMU group."""

    def __init__(self, sysfs_root: str | os.PathLike[str]) -> None:
        self.root = Path(sysfs_root)

    def _dev(self, address: str) -> Path:
        return self.root / "bus/pci/devices" / address

    def driver(self, address: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self._dev(address) / "driver"))
        except OSError:
            return None

    def group(self, address: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self._dev(address) / "iommu_group"))
        except OSError:
            return None

    def group_members(self, address: str) -> list[str]:
        group = self.group(address)
        if group is None:
            return [address]
        try:
            return sorted(os.listdir(self.root / "kernel/iommu_groups" / group / "devices"))
        except OSError:
            return [address]

    def open(self, address: str, holder: str) -> None:
        """QEMU of `holder` opened the function's vfio device (it is in that domain's live XML)."""
        p = self.root / VFIO_OPEN_DIR / address
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(holder)

    def close(self, address: str) -> None:
        """QEMU let go of the function (it left the live XML, or the domain stopped)."""
        with contextlib.suppress(FileNotFoundError):
            (self.root / VFIO_OPEN_DIR / address).unlink()

    def take_requests(self) -> list[str]:
        """The functions the kernel asked their holder to release (vfio's request notifier), each taken once."""
        try:
            names = os.listdir(self.root / VFIO_REQUEST_DIR)
        except OSError:
            return []
        taken = []
        for name in sorted(names):
            with contextlib.suppress(FileNotFoundError):
                (self.root / VFIO_REQUEST_DIR / name).unlink()
                taken.append(name)
        return taken

    def check_assignable(self, address: str, *, managed: bool, domain: str, in_use: Mapping[str, str]) -> None:
        """Raise what libvirt and QEMU raise when `address` cannot be hot-plugged into `domain` now; `in_use` maps
        the host functions other running domains hold to their names.

        - a function that does not exist: libvirt cannot read its config space (VIR_ERR_SYSTEM_ERROR);
        - a function of the same IOMMU group held by another domain: "is in use by driver QEMU"
          (virHostdevIsPCINodeDeviceUsed over the group, VIR_ERR_OPERATION_INVALID);
        - an unmanaged function not on a stub driver: "must be manually detached from the host"
          (virHostdevPreparePCIDevicesImpl, VIR_ERR_OPERATION_INVALID);
        - a group that is not viable: QEMU's device_add fails (VIR_ERR_INTERNAL_ERROR).
        A managed function is libvirt's to bind; the simulator cannot, so only the group checks apply to it."""
        dev = self._dev(address)
        if not dev.exists():
            raise libvirt_error(f"Failed to open config space file '/sys/bus/pci/devices/{address}/config': "
                                "No such file or directory", VIR_ERR_SYSTEM_ERROR, VIR_FROM_NONE, domain=domain,
                                address=address)
        members = self.group_members(address)
        for member in members:
            if member in in_use:
                raise libvirt_error(f"PCI device {member} is in use by driver QEMU, domain {in_use[member]}",
                                    VIR_ERR_OPERATION_INVALID, VIR_FROM_NONE, domain=domain, address=address)
        if managed:
            return
        if self.driver(address) not in STUB_DRIVERS:
            raise libvirt_error(f"Unmanaged PCI device {address} must be manually detached from the host",
                                VIR_ERR_OPERATION_INVALID, VIR_FROM_NONE, domain=domain, address=address,
                                driver=self.driver(address))
        group = self.group(address)
        for member in members:
            if self.driver(member) not in VIABLE_DRIVERS | {None}:
                raise qemu_error("device_add", f"vfio {address}: group {group} is not viable: Please ensure all "
                                 "devices within the iommu_group are bound to their vfio bus driver.",
                                 domain=domain, address=address, blocker=member, blocker_driver=self.driver(member))
