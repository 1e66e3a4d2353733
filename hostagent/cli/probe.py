"""`hostagent probe GPU`: probe a free GPU now through the agent's API (compute throughput, memory bandwidth,
health signals) and print its report; exit status 1 when the GPU is not OK.
"""

from __future__ import annotations

import argparse
from typing import Any

from hostagent.cli.common import add_client_options, api, emit


def human_probe(b: dict[str, Any]) -> None:
    """Print one probe report."""
    score = "no score" if b["score"] is None else f"score {b['score']:.3f} ± {b['spread'] or 0:.3f} ({b['score_basis']})"
    print(f"{b['gpu_id']} ({b['model']}): {'OK' if b['ok'] else 'NOT OK'}, {score}")
    for k, v in sorted(b.get("metrics", {}).items()):
        print(f"  {k:<22} {v:g}")
    for runner, signals in sorted(b.get("health", {}).items()):
        print(f"  {runner}: " + ", ".join(f"{k}={v}" for k, v in sorted(signals.items())))
    for p in b.get("problems", []):
        print(f"  PROBLEM: {p}")
    for w in b.get("warnings", []):
        print(f"  warning: {w}")
    if b.get("note"):
        print(f"  note: {b['note']}")
    if b.get("quarantined"):
        print(f"  QUARANTINED: {b['quarantined']}")


def cmd_probe(args: argparse.Namespace) -> int:
    """Probe one GPU now through the agent (it must be free and on its host driver)."""
    _, body = api(args, "POST", f"/v1/gpus/{args.gpu}/probe", {})
    emit(args, body, human_probe)
    return 0 if body["ok"] else 1


def register(sub: Any) -> None:
    """Add `probe`."""
    p = sub.add_parser("probe", help="probe a free GPU now: compute throughput, memory bandwidth, health signals",
                       description="Runs the probe runners available on the host (K runs, median) on a GPU that is "
                                   "free and on its host driver. Exit status 1 when the GPU is not OK.")
    add_client_options(p)
    p.add_argument("gpu", help="GPU id (see `hostagent gpus`)")
    p.set_defaults(func=cmd_probe)
