"""Prometheus metrics: every series is named hostagent_*. One registry per app (tests run many apps)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hostagent.domain.inventory import GpuState
from hostagent.domain.lease import Lease, LeaseState
from hostagent.domain.out_of_band import CHANGES
from hostagent.host.memory import read_memory
from hostagent.services.lease_types import detach_retries_left
from hostagent.web.app import hide_server_version, ident
from hostagent.web.keys import SAMPLES_ACCEPTED

if TYPE_CHECKING:
    from hostagent.web.ports import AgentServices

_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The agent's metrics; gauges are computed at scrape time from the runtime."""

    def __init__(self, runtime: AgentServices) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.runtime = runtime
        self.request_seconds = Histogram(
            "hostagent_http_request_duration_seconds", "API request latency by endpoint",
            ["method", "route", "status"], registry=self.registry,
        )
        self.step_seconds = Histogram(
            "hostagent_step_duration_seconds", "bind / attach / detach / give-back durations",
            ["step"], buckets=_STEP_BUCKETS, registry=self.registry,
        )
        self.step_failures = PCounter("hostagent_step_failures_total", "failed host or hypervisor steps", ["step"],
                                      registry=self.registry)
        self.lease_transitions = PCounter("hostagent_lease_transitions_total", "lease state transitions",
                                          ["to_state"], registry=self.registry)
        self.reclaims = PCounter("hostagent_reclaims_total", "idle reclaims by outcome", ["outcome"],
                                 registry=self.registry)
        self.preemptions = PCounter("hostagent_preemptions_total", "leases reclaimed for a request of higher "
                                    "priority (leases.preempt_min_priority), by outcome", ["outcome"],
                                    registry=self.registry)
        self.samples = PCounter("hostagent_heartbeat_samples_total", "usage samples accepted", registry=self.registry)
        self.registry.register(_Gauges(runtime))
        self.registry.register(_GpuGauges(runtime))
        self._seen_timings = 0
        self._last_state: dict[str, LeaseState] = {}

    def on_lease(self, lease: Lease | None, detail: str | None) -> None:
        """Lease listener: count transitions and the step timings recorded since the last call."""
        if lease is not None and self._last_state.get(lease.id) is not lease.state:
            self.lease_transitions.labels(lease.state.value).inc()
            if lease.state.terminal:
                self._last_state.pop(lease.id, None)
            else:
                self._last_state[lease.id] = lease.state
            counter = {"reclaimed: idle": self.reclaims, "reclaimed: preempted": self.preemptions}.get(
                lease.end_reason or "")
            if counter is not None and lease.state.terminal:
                counter.labels(lease.state.value.lower()).inc()
            elif counter is not None and lease.state is LeaseState.DETACH_PENDING:
                counter.labels("detach_pending").inc()
        timings = self.runtime.manager.step_timings
        for kind, seconds in timings.since(self._seen_timings):
            self.step_seconds.labels(kind).observe(seconds)
        self._seen_timings = timings.total
        if lease is not None and lease.state is LeaseState.FAILED:
            self.step_failures.labels("lease").inc()

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


class _Gauges:
    """Gauges read from the runtime at scrape time (never stale)."""

    def __init__(self, runtime: AgentServices) -> None:
        self.rt = runtime

    def describe(self) -> list[Any]:
        """No static description (values are computed)."""
        return []

    def collect(self) -> Any:
        """GPUs by state, leases by state, queue depth, spool depth, model version, readiness."""
        m = self.rt.manager
        gpus = GaugeMetricFamily("hostagent_gpus", "GPUs by state", labels=["state"])
        counts = Counter(m.gpu_state(g).value for g in m.gpus)
        for st in GpuState:
            gpus.add_metric([st.value], counts.get(st.value, 0))
        yield gpus
        leases = GaugeMetricFamily("hostagent_leases", "live leases by state", labels=["state"])
        lc = Counter(x.state.value for x in m.leases.values())
        for st in LeaseState:
            if not st.terminal:
                leases.add_metric([st.value], lc.get(st.value, 0))
        yield leases
        yield GaugeMetricFamily("hostagent_queue_depth", "requests waiting for GPUs", value=len(m.queue()))
        yield GaugeMetricFamily("hostagent_detach_alerts", "DETACH_PENDING leases whose guest did not acknowledge the "
                                "detach after libvirt.detach_retries retries: no more automatic retries, an operator "
                                "must look (a detach-alert journal event names each)",
                                value=sum(1 for x in m.leases.values() if x.state is LeaseState.DETACH_PENDING
                                          and not detach_retries_left(m.policy, x)))
        yield GaugeMetricFamily("hostagent_leases_disputed", "leases whose guest reports busy while the host saw no "
                                "vfio interrupts (reclaim.guest_busy_host_idle)",
                                value=len(self.rt.reaper.disputed) if self.rt.reaper is not None else 0)
        watcher = self.rt.watcher
        if watcher is not None:
            oob = CounterMetricFamily("hostagent_out_of_band_changes", "driver changes, removals and additions of GPU "
                                      "functions the agent did not make, seen in the kernel's uevents, by change",
                                      labels=["change"])
            for change in CHANGES:
                oob.add_metric([change], watcher.counts.get(change, 0))
            yield oob
            yield GaugeMetricFamily("hostagent_uevents_watching", "1 while the agent follows the kernel's PCI uevents",
                                    value=1 if watcher.watching else 0)
            yield GaugeMetricFamily("hostagent_gpu_functions_missing", "GPU functions the kernel took off the bus "
                                    "(removed, or fallen off) and not back yet", value=len(self.rt.manager.missing))
        st = self.rt.store.status() if self.rt.store is not None else {"degraded": False, "spool_depth": 0}
        yield GaugeMetricFamily("hostagent_store_degraded", "1 while the usage store is unreachable (spooling)",
                                value=1 if st["degraded"] else 0)
        yield GaugeMetricFamily("hostagent_store_spool_depth", "writes waiting in the local spool",
                                value=st["spool_depth"])
        if self.rt.store is not None:
            h = self.rt.store_health()  # the figures of /readyz's store check
            yield GaugeMetricFamily("hostagent_store_healthy", "1 when the usage store takes every write in time "
                                    "(the store check of /readyz)", value=1 if h["ok"] else 0)
            yield GaugeMetricFamily("hostagent_store_mirror_lag_seconds", "age of the oldest journal entry not yet "
                                    "in the usage store (0 when none waits)", value=h["mirror_lag_s"])
            yield GaugeMetricFamily("hostagent_store_unmirrored_events", "journal entries not yet in the usage store",
                                    value=h["unmirrored_events"])
            yield GaugeMetricFamily("hostagent_store_samples_waiting_seconds", "how long the oldest heartbeat "
                                    "sample not yet written has waited", value=h["samples_oldest_s"])
            yield GaugeMetricFamily("hostagent_store_set_aside_writes", "writes the usage store refused, set aside "
                                    "for `hostagent db rejected` / `replay`", value=h["set_aside"])
            yield CounterMetricFamily("hostagent_store_rows_set_aside", "rows set aside since start (refused by the "
                                      "usage store)", value=st.get("rows_set_aside", 0))
            yield CounterMetricFamily("hostagent_store_rows_lost", "refused rows dropped because the set-aside table "
                                      "was full", value=st.get("rows_lost", 0))
        ing = self.rt.ingestor
        yield GaugeMetricFamily("hostagent_ingest_queue_depth", "heartbeat samples waiting to be written",
                                value=ing.depth if ing is not None else 0)
        yield CounterMetricFamily("hostagent_ingest_refused_over_share", "heartbeats refused (429) because their VM's "
                                  "samples filled its share of the queue (store.ingest_share)",
                                  value=ing.over_share if ing is not None else 0)
        version = GaugeMetricFamily("hostagent_model_version", "placement model in use (1 for the current)",
                                    labels=["version", "rule"])
        version.add_metric([str(getattr(self.rt, "model_version", None) or "none"),
                            str(getattr(self.rt, "placement_rule", "cold-start"))], 1)
        yield version
        yield GaugeMetricFamily("hostagent_ready", "1 when reconciled and the hypervisor is connected",
                                value=1 if self.rt.started and self.rt.hypervisor_ok else 0)
        yield GaugeMetricFamily("hostagent_quarantined_gpus", "GPUs excluded from placement",
                                value=len(m.quarantined))
        mem = read_memory()
        parts = GaugeMetricFamily(
            "hostagent_memory_bytes", "the agent's memory by holder: resident size, malloc in use, free memory "
            "malloc keeps, SQLite's allocations (a leak grows malloc_in_use; fragmentation grows malloc_free)",
            labels=["part"])
        for part, value in (("rss", mem.rss_bytes), ("malloc_in_use", mem.malloc_in_use),
                            ("malloc_free", mem.malloc_free), ("sqlite", mem.sqlite_bytes)):
            if value is not None:
                parts.add_metric([part], value)
        yield parts
        yield GaugeMetricFamily("hostagent_python_allocated_blocks", "live Python small-object blocks",
                                value=mem.python_blocks)


class _GpuGauges:
    """One series per GPU (and state), read at scrape time, for a DCGM-style board: under VFIO the host cannot see
    a leased GPU at all, so its utilisation and memory are what the guest last reported in a heartbeat. Labels are
    the GPU id and, for the holder, the libvirt domain name: the series stay bounded by the number of GPUs (never a
    lease id, which would add series with every lease)."""

    def __init__(self, runtime: AgentServices) -> None:
        self.rt = runtime
        self.newest = _NewestSamples()

    def describe(self) -> list[Any]:
        """No static description (values are computed)."""
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """State and holder of every GPU; utilisation, memory and sample age of every GPU a lease holds."""
        m, now = self.rt.manager, self.rt.clock()
        state = GaugeMetricFamily("hostagent_gpu_state", "1 for the GPU's current state, 0 for every other (one "
                                  "series per GPU and state, as hostagent_gpus counts them)", labels=["gpu", "state"])
        holder = GaugeMetricFamily("hostagent_gpu_holder", "1 while a lease holds the GPU, labelled with the holding "
                                   "libvirt domain's name (no series while it is not held)", labels=["gpu", "domain"])
        total = GaugeMetricFamily("hostagent_gpu_memory_total_bytes", "the GPU's memory as the host read it "
                                  "(no series when unknown)", labels=["gpu"])
        util = GaugeMetricFamily("hostagent_gpu_utilization_percent", "utilisation in the guest's newest sample "
                                 "for the GPU (no series until its holder reports one)", labels=["gpu"])
        used = GaugeMetricFamily("hostagent_gpu_memory_used_bytes", "memory used in the guest's newest sample for "
                                 "the GPU (no series until its holder reports one)", labels=["gpu"])
        age = GaugeMetricFamily("hostagent_gpu_sample_age_seconds", "seconds since the time of the guest's newest "
                                "sample for a held GPU, or since the grant while the guest has sent none",
                                labels=["gpu"])
        sampled = GaugeMetricFamily("hostagent_gpu_sampled", "1 when the guest holding the GPU has reported a sample "
                                    "of it, 0 while none has come (then age counts from the grant)", labels=["gpu"])
        holders: dict[str, dict[str, dict[str, Any]]] = {}  # lease id -> its GPUs' newest samples
        for gid in sorted(m.gpus):
            current = m.gpu_state(gid)
            for st in GpuState:
                state.add_metric([gid, st.value], 1 if st is current else 0)
            if m.gpus[gid].memory_bytes is not None:
                total.add_metric([gid], m.gpus[gid].memory_bytes)
            lease = m.lease_of(gid)
            if lease is None:
                continue
            holder.add_metric([gid, lease.domain_name], 1)
            if lease.id not in holders:
                holders[lease.id] = self.newest.read(lease.id, self.rt.recent_samples.get(lease.id, ()))
            sample = holders[lease.id].get(gid)
            if sample is not None:
                util.add_metric([gid], sample["util_pct"])
                used.add_metric([gid], sample["mem_used_bytes"])
                age.add_metric([gid], max(0.0, now - sample["ts"]))  # a guest clock a little ahead: 0, not negative
                sampled.add_metric([gid], 1)
            elif lease.granted_at is not None:  # a guest that never reports goes stale like one that stopped
                age.add_metric([gid], max(0.0, now - lease.granted_at))
                sampled.add_metric([gid], 0)
        self.newest.keep(holders)
        yield from (state, holder, total, util, used, age, sampled)


class _NewestSamples:
    """Each held GPU's newest guest sample by time (not arrival: a guest may send samples it held back after newer
    ones), kept from one scrape to the next so that a scrape reads only the samples that arrived since the last:
    rescanning every lease's whole window (up to 4,096 samples each) took 13 ms of the event loop per scrape with 16
    leased GPUs."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {}  # lease -> (last read, newest)

    def read(self, lease_id: str, window: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The lease's newest sample per GPU, after reading its window back to the last sample read before (the
        whole window when that one has left it)."""
        last, newest = self.seen.get(lease_id, (None, {}))
        fresh = []
        for s in reversed(window):
            if s is last:
                break
            fresh.append(s)
        if fresh:
            newest = dict(newest)
            for s in reversed(fresh):  # in arrival order: of two samples of the same time, the later one counts
                best = newest.get(s["gpu_id"])
                if best is None or s["ts"] >= best["ts"]:
                    newest[s["gpu_id"]] = s
            self.seen[lease_id] = (window[-1], newest)
        return newest

    def keep(self, leases: Iterable[str]) -> None:
        """Forget the leases that no longer hold a GPU."""
        for lid in set(self.seen) - set(leases):
            del self.seen[lid]


@web.middleware
async def metrics_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Observe latency per route template (never per raw path: ids would explode the label set)."""
    t0 = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        info = request.match_info.route.resource
        route = info.canonical if info is not None else "unmatched"
        metrics: Metrics | None = request.app.get(METRICS)
        if metrics is not None and not route.startswith("/static"):
            metrics.request_seconds.labels(request.method, route, str(status)).observe(time.perf_counter() - t0)
            if request.get(SAMPLES_ACCEPTED):
                metrics.samples.inc(request[SAMPLES_ACCEPTED])


METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)


async def metrics_handler(request: web.Request) -> web.Response:
    """GET /metrics in the Prometheus text format, on the API's port: the operator's token is required (a scrape
    tells the load, leases and tenants of the host)."""
    ident(request, operator=True)
    return _render(request.app[METRICS])


def _render(metrics: Metrics) -> web.Response:
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def listener_app(metrics: Metrics) -> web.Application:
    """The app of agent.metrics_listen: /metrics alone, without a token (as Prometheus exporters serve it; whoever
    can reach that address may scrape, so keep it on loopback or a management network)."""
    app = web.Application()

    async def scrape(request: web.Request) -> web.Response:
        return _render(metrics)

    app.on_response_prepare.append(hide_server_version)
    app.router.add_get("/metrics", scrape)
    return app


def install(app: web.Application, runtime: AgentServices) -> Metrics:
    """Create the metrics, hook the lease listener, and add /metrics to the API (behind the operator's token) unless
    agent.metrics_listen gives it a listener of its own (serve() starts it from `app[METRICS]`)."""
    metrics = Metrics(runtime)
    app[METRICS] = metrics
    runtime.manager.listeners.append(metrics.on_lease)
    if not runtime.settings.agent.metrics_listen:
        app.router.add_get("/metrics", metrics_handler)
    return metrics
