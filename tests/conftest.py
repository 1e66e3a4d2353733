"""Shared test setup.

asyncio debug mode is on for the suite: scripts/test.sh exports PYTHONASYNCIODEBUG=1 before Python starts (asyncio
reads it at import), so a blocking call on the event loop is reported as a slow callback.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

# The agent imports scikit-learn (and numpy with it) in a worker thread after it reports ready. pytest.approx looks
# numpy up in sys.modules, and on a test's thread could find it half imported by that worker; importing it here,
# before any agent starts, leaves nothing half imported.
import numpy  # noqa: E402, F401


# Parallel runs (pytest-xdist, as scripts/test.sh runs the suite): each module runs whole on one worker, in its own
# order (module fixtures such as a demo or a browser are made once). Modules that share something of the machine that
# is one of a kind run together on one worker, one after another:
#   - the real MariaDB, which test_agent_store stops and starts again (every test of the MySQL backend would fail
#     meanwhile);
#   - libvirtd and QEMU: private daemons, nested guests and TCG kernels that each want the whole CPU to keep their
#     deadlines (libvirt also binds its event loop to one per process); the crash matrix and the benchmark parts,
#     which time real subprocesses.
# The groups are scheduled here rather than with xdist_group marks: xdist 3.8 puts a mark's group into the node id,
# which pytest 9.2 no longer reads back, so `--dist loadgroup` silently ran every test on its own.
SERIAL_GROUPS = {
    "mariadb": ("tests/adapters/test_agent_store.py", "tests/adapters/test_spool_order.py", "tests/adapters/test_fleet.py",
                "tests/adapters/test_demo_fleet.py",
                "tests/adapters/test_store_", "tests/unit/test_store_"),
    "machine": ("tests/e2e/", "tests/adapters/test_libvirtd", "tests/adapters/test_libvirt_deadlines.py",
                "tests/adapters/test_crash_matrix.py", "tests/unit/test_bench_parts.py"),
}


def test_group(nodeid: str) -> str:
    """The unit of work a test belongs to: its serial group, or else its module."""
    path = nodeid.split("::", 1)[0]
    return next((g for g, prefixes in SERIAL_GROUPS.items() if path.startswith(prefixes)), path)


test_group.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    return GroupScheduling(config, log)


# The whole lease with a real guest OS (#19) runs outside the suite: `bash scripts/e2e-real.sh` (see that module).
collect_ignore = [] if os.environ.get("HOSTAGENT_E2E_REAL") == "1" else ["e2e/test_qemu_guest_os.py"]


class _SeededRandom:
    """`random` as `hostagent.services.placement` sees it in tests: a placer made without a seed draws from one
    fixed by the test's name."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def Random(self, seed: Any = None) -> Any:  # noqa: N802 (the module's name)
        import random

        return random.Random(self.seed if seed is None else seed)


@pytest.fixture(autouse=True)
def _placement_draws_fixed_per_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Placement explores now and then (`placement.explore_epsilon`, on in tests as in production). Each test gets
    its own fixed draws, from its name, so a test that happens to depend on which GPU a grant takes fails on every
    run, not on one run in twenty."""
    import zlib

    from hostagent.services import placement

    monkeypatch.setattr(placement, "random", _SeededRandom(zlib.crc32(request.node.nodeid.encode())))
