#!/usr/bin/env bash
# The whole lease with a real guest OS (#19), outside the test suite: the nested libvirtd's inner domains boot a real
# Linux; the agent leases the two-function e1000e group into one and releases it (its kernel acknowledges the
# unplug); in another the guest agent itself leases over HTTP, runs a job, heartbeats and releases, then has an idle
# lease reclaimed through its hooks, and the agent is killed with SIGKILL between an attach and the ACTIVE write and
# started again (the restart reconciles the journal with the live domain XML). About 20 minutes on a 2-CPU machine;
# installs what it needs as scripts/test.sh does. Extra arguments go to pytest. Figures: docs/benchmarks.md, "The
# whole lease with a real guest OS".
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTAGENT_E2E_REAL=1 HOSTAGENT_TEST_WORKERS=0 exec bash scripts/test.sh tests/e2e/test_qemu_guest_os.py -s "$@"
