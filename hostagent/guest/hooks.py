"""User hooks (shell commands with the lease in their environment) and stopping the processes on a GPU."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterable, Mapping

log = logging.getLogger("hostagent.guest.hooks")


async def run_hook(command: str, env: Mapping[str, str], timeout_s: float, what: str) -> int | None:
    """Run a hook in its own process group; kill the group after timeout_s. Returns the exit status (None: killed)."""
    log.info("running %s hook: %s", what, command)
    try:
        proc = await asyncio.create_subprocess_shell(command, env={**os.environ, **env}, start_new_session=True)
    except OSError as exc:
        log.error("%s hook could not start: %s", what, exc)
        return None
    try:
        rc = await asyncio.wait_for(proc.wait(), timeout=max(0.1, timeout_s))
    except asyncio.TimeoutError:
        log.error("%s hook still running after %.0f s; killing it", what, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return None
    if rc != 0:
        log.warning("%s hook exited with status %s", what, rc)
    return rc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited: it holds no GPU
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


async def stop_processes(pids: Iterable[int], grace_s: float) -> list[int]:
    """SIGTERM each process, SIGKILL what is left after grace_s; returns the PIDs that were signalled."""
    me = os.getpid()
    targets = sorted({p for p in pids if p > 1 and p != me})
    sent = []
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
            sent.append(pid)
        except (ProcessLookupError, PermissionError) as exc:
            log.warning("cannot stop pid %d: %s", pid, exc)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while any(_alive(p) for p in sent) and loop.time() < deadline:
        await asyncio.sleep(0.1)
    for pid in sent:
        if _alive(pid):
            log.warning("pid %d ignored SIGTERM for %.0f s; killing it", pid, grace_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return sent
