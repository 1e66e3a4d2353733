"""Runs INSIDE the QEMU test guest (real kernel, real vfio-pci): bind, open and give back devices through the
project's CLI, and write what happened to $OUT/vfio.json for tests/e2e/test_qemu_vfio.py to judge.

The CLI's `main()` runs in this one process rather than as one `python -m hostagent` per step: under TCG every
interpreter start costs ~10 s of imports, and the code path (argument parsing, discovery, VfioBinder, read-back,
exit status, JSON output) is the same. Nothing here decides pass or fail; it only records facts.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

from hostagent.cli.parser import main as hostagent_main

SYS = Path("/sys/bus/pci/devices")

# <linux/vfio.h>: _IO(VFIO_TYPE=';', VFIO_BASE=100 + n)
_VFIO = ord(";") << 8
VFIO_GET_API_VERSION = _VFIO | 100
VFIO_CHECK_EXTENSION = _VFIO | 101
VFIO_SET_IOMMU = _VFIO | 102
VFIO_GROUP_GET_STATUS = _VFIO | 103
VFIO_GROUP_SET_CONTAINER = _VFIO | 104
VFIO_GROUP_UNSET_CONTAINER = _VFIO | 105
VFIO_GROUP_GET_DEVICE_FD = _VFIO | 106
VFIO_DEVICE_GET_INFO = _VFIO | 107
VFIO_TYPE1_IOMMU = 1
VFIO_GROUP_FLAGS_VIABLE = 1
VFIO_DEVICE_FLAGS_PCI = 1 << 1


def cli(*argv: str) -> dict[str, Any]:
    """Run `hostagent ARGV` in-process: exit status, parsed JSON (when any), stderr, seconds taken."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = hostagent_main(list(argv))
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code if isinstance(exc.code, int) else 2
    text = out.getvalue()
    try:
        data = json.loads(text) if text.strip() else None
    except ValueError:
        data = None
    return {"argv": list(argv), "rc": rc, "json": data, "stdout": text, "stderr": err.getvalue(),
            "seconds": round(time.monotonic() - t0, 2)}


def snapshot() -> dict[str, dict[str, Any]]:
    """Every PCI function's driver, driver_override and IOMMU group, straight from sysfs."""
    state = {}
    for dev in sorted(SYS.iterdir()):
        drv = dev / "driver"
        override = (dev / "driver_override").read_text().strip()
        group = dev / "iommu_group"
        state[dev.name] = {
            "driver": os.path.basename(os.readlink(drv)) if drv.is_symlink() else None,
            "override": None if override == "(null)" else override,
            "group": int(os.path.basename(os.readlink(group))) if group.is_symlink() else None,
            "net": sorted(p.name for p in (dev / "net").iterdir()) if (dev / "net").is_dir() else [],
        }
    return state


def open_group(group: int, addresses: list[str]) -> dict[str, Any]:
    """Use the group as QEMU would: open it, check viability, attach a type1 container, get every device fd."""
    facts: dict[str, Any] = {"group": group, "node": f"/dev/vfio/{group}"}
    container = os.open("/dev/vfio/vfio", os.O_RDWR)
    try:
        facts["api_version"] = fcntl.ioctl(container, VFIO_GET_API_VERSION)
        facts["type1_supported"] = fcntl.ioctl(container, VFIO_CHECK_EXTENSION, VFIO_TYPE1_IOMMU) == 1
        gfd = os.open(f"/dev/vfio/{group}", os.O_RDWR)
        try:
            status = bytearray(struct.pack("II", 8, 0))
            fcntl.ioctl(gfd, VFIO_GROUP_GET_STATUS, status, True)
            facts["viable"] = bool(struct.unpack("II", status)[1] & VFIO_GROUP_FLAGS_VIABLE)
            fcntl.ioctl(gfd, VFIO_GROUP_SET_CONTAINER, bytearray(struct.pack("i", container)), True)
            fcntl.ioctl(container, VFIO_SET_IOMMU, VFIO_TYPE1_IOMMU)
            facts["container_set"] = True
            devices = {}
            for addr in addresses:
                name = bytearray(addr.encode() + b"\0")
                dfd = fcntl.ioctl(gfd, VFIO_GROUP_GET_DEVICE_FD, name, True)
                try:
                    info = bytearray(struct.pack("IIII", 16, 0, 0, 0))
                    fcntl.ioctl(dfd, VFIO_DEVICE_GET_INFO, info, True)
                    _argsz, flags, regions, irqs = struct.unpack("IIII", info)
                    devices[addr] = {"pci": bool(flags & VFIO_DEVICE_FLAGS_PCI), "regions": regions, "irqs": irqs}
                finally:
                    os.close(dfd)
            facts["devices"] = devices
            fcntl.ioctl(gfd, VFIO_GROUP_UNSET_CONTAINER)
        finally:
            os.close(gfd)
    except OSError as exc:
        facts["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        os.close(container)
    return facts


def bind_open_release(address: str) -> dict[str, Any]:
    """The full cycle for ADDR's group: bind, read sysfs, open via vfio, give back, read sysfs again."""
    rec: dict[str, Any] = {"address": address, "before": snapshot()}
    rec["bind"] = cli("vfio", "bind", address, "--json")
    rec["after_bind"] = snapshot()
    bound = rec["bind"]["json"] or {}
    group = bound.get("group")
    members = sorted(bound.get("drivers", {}))
    rec["node_after_bind"] = group is not None and os.path.exists(f"/dev/vfio/{group}")
    rec["open"] = open_group(group, members) if group is not None else {"error": "bind reported no group"}
    rec["release"] = cli("vfio", "release", address, "--json")
    rec["after_release"] = snapshot()
    rec["node_after_release"] = group is not None and os.path.exists(f"/dev/vfio/{group}")
    return rec


def refused(*argv: str) -> dict[str, Any]:
    """A command that must change nothing: its result and the sysfs state around it."""
    before = snapshot()
    rec = cli(*argv)
    rec["unchanged"] = snapshot() == before
    rec["before"] = before
    return rec


def run(single: str, pair: str, shared: str) -> dict[str, Any]:
    """Every scenario, in an order where none depends on another's success."""
    t0 = time.monotonic()
    results: dict[str, Any] = {"kernel": os.uname().release}
    results["malformed"] = refused("vfio", "bind", "0000:zz:00.0", "--json")
    results["absent"] = refused("vfio", "bind", "0000:00:1e.0", "--json")
    results["nonviable"] = refused("vfio", "bind", shared, "--json")
    results["single"] = bind_open_release(single)
    results["pair"] = bind_open_release(pair)
    results["seconds"] = round(time.monotonic() - t0, 2)
    return results


if __name__ == "__main__":
    single_addr, pair_addr, shared_addr = sys.argv[1:4]
    out = Path(os.environ.get("OUT", "."))
    out.joinpath("vfio.json").write_text(json.dumps(run(single_addr, pair_addr, shared_addr), indent=1))
