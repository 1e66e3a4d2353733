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
    p.add_argument("--scenario", default="demo16",
                   help="simulated host: demo16, dgx8, workstation (as found), workstation-vfio (prepared); "
                        "default demo16")
    p.add_argument("--fast-reclaim", action="store_true",
                   help="idle reclaim in seconds instead of an hour, to watch it happen")
    p.set_defaults(func=cmd_demo)
