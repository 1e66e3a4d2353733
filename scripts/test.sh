#!/usr/bin/env bash
# The test command: installs everything the suite needs (apt, pip into ./.venv, MariaDB, the QEMU test guest),
# then runs pytest on every CPU (pytest-xdist; tests/conftest.py keeps what shares one machine-wide thing on one
# worker). Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -x`; HOSTAGENT_TEST_WORKERS=0 runs serially.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/deps.sh test
mkdir -p artifacts
export PYTHONASYNCIODEBUG=1
# The suite starts the agent and the CLI as subprocesses a few hundred times: let them reuse compiled bytecode (an
# environment that sets PYTHONDONTWRITEBYTECODE has every start compile hostagent again, ~0.2 s each).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -p no:cacheprovider -n "${HOSTAGENT_TEST_WORKERS:-auto}" "$@"
