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
# The tests' own directories (tmp_path: agents' journals and SQLite stores, fake sysfs trees) on tmpfs where there is
# one: an agent syncs its journal and store to disk as it must on a host, and on a shared VM's disk those syncs cost
# the suite a third or more of its time. A crash test kills the agent, not the machine, so what it finds after a kill
# is the same on either. A passing test's directory goes at its teardown (pyproject: tmp_path_retention_policy), so
# a run holds little there (1.5 GB when every test kept its own); with less than 2 GiB free (a container's 64 MB
# /dev/shm) or HOSTAGENT_TEST_TMP=disk they stay on disk (pytest's default under /tmp). Measured on 2026-11-29 on this
# 2-CPU machine: 1,350 tests in 16.8 minutes on tmpfs against 19.3 on disk an hour before.
basetemp=()
shm_free_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
if [ "${HOSTAGENT_TEST_TMP:-ram}" != disk ] && [ -w /dev/shm ] && [ "${shm_free_kib:-0}" -ge 2097152 ]; then
  ram=$(mktemp -d /dev/shm/hostagent-tests.XXXXXX)
  trap 'rm -rf "$ram"' EXIT
  basetemp=(--basetemp "$ram/pytest")
fi
rc=0
.venv/bin/python -m pytest -p no:cacheprovider -n "${HOSTAGENT_TEST_WORKERS:-auto}" "${basetemp[@]}" "$@" || rc=$?
exit "$rc"
