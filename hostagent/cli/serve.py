"""`hostagent serve` (run the agent on this host; what systemd starts) and `hostagent demo` (run it on a simulated
host: fake sysfs, simulated hypervisor, SQLite), both until interrupted.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hostagent.cli.common import add_common_options, settings_for


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the agent (systemd starts this)."""
    from hostagent.runtime import serve

    return serve(settings_for(args))


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the agent on a simulated host and serve until interrupted."""
    from hostagent.demo import run_demo

    return run_demo(args)


def register(sub: Any) -> None:
    """Add `serve` and `demo`."""
    p = sub.add_parser("serve", help="run the agent (what systemd starts)",
                       description="Run the agent: API, dashboard, reaper, on this host.")
    add_common_options(p)
    p.add_argument("--port", type=int, help="override agent.port")
    p.add_argument("--listen", help="override agent.listen")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="run the agent on a simulated host with GPUs (try it here)",
                       description="Start the agent on a simulated host (fake sysfs, simulated hypervisor, SQLite) "
                                   "and serve the API and dashboard until interrupted.")
    add_common_options(p, host=False)
    p.add_argument("--port", type=int, default=8470, help="port to listen on (0 picks a free one; default 8470)")
    p.add_argument("--listen", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--state-dir", type=Path, help="where to keep state (default: a new temporary directory)")
    p.add_argument("--db", help="usage store URL (default SQLite in the state directory)")
    p.add_argument("--scenario", default="mixed16",
                   help="simulated host: mixed16 (datacenter GPUs and consumer cards whose groups carry audio and "
                        "USB-C functions), demo16, dgx8, workstation (as found), workstation-vfio (prepared); "
                        "default mixed16")
    p.add_argument("--quiet", action="store_true",
                   help="an idle host: no simulated guests at work and no past usage written")
    p.add_argument("--history-days", type=float, default=2.0, metavar="DAYS",
                   help="days of past usage to write before serving, once per state directory (0: none; default 2)")
    p.add_argument("--seed", type=int, default=None, help="seed of the live guests' choices (default: random)")
    p.add_argument("--hosts", type=int, default=1, metavar="N",
                   help="run a fleet: N demo hosts over the one --db store (hosts 2..N as child processes on the "
                        "ports after --port), each with its own dashboard, all on the Fleet page")
    p.add_argument("--host-id", help="this host's id in the store (default demo-host; demo-host-1.. in a fleet)")
    p.add_argument("--fast-reclaim", action="store_true",
                   help="idle reclaim in seconds instead of an hour (minutes in a living demo), to watch it happen")
    p.set_defaults(func=cmd_demo)
