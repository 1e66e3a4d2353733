"""`hostagent model train|evaluate|show|rollback|simulate`: the placement model's lifecycle over the usage store,
and the offline simulator (`hostagent.cli.parser.main` hands `model simulate ...` to the simulator's own parser
before argparse sees it; the `simulate` entry here lists it in the help and forwards when the parser is used alone).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from hostagent.cli.common import add_common_options, emit, settings_for, table


def _store(args: argparse.Namespace) -> tuple[Any, Any]:
    from hostagent.store.repo import UsageStore

    s = settings_for(args)
    return s, UsageStore(s.store_url, s.agent.host_id, spool_path=s.spool_path, auto_upgrade=s.store.auto_upgrade)


def cmd_model(args: argparse.Namespace) -> int:
    """train | evaluate | show | matrix | rollback."""
    from hostagent.learn import lifecycle

    settings, store = _store(args)
    try:
        if args.model_command == "train":
            res = lifecycle.train(store, target=args.target or settings.placement.outcome,
                                  min_records=args.min_records or settings.placement.min_records)
            data = res.to_dict()
            follow = f"\nactive model: {res.version}{_followed(settings)}" if res.decision == "promoted" else ""
            emit(args, data, lambda d: print(f"{d.get('decision')}: version {d.get('version') or '-'}\n"
                                             + "\n".join(f"  {k}: {v}" for k, v in d.get("metrics", {}).items())
                                             + follow))
            return 0
        if args.model_command == "evaluate":
            data = lifecycle.evaluate(store, args.version)
            emit(args, data, lambda d: print("\n".join(f"{k:>16}: {v}" for k, v in d.items())))
            return 0
        if args.model_command == "show":
            rows = lifecycle.show(store, limit=args.limit)
            emit(args, {"versions": rows}, lambda d: table(
                [dict(r, active="*" if r["active"] else "") for r in d["versions"]] or [{"version": "(none yet)"}],
                [("active", "ACT"), ("version", "VERSION"), ("decision", "DECISION"), ("trained_on", "RECORDS"),
                 ("error", "ERROR"), ("rank_accuracy", "RANK ACC"), ("reason", "REASON")]))
            return 0
        if args.model_command == "matrix":
            data = lifecycle.matrix(store, args.version)
            emit(args, data, lambda d: (print(f"version {d['version']}: relative work rate per task type and GPU model "
                                              f"(1 = the task type's typical device); sd in log space"), table(
                [dict(c, range=f"{c['rate'] * math.exp(-c['sd']):.3g}..{c['rate'] * math.exp(c['sd']):.3g}")
                 for c in d["cells"]] or [{"task": "(no work-rate records)"}],
                [("task", "TASK"), ("model", "GPU MODEL"), ("rate", "RATE"), ("range", "+-1 SD"), ("n", "LEASES"),
                 ("source", "FROM")])))
            return 0
        data = lifecycle.rollback(store, args.version)
        emit(args, data, lambda d: print(f"active model: {d['active']} (was {d['previous']}){_followed(settings)}"))
        return 0
    finally:
        store.close()


def _followed(settings: Any) -> str:
    """When a running agent on this store switches to the newly active model (services.model_follow)."""
    return (f"; a running agent switches to it at its next model check (every "
            f"{settings.placement.model_check_interval_s:g} s, placement.model_check_interval_s)")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Forward to the simulator's own argument parser."""
    from hostagent.learn.simulate import main

    return main(args.sim_args)


def _store_action(msub: Any, name: str, helptext: str) -> argparse.ArgumentParser:
    """A `model` action over the usage store: the common options and --db, run by cmd_model."""
    q: argparse.ArgumentParser = msub.add_parser(name, help=helptext)
    add_common_options(q, host=False)
    q.add_argument("--db", help="store URL (default from config)")
    q.set_defaults(func=cmd_model)
    return q


def register(sub: Any) -> None:
    """Add `model` subcommands."""
    p = sub.add_parser("model", help="placement model: train, evaluate, show, rollback, simulate")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    q = _store_action(msub, "train", "train on the store's records, every host's (on a store the fleet shares: one "
                                     "fleet model); promote unless worse than the active model beyond the recent "
                                     "records' noise (every agent on the store follows the active model within "
                                     "placement.model_check_interval_s)")
    q.add_argument("--target", choices=["work_rate", "utilization", "completion"], help="outcome to predict")
    q.add_argument("--min-records", type=int, help="labelled records needed (default placement.min_records)")
    _store_action(msub, "evaluate", "figures of a version (default: the active one) on recent records").add_argument(
        "version", nargs="?")
    _store_action(msub, "show", "model versions with their figures and decisions").add_argument(
        "--limit", type=int, default=20, help="how many versions, newest first (default 20)")
    _store_action(msub, "matrix", "the learned throughput matrix of a version (default: the active one): each task "
                                  "type's relative rate on each GPU model, with its uncertainty").add_argument(
        "version", nargs="?")
    _store_action(msub, "rollback", "activate a version (default: the previously promoted one); a running agent "
                                    "follows it within placement.model_check_interval_s").add_argument(
        "version", nargs="?")
    q = msub.add_parser("simulate", add_help=False,
                        help="offline evaluation harness (see `hostagent model simulate --help`)")
    q.add_argument("sim_args", nargs=argparse.REMAINDER)
    q.set_defaults(func=cmd_simulate)
