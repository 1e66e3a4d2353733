"""`hostagent demo`: the real agent on a simulated host (fake sysfs + fake kernel, simulated hypervisor, SQLite)."""

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


def prepare_demo(state_dir: Path, *, scenario: str = "demo16", db: str | None = None, port: int = 8470,
                 listen: str = "127.0.0.1", config: str | None = None, fast_reclaim: bool = False) -> tuple[Any, dict[str, Any]]:
    """Build (or reuse) the simulated host in state_dir; return settings and the credentials document."""
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
        "agent": {"state_dir": str(state_dir), "port": port, "listen": listen, "host_id": "demo-host"},
        "host": {"sysfs_root": str(host_dir / "sys"), "kernel": "fake"},  # the fake kernel answers the tree's writes
        "libvirt": {"uri": f"sim://{hv_path}", "detach_timeout_s": 5.0},
    }
    if db:
        overrides["store"] = {"url": db}
    if fast_reclaim:
        overrides["reclaim"] = {"check_interval_s": 10.0, "grace_s": 10.0, "min_lease_age_s": 5.0,
                                "notice_window_s": 5.0}
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
        creds = {"operator": {"token": new_token("op")}, "vms": vms}
        creds_path.write_text(json.dumps(creds, indent=2) + "\n")
        os.chmod(creds_path, 0o600)
    overrides["auth"] = {"operator_token_sha256": hash_token(creds["operator"]["token"])}
    # The demo never reads /etc/hostagent: only an explicit --config file (and HOSTAGENT_* variables) add to it.
    settings = load_settings(config, overrides=overrides) if config else settings_without_file(overrides)
    return settings, creds


def run_demo(args: argparse.Namespace) -> int:
    """Prepare the demo host, print how to use it, and serve until interrupted."""
    from hostagent.runtime import serve

    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="hostagent-demo-"))
    settings, creds = prepare_demo(state_dir.resolve(), scenario=args.scenario, db=args.db, port=args.port,
                                   listen=args.listen, config=args.config, fast_reclaim=args.fast_reclaim)
    vm = creds["vms"][0]
    banner = "\n".join([
        "hostagent demo: a simulated host with GPUs, the real agent, API and dashboard.",
        f"  state directory : {settings.state_dir}",
        f"  credentials     : {settings.state_dir / CREDENTIALS}",
        f"  operator token  : {creds['operator']['token']}",
        "",
        "Try:",
        f"  curl -s -H 'Authorization: Bearer {vm['token']}' {{url}}/v1/gpus",
        f"  curl -s -X POST -H 'Authorization: Bearer {vm['token']}' -H 'Content-Type: application/json' \\",
        "       -d '{\"gpus\": 1, \"task_type\": \"training\"}' {url}/v1/leases",
        "  dashboard: {url}/  (log in with the operator token)",
        "Ctrl-C stops it.",
    ])
    return serve(settings, banner=banner)
