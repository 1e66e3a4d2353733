"""The fleet: agents that share one usage store (MySQL/MariaDB) are one fleet, and each publishes its live state there
so that any of them can show all of them.

`FleetPublisher` runs in every agent with a store: at start and then every `store.fleet_publish_interval_s` it takes a
snapshot of what the agent holds in memory (no I/O on the event loop: each GPU's state and holder, the queue's length,
the leases holding GPUs, the placement model in use, the utilization of the leased GPUs from the heartbeats held in
memory, the reaper's idle candidates, where this host's dashboard is) and writes it in one store write
(`UsageStore.publish_fleet`: the host's `hosts` row, `last_seen` and `info`, and every GPU's `state`). A publish is a
snapshot: while the store is unreachable the publisher skips (a snapshot replayed an hour late says nothing), and the
one write an outage catches in flight is spooled like any other. A clean stop publishes a last snapshot marked
`stopped`.

`fleet_view` turns the store's rows (`UsageStore.fleet_hosts`) into what the fleet page and `GET /v1/fleet` show:
one row per host with its age and a stale mark past `STALE_INTERVALS` of the interval that host publishes at, its GPUs
by state, utilization, queue, model version; the idle candidates of every host; and the fleet's totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from hostagent import __version__
from hostagent.domain.errors import HostAgentError, NotFound
from hostagent.domain.inventory import GpuState
from hostagent.learn import MODEL_KIND

log = logging.getLogger("hostagent.fleet")

FORMAT = 1  # the layout of hosts.info; a reader shows what it knows of a newer one
STALE_INTERVALS = 3.0  # a host not heard from in this many of its publish intervals is marked stale
STATES = [s.value for s in GpuState]
UNKNOWN = "unknown"  # a GPU whose state no agent published (an agent older than the fleet view)
STOP_TIMEOUT_S = 3.0  # the last publish of a stopping agent waits this long at most


class FleetPublisher:
    """Publishes this agent's live state to the shared store (see the module's docstring)."""

    def __init__(self, manager: Any, *, interval_s: float, write: Callable[[dict[str, Any], dict[str, str]],
                 Awaitable[None]], degraded: Callable[[], bool], url: Callable[[], str | None],
                 model: Callable[[], tuple[str | None, str]], samples: Callable[[], Mapping[str, Iterable[Any]]],
                 reaper: Any = None, clock: Callable[[], float], util_window_s: float = 60.0,
                 version: str | None = None) -> None:
        self.m = manager
        self.interval_s = interval_s
        self._write = write
        self._degraded = degraded
        self._url = url
        self._model = model
        self._samples = samples
        self.reaper = reaper
        self.clock = clock
        self.util_window_s = util_window_s
        self.version = version
        self.published = 0  # snapshots written (or spooled)
        self.skipped = 0  # ticks skipped while the store was unreachable
        self.last_at: float | None = None  # when the last snapshot was written
        self.last_error: str | None = None  # why the last publish failed (None once one succeeds)
        self.served_url: str | None = None  # where the server is bound, once it listens (port 0 resolved)
        self._wake = asyncio.Event()

    # -- the snapshot (on the event loop: memory only) ------------------------------------------------------------
    def snapshot(self, *, stopped: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
        """(hosts.info, GPU id -> state) as the agent holds them now."""
        m = self.m
        now = self.clock()
        states: dict[str, str] = {}
        counts: dict[str, int] = {}
        per_gpu: dict[str, dict[str, Any]] = {}
        utils: list[float] = []
        recent = self._recent_util(now)
        for gid in sorted(m.gpus):
            state = m.gpu_state(gid).value
            states[gid] = state
            counts[state] = counts.get(state, 0) + 1
            lease = m.lease_of(gid)
            if lease is not None:
                util = recent.get((lease.id, gid))
                per_gpu[gid] = {"lease": lease.id, "util": None if util is None else round(util, 1)}
                if util is not None:
                    utils.append(util)
        version, rule = self._model()
        info: dict[str, Any] = {
            "format": FORMAT, "published_at": now, "publish_interval_s": self.interval_s, "url": self._url(),
            "stopped": stopped, "model_version": version, "placement_rule": rule,
            "queue": len(m.queue()), "active_leases": sum(1 for x in list(m.leases.values()) if x.state.holds_devices),
            "gpus_total": len(states), "states": counts, "gpus": per_gpu,
            "util": {"mean_pct": round(sum(utils) / len(utils), 1) if utils else None, "reporting": len(utils),
                     "window_s": self.util_window_s},
            "idle_candidates": self._idle(),
        }
        return info, states

    def _recent_util(self, now: float) -> dict[tuple[str, str], float]:
        """(lease, GPU) -> mean utilization of the heartbeat samples held in memory from the last util_window_s."""
        since = now - self.util_window_s
        sums: dict[tuple[str, str], list[float]] = {}
        for lease_id, window in list(self._samples().items()):
            for smp in reversed(list(window)):  # newest last: stop at the first sample older than the window
                ts = float(smp.get("ts") or 0.0)
                if ts < since:
                    break
                gid = smp.get("gpu_id") or smp.get("gpu")
                if gid is not None and smp.get("util_pct") is not None:
                    sums.setdefault((lease_id, str(gid)), []).append(float(smp["util_pct"]))
        return {k: sum(v) / len(v) for k, v in sums.items()}

    def _idle(self) -> list[dict[str, Any]]:
        """The leases the reaper holds a strike against (its idle candidates)."""
        if self.reaper is None:
            return []
        out = []
        for s in self.reaper.status():
            if s["strike"] == "none":
                continue
            out.append({"lease_id": s["lease_id"], "domain": s["domain"], "gpus": list(s["gpus"]),
                        "strike": s["strike"], "strike_at": s["strike_at"], "paused": s["paused"],
                        "deadline": s["notice_deadline"] or s["recheck_at"]})
        return out

    # -- publishing ---------------------------------------------------------------------------------------------
    async def publish(self, *, stopped: bool = False) -> bool:
        """Write one snapshot; False when skipped (the store is unreachable) or failed (logged)."""
        if self._degraded():
            self.skipped += 1
            return False
        info, states = self.snapshot(stopped=stopped)
        try:
            await self._write(info, states)
        except HostAgentError as exc:
            self._failed(exc.message)
            return False
        except Exception as exc:  # noqa: BLE001 - the next tick tries again; leasing never waits on this
            self._failed(f"{type(exc).__name__}: {exc}")
            return False
        self.published += 1
        self.last_at = info["published_at"]
        self.last_error = None
        return True

    def _failed(self, why: str) -> None:
        if self.last_error is None:
            log.warning("publishing this host's state to the fleet failed: %s (tried again every %g s)", why,
                        self.interval_s)
        self.last_error = why[:300]

    def served(self, url: str) -> None:
        """The server listens at `url`: publish again now, so the fleet links here without waiting an interval."""
        self.served_url = url
        self._wake.set()

    async def run(self) -> None:
        """Publish now, then every interval (or at once when told where the server listens), until cancelled."""
        while True:
            self._wake.clear()
            await self.publish()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()

    async def stopping(self) -> None:
        """A last snapshot, marked stopped (bounded: a stopping agent never waits long on the store)."""
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await self.publish(stopped=True)
        except TimeoutError:
            log.warning("the last fleet publish did not finish in %g s", STOP_TIMEOUT_S)


def publisher_for(rt: Any) -> FleetPublisher:
    """The publisher of a runtime (the composition root's `Runtime`): its store, manager, reaper, model, samples."""
    s = rt.settings
    pub: FleetPublisher = FleetPublisher(
        rt.manager, interval_s=s.store.fleet_publish_interval_s,
        write=lambda info, states: rt.store.publish_fleet(info, states, agent_version=__version__),
        degraded=lambda: rt.store is None or rt.store.degraded, url=lambda: dashboard_url(s.agent, pub.served_url),
        model=lambda: (rt.model_version, rt.placement_rule), samples=lambda: rt.recent_samples, reaper=rt.reaper,
        clock=rt.clock, util_window_s=s.dashboard.stale_after_s, version=__version__)
    return pub


WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def dashboard_url(agent: Any, served: str | None) -> str | None:
    """Where other hosts reach this agent's dashboard: `agent.public_url`, else the address it serves on (the bound
    one, or `agent.listen`:`agent.port`), a wildcard address replaced by this host's name; None while unknown (port
    0 before the server is bound)."""
    if agent.public_url:
        return str(agent.public_url).rstrip("/")
    scheme = "https" if agent.tls_cert else "http"
    if served:
        parts = urlsplit(served)
        scheme, host, port = parts.scheme or scheme, parts.hostname or "", parts.port
    elif agent.port:
        host, port = agent.listen, agent.port
    else:
        return None
    host = socket.getfqdn() if host in WILDCARDS else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{host}:{port}" if port else f"{scheme}://{host}"


# -- the fleet as the pages show it ---------------------------------------------------------------------------------
async def read_fleet(store: Any, *, now: float, this_host: str, interval_s: float) -> dict[str, Any]:
    """Read the fleet from the store (an AsyncUsageStore): every host's row and GPUs, and the active placement model
    (the one every host follows); the view of `fleet_view`. StoreUnavailable when the store cannot be read."""
    rows = await store.fleet_hosts()
    try:
        active = await store.get_model_version(None, kind=MODEL_KIND, with_artifact=False)
    except NotFound:
        active = None
    view = fleet_view(rows, now, this_host=this_host, interval_s=interval_s,
                      active_model=str(active["version"]) if active else None)
    view["active_model_hosts"] = sorted(((active or {}).get("metrics") or {}).get("hosts") or {})
    return view


def fleet_view(hosts: Sequence[Mapping[str, Any]], now: float, *, this_host: str, interval_s: float,
               active_model: str | None = None) -> dict[str, Any]:
    """The fleet page's content from `UsageStore.fleet_hosts()` rows: hosts (this one first), idle candidates, totals.

    `interval_s`: the reader's own `store.fleet_publish_interval_s`, for a host that never said its own."""
    rows = []
    idle = []
    totals: dict[str, Any] = {"hosts": 0, "stale": 0, "gpus": 0, "states": {s: 0 for s in STATES},
                              "active_leases": 0, "queue": 0, "idle": 0, "util_pct": None, "util_reporting": 0}
    util_sum = 0.0
    # a row with no GPU that never published is a tool's (`hostagent model train` on a laptop), not a host
    hosts = [h for h in hosts if h.get("gpus") or h.get("info") or h["id"] == this_host]
    for h in sorted(hosts, key=lambda x: (x["id"] != this_host, str(x["id"]))):
        row = host_row(h, now, this_host=this_host, interval_s=interval_s, active_model=active_model)
        rows.append(row)
        totals["hosts"] += 1
        totals["stale"] += 1 if row["stale"] else 0
        totals["gpus"] += row["gpus"]
        for state, n in row["states"].items():
            totals["states"][state] = totals["states"].get(state, 0) + n
        totals["active_leases"] += row["active_leases"] or 0
        totals["queue"] += row["queue"] or 0
        if row["util_pct"] is not None and row["util_reporting"]:
            util_sum += row["util_pct"] * row["util_reporting"]
            totals["util_reporting"] += row["util_reporting"]
        for c in row["idle"]:
            lease_url = f"{row['url']}/ui/leases/{c['lease_id']}" if row["url"] else None
            idle.append({**c, "host_id": row["id"], "host_url": row["url"], "lease_url": lease_url,
                         "host_stale": row["stale"]})
    totals["idle"] = len(idle)
    if totals["util_reporting"]:
        totals["util_pct"] = round(util_sum / totals["util_reporting"], 1)
    totals["states"] = {k: v for k, v in totals["states"].items() if v or k in STATES}
    return {"now": now, "this_host": this_host, "hosts": rows, "idle": idle, "totals": totals,
            "active_model": active_model, "states": list(totals["states"]), "stale_intervals": STALE_INTERVALS}


def host_row(h: Mapping[str, Any], now: float, *, this_host: str, interval_s: float,
             active_model: str | None) -> dict[str, Any]:
    """One host of the fleet page."""
    raw = h.get("info")
    info: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    every = _num(info.get("publish_interval_s")) or interval_s
    last = _num(h.get("last_seen")) or 0.0
    age = max(0.0, now - last)
    stale_after = STALE_INTERVALS * every
    gpus = list(h.get("gpus") or [])
    states: dict[str, int] = {}
    for g in gpus:
        s = g.get("state") or UNKNOWN
        states[s] = states.get(s, 0) + 1
    ordered = {s: states[s] for s in [*STATES, UNKNOWN] if s in states}
    ordered.update({s: n for s, n in states.items() if s not in ordered})
    models: dict[str, int] = {}
    for g in gpus:
        models[str(g.get("model") or "?")] = models.get(str(g.get("model") or "?"), 0) + 1
    util = info.get("util") if isinstance(info.get("util"), Mapping) else {}
    url = info.get("url") if isinstance(info.get("url"), str) and info.get("url") else None
    version = info.get("model_version") if isinstance(info.get("model_version"), str) else None
    publishing = bool(info)
    return {
        "id": str(h["id"]), "hostname": h.get("hostname"), "agent_version": h.get("agent_version"),
        "this": h["id"] == this_host, "url": url.rstrip("/") if url else None, "last_seen": last or None,
        "age": age, "interval_s": every, "stale_after": stale_after, "stale": age > stale_after,
        "stopped": bool(info.get("stopped")), "publishing": publishing,
        "gpus": len(gpus), "states": ordered,
        "models": ", ".join(f"{n}× {k}" for k, n in sorted(models.items(), key=lambda kv: (-kv[1], kv[0]))),
        "util_pct": _num(util.get("mean_pct")), "util_reporting": int(util.get("reporting") or 0),
        "queue": _int(info.get("queue")), "active_leases": _int(info.get("active_leases")),
        "model_version": version, "placement_rule": info.get("placement_rule") if publishing else None,
        "model_current": publishing and version == active_model,
        "idle": [c for c in info.get("idle_candidates") or [] if isinstance(c, Mapping) and c.get("lease_id")],
    }


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _int(x: Any) -> int | None:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


__all__ = ["FORMAT", "STALE_INTERVALS", "STATES", "FleetPublisher", "dashboard_url", "fleet_view", "host_row",
           "publisher_for", "read_fleet"]
