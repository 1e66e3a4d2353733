#!/usr/bin/env bash
# The demo command: installs the agent into ./.venv and runs it on a simulated host with 16 GPUs.
# Arguments go to `hostagent demo` (e.g. --port 8480 --fast-reclaim).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/deps.sh runtime
exec .venv/bin/hostagent demo "$@"
