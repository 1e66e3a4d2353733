"""`hostagent attach|detach --domain VM --gpu GPU`: hot-plug a GPU's functions into a domain as <hostdev>s, or
unplug them and wait for DEVICE_REMOVED, directly through the hypervisor, outside the lease flow (an operator
tool; `--dry-run` prints the XML).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from hostagent.cli.common import add_common_options, emit, settings_for
from hostagent.domain.errors import InvalidInput, NotFound


def cmd_attach(args: argparse.Namespace) -> int:
    """Attach (or detach) a GPU's functions to a domain directly, outside the lease flow (operator tool)."""
    from hostagent.domain.hostdev import free_guest_slots, guest_slots_needed, hostdevs_for_layout
    from hostagent.adapters import discover_host, open_hypervisor

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
            # host.guest_layout, as for a lease: `auto` (the default) is what libvirt can hot-plug and unplug
            layout = settings.host.guest_layout
            needed = guest_slots_needed(layout, len(gpu.functions))
            slots = free_guest_slots(await hv.domain_xml(dom.uuid, live=dom.state == "running"),
                                     settings.libvirt.guest_bus, needed) if needed else ()
            hds = hostdevs_for_layout([f.address for f in gpu.functions], layout, settings.libvirt.guest_bus, slots,
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


def register(sub: Any) -> None:
    """Add `attach` and `detach`."""
    for name, helptext in (("attach", "attach a GPU (already on vfio-pci) to a domain as <hostdev>s"),
                           ("detach", "detach a GPU's <hostdev>s from a domain and wait for DEVICE_REMOVED")):
        q = sub.add_parser(name, help=helptext, description=helptext)
        add_common_options(q)
        q.add_argument("--domain", required=True, help="VM name or UUID")
        q.add_argument("--gpu", required=True, help="GPU id or PCI address")
        q.add_argument("--dry-run", action="store_true", help="print the hostdev XML, change nothing")
        q.add_argument("--libvirt-uri", help="override libvirt.uri")
        q.set_defaults(func=cmd_attach)
