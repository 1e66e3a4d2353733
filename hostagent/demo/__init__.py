"""`hostagent demo`: the real agent on a simulated host (fake sysfs + fake kernel, simulated hypervisor, SQLite).

By default the demo lives: before it serves it writes some days of past usage by running its simulated guests
against the real agent on a fast clock (:mod:`hostagent.demo.history`) and trains the placement model from it;
while it serves, the same guests lease, heartbeat, queue, finish and forget GPUs through the guest agent's code
(:mod:`hostagent.demo.guests`). ``--quiet`` serves an idle host, as an operator's own first start would be.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hostagent.config import load_settings, settings_without_file
from hostagent.store.journal import Journal
from hostagent.web.auth import hash_token, new_token

DEMO_VMS = ("vm-alpha", "vm-bravo", "vm-charlie", "vm-delta", "vm-echo", "vm-foxtrot")
CREDENTIALS = "demo-credentials.json"


# The living demo's detector: a forgotten GPU is warned within a minute or two of going idle and reclaimed a
# minute later, so a visitor sees it happen (an operator's defaults are an hour and twenty minutes).
LIVING_RECLAIM = {"check_interval_s": 45.0, "grace_s": 45.0, "min_lease_age_s": 60.0, "notice_window_s": 15.0}
FAST_RECLAIM = {"check_interval_s": 10.0, "grace_s": 10.0, "min_lease_age_s": 5.0, "notice_window_s": 5.0}
HISTORY_MARKER = "demo-history.json"


def prepare_demo(state_dir: Path, *, scenario: str = "demo16", db: str | None = None, port: int = 8470,
                 listen: str = "127.0.0.1", config: str | None = None, fast_reclaim: bool = False,
                 living: bool = False, host_id: str = "demo-host",
                 operator_token: str | None = None) -> tuple[Any, dict[str, Any]]:
    """Build (or reuse) the simulated host in state_dir; return settings and the credentials document. `living`:
    the detector's periods scaled down to minutes (`fast_reclaim`: to seconds). `operator_token`: the one a new
    credentials file gets (the hosts of a fleet demo share one), else a new one."""
    from hostagent.host.discovery import numa_cells
    from hostagent.host.fakesysfs import build_tree
    from hostagent.host.sysfs import Sysfs
    from hostagent.virt.sim import SimulatedHypervisor

    state_dir.mkdir(parents=True, exist_ok=True)
    host_dir = state_dir / "host"
    if not (host_dir / "sys").exists():
        build_tree(host_dir, scenario)
    hv_path = state_dir / "hypervisor.json"
    if not hv_path.exists():
        hv = SimulatedHypervisor(path=hv_path, attach_latency_s=0.05, detach_ack_delay_s=0.2)
        # On a host of two NUMA nodes the VMs are pinned as an operator pins them: half to each node, every third
        # left unpinned (placement then says it does not know where that one runs).
        nodes = len(numa_cells(Sysfs(host_dir / "sys")))
        for i, name in enumerate(DEMO_VMS):
            hv.define(name, running=True, numa_node=(i % 2) if nodes >= 2 and i % 3 != 2 else None)
        hv.save()
    creds_path = state_dir / CREDENTIALS
    overrides: dict[str, dict[str, Any]] = {
        "agent": {"state_dir": str(state_dir), "port": port, "listen": listen, "host_id": host_id},
        "host": {"sysfs_root": str(host_dir / "sys"), "kernel": "fake"},  # the fake kernel answers the tree's writes
        "libvirt": {"uri": f"sim://{hv_path}", "detach_timeout_s": 5.0},
    }
    if db:
        overrides["store"] = {"url": db}
    if fast_reclaim or living:
        overrides["reclaim"] = dict(FAST_RECLAIM if fast_reclaim else LIVING_RECLAIM)
    if creds_path.exists():
        creds = json.loads(creds_path.read_text())
    else:
        hv = SimulatedHypervisor.load(hv_path)
        journal = Journal(state_dir / "journal.sqlite3")
        try:
            vms = []
            for dom in hv.domains_sync():
                token = new_token("vm")
                journal.add_token(hash_token(token), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
                vms.append({"domain": dom.name, "uuid": dom.uuid, "token": token})
        finally:
            journal.close()
        creds = {"operator": {"token": operator_token or new_token("op")}, "vms": vms}
        creds_path.write_text(json.dumps(creds, indent=2) + "\n")
        os.chmod(creds_path, 0o600)
    overrides["auth"] = {"operator_token_sha256": hash_token(creds["operator"]["token"])}
    # The demo never reads /etc/hostagent: only an explicit --config file (and HOSTAGENT_* variables) add to it.
    settings = load_settings(config, overrides=overrides) if config else settings_without_file(overrides)
    return settings, creds


FLEET_TOKEN_ENV = "HOSTAGENT_DEMO_OPERATOR_TOKEN"  # the fleet demo's shared operator token, parent to children


def run_demo(args: argparse.Namespace) -> int:
    """Prepare the demo host (and, unless --quiet, its history and model), print how to use it, and serve until
    interrupted, with the simulated guests at work unless --quiet. With --hosts N, N such hosts share the --db
    store (this process is the first; the others run as child processes, stopped with it)."""
    from hostagent.runtime import serve

    if args.history_days < 0:
        raise SystemExit("hostagent demo: --history-days must be 0 or more")
    if args.hosts < 1:
        raise SystemExit("hostagent demo: --hosts must be 1 or more")
    if args.hosts > 1 and not args.db:
        raise SystemExit("hostagent demo: --hosts N runs a fleet over one shared store: give it --db URL "
                         "(e.g. mysql+pymysql://root@127.0.0.1/hostagent_demo)")
    living = not args.quiet
    root = (args.state_dir or Path(tempfile.mkdtemp(prefix="hostagent-demo-"))).resolve()
    host_id = args.host_id or ("demo-host" if args.hosts == 1 else "demo-host-1")
    state_dir = root if args.hosts == 1 else root / host_id
    token = os.environ.get(FLEET_TOKEN_ENV) or (new_token("op") if args.hosts > 1 else None)
    settings, creds = prepare_demo(state_dir, scenario=args.scenario, db=args.db, port=args.port,
                                   listen=args.listen, config=args.config, fast_reclaim=args.fast_reclaim,
                                   living=living, host_id=host_id, operator_token=token)
    others = start_fleet(args, root, creds["operator"]["token"]) if args.hosts > 1 else []
    try:
        if living and args.history_days > 0:
            seed_history(settings, creds, state_dir, days=args.history_days, seed=1 if args.seed is None else args.seed)
        vm = creds["vms"][0]
        banner = "\n".join([
            "hostagent demo: a simulated host with GPUs, the real agent, API and dashboard.",
            f"  state directory : {settings.state_dir}",
            f"  credentials     : {settings.state_dir / CREDENTIALS}",
            f"  operator token  : {creds['operator']['token']}",
            ("  guests          : " + ", ".join(v["domain"] for v in creds["vms"])
             + " lease, use and give back GPUs on their own (--quiet: an idle host)") if living else
            "  guests          : none at work (--quiet); lease with the tokens in the credentials file",
            *([f"  fleet           : {args.hosts} hosts on {args.db} (the others log to {root}/demo-host-N/demo.log); "
               "the Fleet page shows them all"] if others else []),
            "",
            "Try:",
            f"  curl -s -H 'Authorization: Bearer {vm['token']}' {{url}}/v1/gpus",
            f"  curl -s -X POST -H 'Authorization: Bearer {vm['token']}' -H 'Content-Type: application/json' \\",
            "       -d '{\"gpus\": 1, \"task_type\": \"training\"}' {url}/v1/leases",
            "  dashboard: {url}/  (log in with the operator token)",
            "Ctrl-C stops it.",
        ])

        async def guests(url: str) -> None:
            from hostagent.demo.guests import run_live

            await run_live(url, creds, settings.proc_root, seed=args.seed)

        return serve(settings, banner=banner, on_serving=guests if living else None)
    finally:
        stop_fleet(others)


def start_fleet(args: argparse.Namespace, root: Path, operator_token: str) -> list[Any]:
    """Hosts 2..N of a fleet demo, each `hostagent demo` in its own process over the same store."""
    import subprocess
    import sys

    procs = []
    for i in range(2, args.hosts + 1):
        host_id = f"demo-host-{i}"
        (root / host_id).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "hostagent", "demo", "--state-dir", str(root / host_id), "--host-id", host_id,
               "--db", args.db, "--port", str(args.port + i - 1 if args.port else 0), "--listen", args.listen,
               "--scenario", args.scenario, "--history-days", str(args.history_days),
               "--seed", str((args.seed or 0) + i)]
        cmd += ["--quiet"] if args.quiet else []
        cmd += ["--fast-reclaim"] if args.fast_reclaim else []
        cmd += ["--config", args.config] if args.config else []
        log = open(root / host_id / "demo.log", "a", encoding="utf-8")  # noqa: SIM115 - the child writes it
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      env=dict(os.environ, **{FLEET_TOKEN_ENV: operator_token})))
        log.close()
    return procs


def stop_fleet(procs: list[Any]) -> None:
    """Stop the fleet demo's other hosts (SIGTERM, then SIGKILL after 20 s)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except Exception:
            p.kill()


def seed_history(settings: Any, creds: dict[str, Any], state_dir: Path, *, days: float, seed: int = 1) -> dict[str, Any]:
    """Write the demo's past (once per state directory) and train the model from it; returns what was done."""
    import asyncio

    from hostagent.demo.history import train_model, write_history
    from hostagent.virt.sim import SimulatedHypervisor

    marker = state_dir / HISTORY_MARKER
    if marker.exists():
        return dict(json.loads(marker.read_text()))
    print(f"hostagent demo: writing {days:g} days of past usage (the simulated guests on a fast clock)...", flush=True)
    hv_path = state_dir / "hypervisor.json"
    live = SimulatedHypervisor.load(hv_path)
    latencies = {"attach_latency_s": live.attach_latency_s, "detach_ack_delay_s": live.detach_ack_delay_s}
    done = asyncio.run(write_history(settings, creds, hv_path, days=days, seed=seed))
    hv = SimulatedHypervisor.load(hv_path, **latencies)  # the live guests take their time again
    hv.save()
    done["model"] = train_model(settings)
    print(f"hostagent demo: {done['leases']} leases in {done['wall_s']:g} s ({done['reclaimed']} reclaimed idle, "
          f"{done['queued']} queued, {done['booked']} booked ahead); placement model: {done['model'].get('decision')} "
          f"{done['model'].get('version') or ''}".rstrip(), flush=True)
    marker.write_text(json.dumps(done, indent=2) + "\n")
    return done
