"""`hostagent reaper status|pause|resume`: idle reclaim through the agent's API: every lease's strike state and
next check; pause or resume reclaim on one lease.
"""

from __future__ import annotations

import argparse
from typing import Any

from hostagent.cli.common import add_client_options, api, emit, fmt_time, table


def cmd_reaper_status(args: argparse.Namespace) -> int:
    """Every lease's strike state and next check."""
    _, body = api(args, "GET", "/v1/reaper")

    def human(b: dict[str, Any]) -> None:
        print(f"reaper {'on' if b['enabled'] else 'OFF'}: check every {b['check_interval_s']:g} s, "
              f"grace {b['grace_s']:g} s, notice window {b['notice_window_s']:g} s")
        signal = b.get("host_signal") or {}
        if signal and not signal.get("trusted"):
            print(f"host interrupt counters NOT trusted ({signal.get('why_not')}): a lease without guest heartbeats "
                  "is never judged idle")
        rows = [{"lease": x["lease_id"], "vm": x["domain"], "gpus": ",".join(x["gpus"]), "state": x["state"],
                 "strike": x["strike"] + (" (paused)" if x["paused"] else ""), "recheck": fmt_time(x["recheck_at"]),
                 "next": fmt_time(x["next_check"]),
                 "verdict": (x["last_verdict"] or {}).get("reason", "-")} for x in b["leases"]]
        if rows:
            table(rows, [("lease", "LEASE"), ("vm", "VM"), ("gpus", "GPUS"), ("state", "STATE"), ("strike", "STRIKE"),
                         ("recheck", "RECHECK"), ("next", "NEXT CHECK"), ("verdict", "LAST VERDICT")])
        else:
            print("no active leases")
        for x in b["leases"]:
            if x.get("disputed"):
                print(f"DISPUTED {x['lease_id']} ({x['domain']}): {x['disputed']}")

    emit(args, body, human)
    return 0


def cmd_reaper_pause(args: argparse.Namespace) -> int:
    """Pause or resume idle reclaim on one lease."""
    _, body = api(args, "POST", f"/v1/leases/{args.lease_id}/reclaim", {"paused": args.reaper_command == "pause"})
    emit(args, body, lambda b: print(f"lease {b['id']}: reclaim {'paused' if b['reclaim']['paused'] else 'resumed'}"))
    return 0


def register(sub: Any) -> None:
    """Add `reaper status`, `reaper pause` and `reaper resume`."""
    p = sub.add_parser("reaper", help="idle reclaim: strike state of every lease; pause/resume a lease")
    rsub = p.add_subparsers(dest="reaper_command", metavar="ACTION", required=True)
    q = rsub.add_parser("status", help="every lease's strike state and next check")
    add_client_options(q)
    q.set_defaults(func=cmd_reaper_status)
    for name in ("pause", "resume"):
        q = rsub.add_parser(name, help=f"{name} idle reclaim on one lease (operator)")
        add_client_options(q)
        q.add_argument("lease_id")
        q.set_defaults(func=cmd_reaper_pause)
