"""`hostagent leases` (list leases) and `hostagent release LEASE` (end one), through the agent's API."""

from __future__ import annotations

import argparse
from typing import Any

from hostagent.cli.common import EXIT_OK, add_client_options, api, emit, fmt_time, table


def lease_rows(leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flatten lease JSON for a table (a booking shows its GPUs and when it starts)."""
    return [{"id": x["id"], "state": x["state"], "vm": x["domain"]["name"],
             "gpus": ",".join(d["gpu_id"] for d in x["devices"]) or (
                 ",".join((x.get("booking") or {}).get("gpus") or []) if x["state"] == "BOOKED" else "") or "-",
             "task": x["request"]["task_type"],
             "prio": x["request"]["priority"], "expires": fmt_time(x.get("expires_at")),
             "note": (x["warnings"][0]["code"] if x.get("warnings") else x.get("end_reason") or (
                 f"starts {fmt_time(x['booking']['start_at'])}" if x["state"] == "BOOKED" and x.get("booking")
                 else ""))}
            for x in leases]


def cmd_leases(args: argparse.Namespace) -> int:
    """List leases through the API."""
    q = []
    if args.state:
        q.append(f"state={args.state}")
    if args.since is not None:
        q.append(f"since={args.since}")
    _, body = api(args, "GET", "/v1/leases" + ("?" + "&".join(q) if q else ""))
    emit(args, body, lambda b: table(lease_rows(b["leases"]), [("id", "ID"), ("state", "STATE"), ("vm", "VM"),
         ("gpus", "GPUS"), ("task", "TASK"), ("prio", "PRIO"), ("expires", "EXPIRES"), ("note", "NOTE")]))
    return EXIT_OK


def cmd_release(args: argparse.Namespace) -> int:
    """Release a lease through the API."""
    status, body = api(args, "DELETE", f"/v1/leases/{args.lease_id}", ok=(200, 202))
    emit(args, body, lambda b: print(f"lease {b['id']}: {b['state']}"
                                     + (" (detach not acknowledged yet; GPU stays on vfio-pci)" if status == 202 else "")))
    return EXIT_OK


def cmd_move(args: argparse.Namespace) -> int:
    """Make-before-break move of a lease's GPU, through the API."""
    body: dict[str, Any] = {"to": args.to, "deadline_s": args.deadline}
    if args.from_gpu:
        body["from"] = args.from_gpu
    _, lease = api(args, "POST", f"/v1/leases/{args.lease_id}/move", body, ok=(202,))
    mv = lease.get("move") or {}
    emit(args, lease, lambda b: print(f"lease {b['id']}: {mv.get('to')} attached beside {mv.get('from')}; the guest "
                                      f"has until {fmt_time(mv.get('deadline'))} to move its work (it confirms, or "
                                      f"{mv.get('from')} is detached then)"))
    return EXIT_OK


def register(sub: Any) -> None:
    """Add `leases`, `release` and `lease move`."""
    p = sub.add_parser("leases", help="list leases (through the agent's API)")
    add_client_options(p)
    p.add_argument("--state", help="comma-separated states, e.g. ACTIVE,QUEUED (BOOKED: the bookings ahead)")
    p.add_argument("--since", type=float, help="unix seconds")
    p.set_defaults(func=cmd_leases)

    p = sub.add_parser("release", help="end a lease (through the agent's API)")
    add_client_options(p)
    p.add_argument("lease_id")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("lease", help="act on one lease (through the agent's API)")
    lsub = p.add_subparsers(dest="lease_command", metavar="ACTION", required=True)
    q = lsub.add_parser("move", help="make-before-break: attach another GPU beside one of the lease's, tell the guest, "
                                     "then detach the old one (on its confirmation or at the deadline)")
    add_client_options(q)
    q.add_argument("lease_id")
    q.add_argument("--to", required=True, metavar="GPU", help="the GPU that takes the old one's place")
    q.add_argument("--from", dest="from_gpu", metavar="GPU", help="the lease's GPU that leaves (when it has several)")
    q.add_argument("--deadline", type=int, default=300, metavar="SECONDS",
                   help="how long the guest has to move its work (default 300)")
    q.set_defaults(func=cmd_move)
