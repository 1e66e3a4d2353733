"""`hostagent bench {all,load,overhead,restart,ingest,rollup,place,dashboard,tenants,fleet}`: run the benchmarks.

The scripts live in the source tree's `scripts/` (benchmarks ship with the repository, not the package); every
argument after the benchmark's name goes to the script unchanged (`hostagent bench load --quick`,
`hostagent bench all --write docs/benchmarks.md`, `hostagent bench restart --help`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
BENCHMARKS = {
    "all": ("bench_all.py", "run every benchmark and regenerate docs/benchmarks.md (--write PAGE)"),
    "load": ("bench_load.py", "200 guests leasing, heartbeating and releasing against 16 GPUs"),
    "overhead": ("bench_overhead.py", "agent time per lease beyond sysfs and hypervisor calls"),
    "restart": ("bench_restart.py", "kill -9 with active leases, time until /readyz is ready"),
    "ingest": ("bench_ingest.py", "heartbeat ingestion throughput vs raw PyMySQL (needs MariaDB)"),
    "rollup": ("bench_rollup_query.py", "dashboard queries over a month of rollups (needs MariaDB)"),
    "place": ("bench_place.py", "placement decision latency with a trained model"),
    "dashboard": ("bench_dashboard.py", "dashboard page timings"),
    "tenants": ("bench_tenants.py", "a well-behaved tenant's latency and errors while another abuses the agent"),
    "fleet": ("bench_fleet.py", "200 hosts x 8 GPUs, each its own store, writing to one MariaDB vs raw executemany"),
}


def script_path(name: str, scripts_dir: Path | None = None) -> Path:
    """The script behind `hostagent bench NAME`."""
    return (scripts_dir or SCRIPTS_DIR) / BENCHMARKS[name][0]


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one benchmark script with the remaining arguments; its exit status is ours."""
    script = script_path(args.benchmark)
    if not script.exists():
        print(f"hostagent: {script} not found: benchmarks run from a source checkout (scripts/ beside hostagent/)",
              file=sys.stderr)
        return 1
    try:
        return subprocess.call([sys.executable, str(script), *args.script_args], cwd=script.parent.parent)
    except KeyboardInterrupt:
        return 130


def register(sub: Any) -> None:
    """Add `hostagent bench NAME [ARGS...]` to the main parser."""
    p = sub.add_parser("bench", help="run a benchmark (scripts/bench_*.py) and print its figures",
                       description="Run a benchmark script from scripts/; arguments after its name go to the "
                                   "script (try `hostagent bench load --help`).")
    bsub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (_script, helptext) in BENCHMARKS.items():
        # prefix_chars="+": every "-x"/"--x" after the name belongs to the script, including --help.
        q = bsub.add_parser(name, help=helptext, description=helptext, prefix_chars="+", add_help=False)
        q.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
        q.set_defaults(func=cmd_bench)
