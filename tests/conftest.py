"""Shared test setup.

asyncio debug mode is on for the suite: scripts/test.sh exports PYTHONASYNCIODEBUG=1 before Python starts (asyncio
reads it at import), so a blocking call on the event loop is reported as a slow callback.
"""

from __future__ import annotations

# The agent imports scikit-learn (and numpy with it) in a worker thread after it reports ready. pytest.approx looks
# numpy up in sys.modules, and on a test's thread could find it half imported by that worker; importing it here,
# before any agent starts, leaves nothing half imported.
import numpy  # noqa: E402, F401
