"""An in-process agent over a fake sysfs tree (fake kernel) and the simulated hypervisor, with timed ports.

The same composition as the running agent (`build_runtime` + `make_app`), with the host, the hypervisor and the
journal wrapped in `TimedPort`s that record how long every call spent inside them, so a benchmark can subtract
the time spent outside the agent (sysfs, hypervisor) from a request's wall time.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostagent.config import settings_from_dict
from hostagent.host.fakesysfs import build_tree
from hostagent.runtime import Runtime, build_runtime
from hostagent.virt.sim import SimulatedHypervisor
from hostagent.web.auth import hash_token, new_token


class TimedPort:
    """A pass-through proxy that appends (method, seconds) for every call (sync calls timed in their thread)."""

    def __init__(self, target: Any, name: str, only: frozenset[str] | None = None) -> None:
        self._target = target
        self._name = name
        self._only = only
        self.calls: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._target, attr)
        if not callable(value) or attr.startswith("_") or (self._only is not None and attr not in self._only):
            return value
        label = f"{self._name}.{attr}"
        if inspect.iscoroutinefunction(value):
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await value(*args, **kwargs)
                finally:
                    self._add(label, time.perf_counter() - t0)
            return timed_async

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return value(*args, **kwargs)
            finally:
                self._add(label, time.perf_counter() - t0)
        return timed

    def _add(self, label: str, seconds: float) -> None:
        with self._lock:  # sync calls arrive from worker threads
            self.calls.append((label, seconds))

    def mark(self) -> int:
        """A position in the call log, for `since`."""
        with self._lock:
            return len(self.calls)

    def since(self, mark: int) -> list[tuple[str, float]]:
        """Calls recorded after `mark`."""
        with self._lock:
            return self.calls[mark:]


@dataclass
class InProcessAgent:
    """A runtime (not started) plus its tokens and timed ports."""

    runtime: Runtime
    hypervisor: SimulatedHypervisor
    operator: str
    tokens: dict[str, str]  # vm name -> token
    host_port: TimedPort
    hv_port: TimedPort
    journal_port: TimedPort


def build_agent(tmp: Path, *, scenario: str = "demo16", vms: tuple[str, ...] = ("vm-bench",),
                hv_kwargs: dict[str, Any] | None = None, clock: Callable[[], float] = time.time,
                **sections: dict[str, Any]) -> InProcessAgent:
    """Fake host tree + simulated hypervisor + runtime with timed host, hypervisor and journal ports."""
    tree = build_tree(tmp / "host", scenario)
    hv_path = tmp / "hv.json"
    hv = SimulatedHypervisor(path=hv_path, **{"sysfs_root": tree.sys_root, **(hv_kwargs or {})})
    for name in vms:
        hv.define(name, running=True)
    hv.save()
    operator = new_token("op")
    raw: dict[str, Any] = {
        "agent": {"state_dir": str(tmp / "state"), "port": 0, "host_id": "bench-host", "log_format": "text",
                  "log_level": "WARNING"},
        "host": {"sysfs_root": str(tree.sys_root), "kernel": "fake"},
        "libvirt": {"uri": f"sim://{hv_path}"},
        "auth": {"operator_token_sha256": hash_token(operator)},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    rt = build_runtime(settings_from_dict(raw), hypervisor=hv, clock=clock)
    host_port = TimedPort(rt.host, "host")
    hv_port = TimedPort(hv, "hv", only=frozenset({"list_domains", "get_domain", "domain_xml", "attached_hostdevs",
                                                   "attach_hostdevs", "detach_hostdevs"}))
    journal_port = TimedPort(rt.journal, "journal")
    rt.host = rt.manager.host = host_port  # type: ignore[assignment]
    rt.hypervisor = rt.manager.hv = hv_port
    rt.journal = rt.manager.journal = journal_port  # type: ignore[assignment]
    tokens = {}
    for dom in hv.domains_sync():
        tok = new_token("vm")
        rt.journal.add_token(hash_token(tok), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
        tokens[dom.name] = tok
    return InProcessAgent(rt, hv, operator, tokens, host_port, hv_port, journal_port)
