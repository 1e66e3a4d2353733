"""`hostagent gpus` (this host's GPUs and their IOMMU groups, read from sysfs) and `hostagent gpu clear` (clear a
GPU's quarantine through the agent's API). Two registrations, because `hostagent --help` lists `gpu` after the
lease commands.
"""

from __future__ import annotations

import argparse
from typing import Any

from hostagent.cli.common import (EXIT_OK, add_client_options, add_common_options, api, emit,
                                  settings_for, table)


def gpu_row(g: Any, state: str | None = None) -> dict[str, Any]:
    """A GPU as a JSON/table row (matches GET /v1/gpus)."""
    return {**g.to_dict(), "state": state or ("free" if g.viable else "unavailable")}


def _gib(n: int | None) -> str:
    return "?" if not n else f"{n / 1024**3:.0f} GiB"


def cmd_gpus(args: argparse.Namespace) -> int:
    """List the GPUs of this host from sysfs."""
    from hostagent.adapters import discover_host

    inv = discover_host(settings_for(args))
    rows = [gpu_row(g) for g in inv.gpus]

    def human(data: dict[str, Any]) -> None:
        rows = data["gpus"]
        if not rows:
            print("no GPUs found (vendors: see host.gpu_vendors; sysfs root: %s)" % settings_for(args).host.sysfs_root)
            return
        table([dict(r, memory=_gib(r["memory_bytes"]), functions_n=len(r["functions"]),
                    drivers=",".join(sorted({f["driver"] or "-" for f in r["functions"]})),
                    viable_s="yes" if r["viable"] else f"no: {r['unviable_reason']}") for r in rows],
              [("id", "ID"), ("address", "ADDRESS"), ("model", "MODEL"), ("memory", "MEMORY"), ("numa_node", "NUMA"),
               ("iommu_group", "GROUP"), ("functions_n", "FUNCS"), ("drivers", "DRIVERS"), ("viable_s", "LEASABLE")])

    emit(args, {"gpus": rows}, human)
    return EXIT_OK


def cmd_gpu_clear(args: argparse.Namespace) -> int:
    """Clear a GPU's quarantine through the API."""
    _, body = api(args, "POST", f"/v1/gpus/{args.gpu_id}/clear-quarantine", {})
    emit(args, body, lambda b: print(f"{b['id']}: {b['state']}"))
    return EXIT_OK


def register(sub: Any) -> None:
    """Add `gpus`."""
    p = sub.add_parser("gpus", help="list this host's GPUs and their IOMMU groups (from sysfs)",
                       description="Discover GPUs from sysfs (read-only) with every function of their IOMMU group.")
    add_common_options(p)
    p.set_defaults(func=cmd_gpus)


def register_actions(sub: Any) -> None:
    """Add `gpu clear`."""
    p = sub.add_parser("gpu", help="operator actions on one GPU")
    gsub = p.add_subparsers(dest="gpu_command", metavar="ACTION")
    q = gsub.add_parser("clear", help="clear a GPU's quarantine so placement may use it again")
    add_client_options(q)
    q.add_argument("gpu_id")
    q.set_defaults(func=cmd_gpu_clear)
