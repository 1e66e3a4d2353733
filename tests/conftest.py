"""Shared test setup.

asyncio debug mode is on for the suite: scripts/test.sh exports PYTHONASYNCIODEBUG=1 before Python starts (asyncio
reads it at import), so a blocking call on the event loop is reported as a slow callback.
"""

from __future__ import annotations
