"""`hostagent topology`: the free-block picture (PCIe/NUMA/NVLink tree, which GPUs are free, the best set per
size) from the agent's API, or with `--local` from sysfs (no agent needed; GPUs on vfio-pci count as taken).
"""

from __future__ import annotations

import argparse
from typing import Any

from hostagent.cli.common import add_client_options, api, emit, settings_for


def _print_tree(block: dict[str, Any], states: dict[str, str], indent: str = "") -> None:
    label = {"host": "host", "numa-node": "NUMA", "root-complex": "root complex", "switch": "switch"}[block["kind"]]
    print(f"{indent}{label} {block['id']}: {block['free']}/{block['size']} free" + (" (intact)" if block["intact"] and block["size"] > 1 else ""))
    if block.get("children"):
        for c in block["children"]:
            _print_tree(c, states, indent + "  ")
    else:
        marks = "  ".join(f"{g}[{'.' if states.get(g) == 'free' else states.get(g, '?')[:1].upper()}]" for g in block["gpus"])
        print(f"{indent}  {marks}")


def human_topology(body: dict[str, Any]) -> None:
    """Print the tree, the best set per size and the NVLink cliques."""
    states = {g["id"]: g["state"] for g in body["gpus"]}
    _print_tree(body["tree"], states)
    print("GPU marks: [.] free  [L] leased  [Q] quarantined  [W] warned  [D] detach-pending  [P] probing  "
          "[U] unavailable")
    if body.get("nvlink"):
        print("NVLink cliques: " + "; ".join(" ".join(c) for c in body["nvlink"]))
    print(f"free: {body['free']['count']} GPU(s), block capacity {body['free']['capacity']:.0%}")
    for n, best in body["free"]["best_sets"].items():
        if best is None:
            print(f"  {n:>2} GPU(s): no set free now")
        elif best["distance"] is None:
            print(f"  {n:>2} GPU(s): {', '.join(best['gpus'])}")
        else:
            print(f"  {n:>2} GPU(s): within {best['distance_name']} (distance {best['distance']}): {', '.join(best['gpus'])}")


def cmd_topology(args: argparse.Namespace) -> int:
    """The free-block picture from the agent (or from sysfs with --local)."""
    if args.local:
        from hostagent.adapters import discover_host
        from hostagent.services.topology import load_topology, topology_view

        settings = settings_for(args)
        inv = discover_host(settings)
        topo = load_topology(inv.gpus, settings.host.nvlink_hints)
        states = {g.id: ("leased" if g.primary.driver == "vfio-pci" else "free" if g.viable else "unavailable")
                  for g in inv.gpus}
        emit(args, topology_view(topo, states), human_topology)
        return 0
    _, body = api(args, "GET", "/v1/topology")
    emit(args, body, human_topology)
    return 0


def register(sub: Any) -> None:
    """Add `topology`."""
    p = sub.add_parser("topology", help="PCIe/NUMA/NVLink topology with free blocks and the best set per size",
                       description="The free-block picture: NUMA nodes, root complexes, switches, which GPUs are "
                                   "free, and the set the agent would choose now for 1, 2, 4, 8 GPUs.")
    add_client_options(p)
    p.add_argument("--local", action="store_true", help="read sysfs instead of asking the agent")
    p.add_argument("--sysfs-root", metavar="DIR", help="with --local: sysfs root to read (default /sys)")
    p.set_defaults(func=cmd_topology)
