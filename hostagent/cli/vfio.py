"""`hostagent vfio bind|release ADDR`: move every function of ADDR's IOMMU group to vfio-pci, or give it back to
its host driver, directly through sysfs with read-back (any PCI device, not only GPUs; `--dry-run` prints the
steps).
"""

from __future__ import annotations

import argparse
from typing import Any

from hostagent.cli.common import add_common_options, emit, settings_for
from hostagent.domain.errors import InvalidInput, NotFound


def _group_for_address(inv: Any, text: str) -> Any:
    """The IOMMU group holding ADDR, for vfio bind/release of non-GPU devices too (the QEMU tests use NICs)."""
    from hostagent.domain.pci import PciAddress

    addr = PciAddress.parse(text)
    fn = next((f for f in inv.functions if f.address == addr), None)
    if fn is None:
        raise NotFound(f"no PCI device at {addr} (see `hostagent gpus`)", field="address")
    if fn.iommu_group is None or fn.iommu_group not in inv.groups:
        raise InvalidInput(f"{addr} has no IOMMU group: enable the IOMMU (intel_iommu=on / amd_iommu=on)",
                           field="address")
    return inv.groups[fn.iommu_group]


def cmd_vfio(args: argparse.Namespace) -> int:
    """Bind or give back the whole IOMMU group of ADDR, with read-back."""
    from hostagent.host.binding import VfioBinder
    from hostagent.adapters import discover_host, open_kernel

    settings = settings_for(args)
    inv = discover_host(settings)
    group = _group_for_address(inv, args.address)
    binder = VfioBinder(open_kernel(settings), settings.dev_root, settings.host.step_timeout_s)
    if args.vfio_command == "bind":
        if not group.viable and not args.force:
            raise InvalidInput(f"IOMMU group {group.number} is not viable: {group.reason}", field="address")
        plan = binder.plan_bind(group)
        if args.dry_run:
            emit(args, {"dry_run": True, "group": group.number, "steps": plan}, lambda d: print("\n".join(d["steps"])))
            return 0
        res = binder.bind_group(group)
    else:
        originals = {str(a): (args.driver or "*") for a in group.addresses}
        plan = binder.plan_release(group, originals)
        if args.dry_run:
            emit(args, {"dry_run": True, "group": group.number, "steps": plan}, lambda d: print("\n".join(d["steps"])))
            return 0
        res = binder.release_group(group, originals)
    data = {"ok": res.ok, "group": group.number, "error": res.error, "drivers": res.drivers,
            "steps": [s.to_dict() for s in res.steps], "needs_attention": res.needs_attention}

    def human(d: dict[str, Any]) -> None:
        for s in d["steps"]:
            print(f"{'ok ' if s['ok'] else 'FAIL'} {s['name']:<22} {s['address']}" + (f"  {s['error']}" if s["error"] else ""))
        print(("done: " if d["ok"] else "failed: ") + (d["error"] or ", ".join(f"{a}={v}" for a, v in d["drivers"].items())))

    emit(args, data, human)
    return 0 if res.ok else 1


def register(sub: Any) -> None:
    """Add `vfio bind` and `vfio release`."""
    p = sub.add_parser("vfio", help="bind a device's whole IOMMU group to vfio-pci, or give it back")
    vsub = p.add_subparsers(dest="vfio_command", metavar="ACTION", required=True)
    for name, helptext in (("bind", "move every function of ADDR's IOMMU group to vfio-pci (read back)"),
                           ("release", "give every function of ADDR's group back to its host driver (read back)")):
        q = vsub.add_parser(name, help=helptext, description=helptext)
        add_common_options(q)
        q.add_argument("address", help="PCI address, e.g. 0000:3b:00.0")
        q.add_argument("--dry-run", action="store_true", help="print the sysfs steps, change nothing")
        if name == "bind":
            q.add_argument("--force", action="store_true", help="bind even a non-viable group (expert use)")
        else:
            q.add_argument("--driver", help="driver to expect back (default: whatever the kernel probes)")
        q.set_defaults(func=cmd_vfio)
