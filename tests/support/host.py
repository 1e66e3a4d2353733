"""Test helpers for the host adapter: fake trees, tree digests, driver snapshots."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hostagent.host.discovery import Inventory, discover
from hostagent.host.fakekernel import FakeKernel
from hostagent.host.fakesysfs import FakeHost, build_tree


def fake_host(root: Path, scenario: str) -> tuple[FakeHost, FakeKernel, Inventory]:
    """Build a scenario under root; return the tree, its fake kernel and the discovered inventory."""
    host = build_tree(root, scenario)
    kernel = FakeKernel(host.sys_root)
    return host, kernel, discover(kernel)


def tree_digest(root: Path) -> str:
    """A digest of every path, link target and file content under root (to prove nothing was written)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            h.update(p.encode())
            if os.path.islink(p):
                h.update(b"->" + os.readlink(p).encode())
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def drivers(kernel: FakeKernel, addresses: list[str]) -> dict[str, str | None]:
    """address -> driver bound now."""
    return {a: kernel.read_link(f"bus/pci/devices/{a}/driver") for a in addresses}
