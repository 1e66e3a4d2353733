"""Runs INSIDE the QEMU test guest, as a child process of the `guest_agent` phase (tests/e2e/guest_agent_lease.py):
the agent exactly as `hostagent serve` runs it (``runtime.serve``: signals, the HTTP server, the runtime's start with
its reconcile), over the state directory the phase's agent used, so that it can be killed with SIGKILL and started
again. One thing differs from `hostagent serve`, as in the phase: its inventory is the two-function e1000e group,
found by discovery at its start (after a crash the functions are on vfio-pci; the journal knows their drivers).

    python3 -m tests.e2e.crash_agent STATE_DIR PAIR_FIRST OPERATOR_SHA256

With HOSTAGENT_CRASH_AT in its environment it SIGKILLs itself at that crash point (hostagent.services.faults).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(state: str, pair_first: str, operator_sha256: str) -> int:
    import hostagent.runtime as runtime
    from tests.e2e.guest_agent_lease import agent_settings, nic_inventory

    runtime.discover_host = lambda settings: nic_inventory(pair_first)  # type: ignore[assignment]
    return runtime.serve(agent_settings(Path(state), operator_sha256))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
