"""Operator subcommands beyond the basics: vfio, attach/detach, db, model, reaper, topology, probe, bench."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

from hostagent.domain.errors import InvalidInput, NotFound

Adder = Callable[..., None]


def _gpu_for_address(inv: Any, text: str) -> Any:
    from hostagent.domain.pci import PciAddress

    addr = PciAddress.parse(text)
    for g in inv.gpus:
        if any(f.address == addr for f in g.functions):
            return g
    for f in inv.functions:
        if f.address == addr:
            return None
    raise NotFound(f"no PCI device at {addr} (see `hostagent gpus`)", field="address")


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
    from hostagent.cli import emit, settings_for
    from hostagent.host.binding import VfioBinder
    from hostagent.host.sysfs import open_sysfs
    from hostagent.runtime import discover_host

    settings = settings_for(args)
    inv = discover_host(settings)
    group = _group_for_address(inv, args.address)
    binder = VfioBinder(open_sysfs(settings.host.sysfs_root), settings.dev_root, settings.host.step_timeout_s)
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


def cmd_attach(args: argparse.Namespace) -> int:
    """Attach (or detach) a GPU's functions to a domain directly, outside the lease flow (operator tool)."""
    from hostagent.cli import emit, settings_for
    from hostagent.domain.hostdev import free_guest_slots, hostdevs_for_gpu
    from hostagent.runtime import discover_host, open_hypervisor

    settings = settings_for(args)
    inv = discover_host(settings)
    gpu = next((g for g in inv.gpus if args.gpu in (g.id, str(g.address))), None)
    if gpu is None:
        raise NotFound(f"no GPU {args.gpu!r}; `hostagent gpus` lists them", field="gpu")
    if not gpu.viable:
        raise InvalidInput(f"GPU {gpu.id} is not leasable: {gpu.unviable_reason}", field="gpu")
    detach = args.command == "detach"

    async def go() -> dict[str, Any]:
        hv = open_hypervisor(settings)
        try:
            dom = await hv.get_domain(args.domain)
            if detach:
                attached = await hv.attached_hostdevs(dom.uuid)
                mine = [h for h in attached if any(h.source == f.address for f in gpu.functions)]
                if not mine:
                    raise InvalidInput(f"GPU {gpu.id} is not attached to {dom.name}", field="gpu")
                xml = [h.to_xml() for h in mine]
                if args.dry_run:
                    return {"dry_run": True, "domain": dom.name, "xml": xml}
                res = await hv.detach_hostdevs(dom.uuid, mine, settings.libvirt.detach_timeout_s)
                return {"domain": dom.name, "xml": xml, "confirmed": bool(res.confirmed)}
            for f in gpu.functions:
                if f.driver != "vfio-pci" and not args.dry_run:
                    raise InvalidInput(f"{f.address} is on {f.driver or 'no driver'}, not vfio-pci: run "
                                       f"`hostagent vfio bind {gpu.address}` first", field="gpu")
            slot = free_guest_slots(await hv.domain_xml(dom.uuid, live=dom.state == "running"),
                                    settings.libvirt.guest_bus, 1)[0]
            hds = hostdevs_for_gpu([f.address for f in gpu.functions], settings.libvirt.guest_bus, slot,
                                   rom_bar_off=settings.host.rom_bar_off, driver_vfio=settings.host.driver_vfio)
            xml = [h.to_xml() for h in hds]
            if args.dry_run:
                return {"dry_run": True, "domain": dom.name, "xml": xml}
            await hv.attach_hostdevs(dom.uuid, hds)
            return {"domain": dom.name, "xml": xml, "attached": True}
        finally:
            await hv.close()

    data = asyncio.run(go())
    emit(args, data, lambda d: print("\n".join(d["xml"]) + ("\n(dry run: nothing changed)" if d.get("dry_run") else "")))
    return 0 if data.get("confirmed", True) else 1


def register(sub: Any, common: Adder, client: Adder) -> None:
    """Add these subcommands to the main parser."""
    p = sub.add_parser("vfio", help="bind a device's whole IOMMU group to vfio-pci, or give it back")
    vsub = p.add_subparsers(dest="vfio_command", metavar="ACTION", required=True)
    for name, helptext in (("bind", "move every function of ADDR's IOMMU group to vfio-pci (read back)"),
                           ("release", "give every function of ADDR's group back to its host driver (read back)")):
        q = vsub.add_parser(name, help=helptext, description=helptext)
        common(q)
        q.add_argument("address", help="PCI address, e.g. 0000:3b:00.0")
        q.add_argument("--dry-run", action="store_true", help="print the sysfs steps, change nothing")
        if name == "bind":
            q.add_argument("--force", action="store_true", help="bind even a non-viable group (expert use)")
        else:
            q.add_argument("--driver", help="driver to expect back (default: whatever the kernel probes)")
        q.set_defaults(func=cmd_vfio)
    for name, helptext in (("attach", "attach a GPU (already on vfio-pci) to a domain as <hostdev>s"),
                           ("detach", "detach a GPU's <hostdev>s from a domain and wait for DEVICE_REMOVED")):
        q = sub.add_parser(name, help=helptext, description=helptext)
        common(q)
        q.add_argument("--domain", required=True, help="VM name or UUID")
        q.add_argument("--gpu", required=True, help="GPU id or PCI address")
        q.add_argument("--dry-run", action="store_true", help="print the hostdev XML, change nothing")
        q.add_argument("--libvirt-uri", help="override libvirt.uri")
        q.set_defaults(func=cmd_attach)
    for extra in EXTRA:
        extra(sub, common, client)


EXTRA: list[Callable[[Any, Adder, Adder], None]] = []


def _builtin_extras() -> None:
    from hostagent import cli_bench, cli_model, cli_ops, cli_topology

    EXTRA.extend([cli_ops.register, cli_model.register, cli_topology.register, cli_bench.register])


_builtin_extras()
