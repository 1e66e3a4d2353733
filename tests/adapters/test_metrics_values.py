"""Every metric the docs or the Grafana board name, checked by value: for each, an exercise that must move it, then
/metrics read with the operator's token and parsed with prometheus_client's own parser, and the value asserted
(a counter by its exact increment, a gauge against what the agent really holds). `COVERED` maps each exported series
to the test that checks it; `test_every_documented_metric_has_a_value_test` fails when the docs or the board name a
series that has no entry here, or one that /metrics does not export under that name."""

from __future__ import annotations

import asyncio
import inspect
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.reclaim import Action
from hostagent.host.fakesysfs import record_interrupts
from hostagent.learn import lifecycle
from hostagent.store import spool as spool_module
from hostagent.store import writes as writes_module
from hostagent.store.spool import Spool
from hostagent.virt.port import DomainEvent, EventKind
from tests.adapters.test_store_limits import narrow_actor
from tests.support.agent import AgentRig, Clock, make_rig, start_rig
from tests.support.learn import fill_store
from tests.support.metrics import Scrape, scrape
from tests.support.storefault import StoreFault
from tests.support.topology import ALL, FakeHealthRunner, topology_rig
from tests.support.waits import until

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NOT_METRICS = {"hostagent_session"}  # the dashboard's session cookie, named in operations.md
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")

# exported series -> the test that moves it and checks its value
COVERED = {
    "hostagent_gpus": "test_gpus_leases_transitions_steps_and_requests",
    "hostagent_leases": "test_gpus_leases_transitions_steps_and_requests",
    "hostagent_lease_transitions_total": "test_gpus_leases_transitions_steps_and_requests",
    "hostagent_step_duration_seconds": "test_gpus_leases_transitions_steps_and_requests",
    "hostagent_http_request_duration_seconds": "test_gpus_leases_transitions_steps_and_requests",
    "hostagent_queue_depth": "test_queue_depth_follows_the_queue",
    "hostagent_step_failures_total": "test_a_failed_lease_counts_one_step_failure",
    "hostagent_heartbeat_samples_total": "test_heartbeat_samples_and_the_ingest_queue",
    "hostagent_ingest_queue_depth": "test_heartbeat_samples_and_the_ingest_queue",
    "hostagent_ingest_refused_over_share_total": "test_heartbeat_samples_and_the_ingest_queue",
    "hostagent_store_samples_waiting_seconds": "test_heartbeat_samples_and_the_ingest_queue",
    "hostagent_reclaims_total": "test_an_idle_reclaim_counts_once_and_warns_first",
    "hostagent_detach_alerts": "test_detach_alerts_count_leases_out_of_retries",
    "hostagent_leases_disputed": "test_a_disputed_lease_is_counted_while_the_dispute_lasts",
    "hostagent_preemptions_total": "test_a_preemption_counts_once_and_not_as_an_idle_reclaim",
    "hostagent_quarantined_gpus": "test_quarantine_and_clear",
    "hostagent_store_degraded": "test_store_outage_degrades_spools_and_recovers",
    "hostagent_store_spool_depth": "test_store_outage_degrades_spools_and_recovers",
    "hostagent_store_healthy": "test_store_outage_degrades_spools_and_recovers",
    "hostagent_store_unmirrored_events": "test_a_failing_mirror_shows_its_backlog_and_lag",
    "hostagent_store_mirror_lag_seconds": "test_a_failing_mirror_shows_its_backlog_and_lag",
    "hostagent_store_set_aside_writes": "test_refused_rows_are_set_aside_then_lost_when_full",
    "hostagent_store_rows_set_aside_total": "test_refused_rows_are_set_aside_then_lost_when_full",
    "hostagent_store_rows_lost_total": "test_refused_rows_are_set_aside_then_lost_when_full",
    "hostagent_model_version": "test_model_version_names_the_model_in_use",
    "hostagent_ready": "test_ready_follows_the_hypervisor_connection",
    "hostagent_memory_bytes": "test_memory_by_holder_and_python_blocks",
    "hostagent_out_of_band_changes_total": "test_out_of_band_changes_and_missing_functions",
    "hostagent_gpu_functions_missing": "test_out_of_band_changes_and_missing_functions",
    "hostagent_uevents_watching": "test_out_of_band_changes_and_missing_functions",
    "hostagent_python_allocated_blocks": "test_memory_by_holder_and_python_blocks",
    **dict.fromkeys(("hostagent_gpu_state", "hostagent_gpu_holder", "hostagent_gpu_memory_total_bytes",
                     "hostagent_gpu_utilization_percent", "hostagent_gpu_memory_used_bytes",
                     "hostagent_gpu_sample_age_seconds", "hostagent_gpu_sampled"),
                    "test_per_gpu_state_holder_and_guest_samples"),
}


def exported(s: Scrape) -> set[str]:
    """The series a scrape exports, as a query names them: counters with _total, histograms by their base name
    (prometheus_client's *_created companions are left out)."""
    out = set()
    for family, kind in s.types.items():
        if family.endswith("_created"):
            continue
        out.add(family + "_total" if kind == "counter" else family)
    return out


def documented() -> dict[str, list[str]]:
    """Every hostagent_* name in docs/*.md and the Grafana board -> the files naming it ('hostagent_store_*' style
    wildcards kept as written)."""
    names: dict[str, list[str]] = {}
    for path in sorted(DOCS.glob("*.md")) + sorted((DOCS / "grafana").glob("*.json")):
        for name in set(re.findall(r"hostagent_[a-z0-9_]*\*?", path.read_text())) - NOT_METRICS:
            names.setdefault(name, []).append(path.name)
    return names


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


async def op(rig: AgentRig, client: Any = None) -> Scrape:
    return await scrape(client or rig.client, rig.operator)


async def post_lease(client: Any, rig: AgentRig, vm: str, status: int = 201, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/leases", json=body or {"gpus": 1}, headers=rig.auth(vm))
    data = await r.json()
    assert r.status == status, data
    return dict(data)


# ---- the meta-test ---------------------------------------------------------------------------------------------


async def test_every_documented_metric_has_a_value_test(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    series = exported(await op(rig))
    here = {name: fn for name, fn in globals().items() if name.startswith("test_") and inspect.isfunction(fn)}
    assert set(COVERED.values()) <= set(here), "COVERED names a test this module does not have"
    assert set(COVERED) <= series, f"COVERED names series /metrics does not export: {set(COVERED) - series}"
    docs = documented()
    assert docs, "no hostagent_* name found in docs/"
    missing = []
    for name, where in sorted(docs.items()):
        if name == "hostagent_*":  # "the agents' hostagent_* series": the namespace, not a metric
            continue
        if name.endswith("*"):  # a family of series: every exported one with the prefix
            prefix = name[:-1]
            matching = {s for s in series if s.startswith(prefix)}
            assert matching, f"{', '.join(where)} name {name}, but /metrics exports no such series"
            missing += [f"{s} (as {name} in {', '.join(where)})" for s in sorted(matching - set(COVERED))]
            continue
        base = next((name[: -len(x)] for x in HISTOGRAM_SUFFIXES if name.endswith(x) and name[: -len(x)] in series),
                    name)
        assert base in series, f"{', '.join(where)} name {name}, which /metrics does not export (as {sorted(series)})"
        if base not in COVERED:
            missing.append(f"{base} (in {', '.join(where)})")
    assert not missing, "metrics named in the docs with no value test here: " + "; ".join(missing)


# ---- leases, GPUs, transitions, steps, requests ----------------------------------------------------------------


async def test_gpus_leases_transitions_steps_and_requests(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    s0 = await op(rig)
    assert s0.by_label("hostagent_gpus", "state") == {"free": 8, "leased": 0, "warned": 0, "detach-pending": 0,
                                                      "probing": 0, "quarantined": 0, "unavailable": 0}
    a = await post_lease(rig.client, rig, "vm-a", gpus=2)
    await post_lease(rig.client, rig, "vm-b", gpus=1)
    s1 = await op(rig)
    assert s1.value("hostagent_gpus", state="leased") == 3 and s1.value("hostagent_gpus", state="free") == 5
    listed = await (await rig.client.get("/v1/leases?state=ACTIVE", headers=rig.auth("operator"))).json()
    live = s1.by_label("hostagent_leases", "state")
    assert live["ACTIVE"] == len(listed["leases"]) == 2 and sum(live.values()) == 2
    # one count per lease for each state it was published in. REQUESTED (and RELEASING below) are journaled
    # together with the step after them and never published on their own, so they have no series
    grant = ("BINDING", "ATTACHING", "ACTIVE")
    assert s1.by_label("hostagent_lease_transitions_total", "to_state") == dict.fromkeys(grant, 2)
    # a bind per GPU, an attach per lease; nothing detached or given back yet
    steps = "hostagent_step_duration_seconds_count"
    assert [delta(s0, s1, steps, step=k) for k in ("bind", "attach", "detach", "give_back")] == [3, 2, 0, 0]
    assert s1.value("hostagent_step_duration_seconds_sum", step="bind") > 0
    assert s1.value("hostagent_step_duration_seconds_bucket", step="bind", le="+Inf") == 3
    # every request by route template and status, once
    req = "hostagent_http_request_duration_seconds_count"
    assert delta(s0, s1, req, method="POST", route="/v1/leases", status="201") == 2
    r = await rig.client.get("/v1/leases/l-nope", headers=rig.auth("operator"))
    assert r.status == 404
    assert (await rig.client.delete(f"/v1/leases/{a['id']}", headers=rig.auth("vm-a"))).status == 200
    s2 = await op(rig)
    assert delta(s1, s2, req, method="GET", route="/v1/leases/{lease_id}", status="404") == 1
    assert delta(s1, s2, req, method="DELETE", route="/v1/leases/{lease_id}", status="200") == 1
    assert delta(s1, s2, req, method="GET", route="/metrics", status="200") == 1  # s1's own scrape
    release = ("DETACHING", "REBINDING", "RELEASED")
    assert s2.by_label("hostagent_lease_transitions_total", "to_state") == dict.fromkeys(grant, 2) | \
        dict.fromkeys(release, 1)
    assert [delta(s1, s2, steps, step=k) for k in ("bind", "attach", "detach", "give_back")] == [0, 0, 1, 2]
    assert s2.value("hostagent_gpus", state="leased") == 1 and s2.value("hostagent_gpus", state="free") == 7
    assert s2.value("hostagent_leases", state="ACTIVE") == 1


async def test_queue_depth_follows_the_queue(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    full = await post_lease(rig.client, rig, "vm-a", gpus=8)
    waiting = [await post_lease(rig.client, rig, vm, status=202, gpus=1, accept_deferred=True)
               for vm in ("vm-b", "vm-c")]
    s = await op(rig)
    assert s.value("hostagent_queue_depth") == 2 and s.value("hostagent_leases", state="QUEUED") == 2
    assert (await rig.client.delete(f"/v1/leases/{waiting[1]['id']}", headers=rig.auth("vm-c"))).status == 200
    assert (await op(rig)).value("hostagent_queue_depth") == 1  # a cancelled request leaves the queue
    assert (await rig.client.delete(f"/v1/leases/{full['id']}", headers=rig.auth("vm-a"))).status == 200

    async def granted() -> bool:
        body = await (await rig.client.get(f"/v1/leases/{waiting[0]['id']}", headers=rig.auth("vm-b"))).json()
        return bool(body["state"] == "ACTIVE")

    deadline = time.monotonic() + 10
    while not await granted():
        assert time.monotonic() < deadline, "the queued request was not granted"
        await asyncio.sleep(0.02)
    s = await op(rig)
    assert s.value("hostagent_queue_depth") == 0 and s.value("hostagent_leases", state="QUEUED") == 0
    assert s.value("hostagent_leases", state="ACTIVE") == 1


async def test_a_failed_lease_counts_one_step_failure(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, hv_kwargs={"fail_attach_after": 0}), aiohttp_client)
    s0 = await op(rig)
    assert s0.get("hostagent_step_failures_total", step="lease") == 0
    for n in (1, 2):
        body = await post_lease(rig.client, rig, "vm-a", status=500)
        assert body["lease"]["state"] == "FAILED"
        s = await op(rig)
        assert s.value("hostagent_step_failures_total", step="lease") == n
        assert s.value("hostagent_lease_transitions_total", to_state="FAILED") == n
        assert delta(s0, s, "hostagent_http_request_duration_seconds_count", method="POST", route="/v1/leases",
                     status="500") == n
        assert s.value("hostagent_gpus", state="free") == 8  # rolled back


async def test_detach_alerts_count_leases_out_of_retries(tmp_path: Path, aiohttp_client: Any,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    rig = await start_rig(make_rig(tmp_path, libvirt={"detach_retries": 1}), aiohttp_client)
    lease = await post_lease(rig.client, rig, "vm-a")
    rig.hv.set_refuse_detach("vm-a")  # the guest never acknowledges a detach
    r = await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))
    assert r.status == 202 and (await r.json())["state"] == "DETACH_PENDING"
    s = await op(rig)
    assert s.value("hostagent_leases", state="DETACH_PENDING") == 1
    assert s.value("hostagent_detach_alerts") == 0  # one retry left: the agent still tries by itself
    await rig.runtime.manager.retry_pending()  # the retry, unacknowledged too: out of retries, the operator alerted
    s = await op(rig)
    assert s.value("hostagent_detach_alerts") == 1 and s.value("hostagent_gpus", state="detach-pending") == 1
    # the lease says so too, with how many detaches were asked (the request's and the one retry)
    body = await (await rig.client.get(f"/v1/leases/{lease['id']}", headers=rig.auth("operator"))).json()
    (alert_w,) = [w for w in body["warnings"] if w["code"] == "detach_alert"]
    assert alert_w["attempts"] == 2 and "libvirt.detach_retries" in alert_w["message"], body["warnings"]
    # the ERROR line carries the lease's id as a field (the JSON log's lease_id: what an operator searches by)
    (alert,) = [r for r in caplog.records if r.levelname == "ERROR" and "automatic retries stopped" in r.getMessage()]
    assert getattr(alert, "lease_id", None) == lease["id"], alert.__dict__
    assert rig.hv.acknowledge_detaches("vm-a") == 1  # the guest lets go after all: DEVICE_REMOVED ends the lease
    await until(lambda: lease["id"] not in rig.runtime.manager.leases, 10, "the lease ended")
    s = await op(rig)
    assert s.value("hostagent_detach_alerts") == 0 and s.value("hostagent_leases", state="DETACH_PENDING") == 0


# ---- heartbeats and the ingest queue ---------------------------------------------------------------------------


async def test_heartbeat_samples_and_the_ingest_queue(tmp_path: Path, aiohttp_client: Any) -> None:
    # the flusher far away (60 s, 10 000 samples): samples wait in the queue until the test flushes them;
    # a VM may hold half of a 100-sample queue
    rig = await start_rig(make_rig(tmp_path, store={"flush_interval_s": 60.0, "flush_batch": 10_000, "queue_max": 100,
                                                    "ingest_share": 0.5}), aiohttp_client)
    lease = await post_lease(rig.client, rig, "vm-a")
    gpu, url = lease["devices"][0]["gpu_id"], f"/v1/leases/{lease['id']}/heartbeat"

    def samples(n: int, util: float = 50.0) -> dict[str, Any]:
        now = time.time()
        return {"samples": [{"ts": now - n + i, "gpu": gpu, "util_pct": util, "mem_used_bytes": 0} for i in range(n)]}

    s0 = await op(rig)
    assert s0.value("hostagent_ingest_queue_depth") == 0 and s0.value("hostagent_store_samples_waiting_seconds") == 0
    t0 = time.monotonic()
    r = await rig.client.post(url, json=samples(20), headers=rig.auth("vm-a"))
    assert r.status == 200 and (await r.json())["accepted"] == 20
    await asyncio.sleep(0.05)
    s1 = await op(rig)
    waited = time.monotonic() - t0
    assert delta(s0, s1, "hostagent_heartbeat_samples_total") == 20
    assert s1.value("hostagent_ingest_queue_depth") == 20
    assert 0.05 <= s1.value("hostagent_store_samples_waiting_seconds") <= waited
    # refused heartbeats add nothing: a bad sample (400), and one over the VM's share of the queue (429)
    assert (await rig.client.post(url, json=samples(5, util=150.0), headers=rig.auth("vm-a"))).status == 400
    assert (await rig.client.post(url, json=samples(40), headers=rig.auth("vm-a"))).status == 429
    s2 = await op(rig)
    assert delta(s1, s2, "hostagent_heartbeat_samples_total") == 0
    assert delta(s1, s2, "hostagent_ingest_refused_over_share_total") == 1
    assert s2.value("hostagent_ingest_queue_depth") == 20
    # written: the queue is empty, nothing waits, and the store holds the 20
    await rig.runtime.ingestor.flush()
    s3 = await op(rig)
    assert s3.value("hostagent_ingest_queue_depth") == 0 and s3.value("hostagent_store_samples_waiting_seconds") == 0
    assert (await rig.runtime.store.lease_usage_summary(lease["id"]))["total"]["n"] == 20
    assert delta(s0, s3, "hostagent_heartbeat_samples_total") == 20


# ---- per GPU: state, holder, the guest's samples ---------------------------------------------------------------


def gpu_series(s: Scrape, name: str) -> dict[str, float]:
    """A per-GPU series by GPU id (a GPU without the series has no key: absent, not 0)."""
    return s.by_label(name, "gpu")


def gpu_labels(s: Scrape, name: str, label: str) -> dict[str, str]:
    """For each GPU, the `label` of its series of `name` that reads 1; every other series of it must read 0."""
    out: dict[str, str] = {}
    for (n, labels), v in s.samples.items():
        if n == name:
            assert v in (0, 1), (n, labels, v)
            if v == 1:
                d = dict(labels)
                assert d["gpu"] not in out, f"two series of {name} read 1 for {d['gpu']}"
                out[d["gpu"]] = d[label]
    return out


async def gpu_states(rig: AgentRig) -> dict[str, str]:
    """Each GPU's state as /v1/gpus reports it."""
    body = await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json()
    return {g["id"]: g["state"] for g in body["gpus"]}


async def test_per_gpu_state_holder_and_guest_samples(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock(time.time())
    rig = await start_rig(make_rig(tmp_path, clock=clock), aiohttp_client)
    gpus, gib = sorted(rig.runtime.manager.gpus), 1 << 30
    samples = ("hostagent_gpu_utilization_percent", "hostagent_gpu_memory_used_bytes",
               "hostagent_gpu_sample_age_seconds", "hostagent_gpu_sampled")
    s0 = await op(rig)
    assert len([k for k in s0.samples if k[0] == "hostagent_gpu_state"]) == 8 * 7  # every GPU, every state
    assert gpu_labels(s0, "hostagent_gpu_state", "state") == dict.fromkeys(gpus, "free")
    assert gpu_series(s0, "hostagent_gpu_memory_total_bytes") == {g: 40 * gib for g in gpus}
    assert all(gpu_series(s0, name) == {} for name in ("hostagent_gpu_holder", *samples))
    a = await post_lease(rig.client, rig, "vm-a", gpus=2)
    g0, g1 = (d["gpu_id"] for d in a["devices"])
    t = clock.now  # the grant's time (the clock stands still)
    s1 = await op(rig)
    assert gpu_labels(s1, "hostagent_gpu_state", "state") == await gpu_states(rig)
    assert gpu_labels(s1, "hostagent_gpu_holder", "domain") == {g0: "vm-a", g1: "vm-a"}
    # no heartbeat yet: no utilisation or memory (not a 0 nobody reported), the age counts from the grant
    assert gpu_series(s1, "hostagent_gpu_utilization_percent") == gpu_series(s1, "hostagent_gpu_memory_used_bytes") \
        == {}
    assert gpu_series(s1, "hostagent_gpu_sampled") == {g0: 0, g1: 0}
    assert gpu_series(s1, "hostagent_gpu_sample_age_seconds") == {g0: 0, g1: 0}
    url = f"/v1/leases/{a['id']}/heartbeat"
    r = await rig.client.post(url, headers=rig.auth("vm-a"), json={"samples": [  # the newest by time, not arrival
        {"ts": t + 1, "gpu": g0, "util_pct": 10, "mem_used_bytes": 1 * gib},
        {"ts": t + 3, "gpu": g0, "util_pct": 75, "mem_used_bytes": 3 * gib},
        {"ts": t + 2, "gpu": g0, "util_pct": 5, "mem_used_bytes": 2 * gib}]})
    assert r.status == 200, await r.text()
    clock.advance(60)
    s2 = await op(rig)
    assert delta(s1, s2, "hostagent_heartbeat_samples_total") == 3
    assert gpu_series(s2, "hostagent_gpu_utilization_percent") == {g0: 75}
    assert gpu_series(s2, "hostagent_gpu_memory_used_bytes") == {g0: 3 * gib}
    assert gpu_series(s2, "hostagent_gpu_sample_age_seconds") == {g0: 57, g1: 60}
    assert gpu_series(s2, "hostagent_gpu_sampled") == {g0: 1, g1: 0}
    r = await rig.client.post(url, headers=rig.auth("vm-a"), json={"samples": [
        {"ts": t + 50, "gpu": g1, "util_pct": 0, "mem_used_bytes": 0}]})  # an idle GPU: a real 0
    assert r.status == 200, await r.text()
    s3 = await op(rig)
    assert gpu_series(s3, "hostagent_gpu_utilization_percent") == {g0: 75, g1: 0}
    assert gpu_series(s3, "hostagent_gpu_memory_used_bytes") == {g0: 3 * gib, g1: 0}
    assert gpu_series(s3, "hostagent_gpu_sample_age_seconds") == {g0: 57, g1: 10}
    # a stuck detach: the GPU stays with its holder, in state detach-pending
    b = await post_lease(rig.client, rig, "vm-b")
    g2 = b["devices"][0]["gpu_id"]
    rig.hv.set_refuse_detach("vm-b")
    r = await rig.client.delete(f"/v1/leases/{b['id']}", headers=rig.auth("vm-b"))
    assert r.status == 202 and (await r.json())["state"] == "DETACH_PENDING"
    clock.advance(5)
    s4 = await op(rig)
    states = await gpu_states(rig)
    assert gpu_labels(s4, "hostagent_gpu_state", "state") == states and states[g2] == "detach-pending"
    assert gpu_labels(s4, "hostagent_gpu_holder", "domain") == {g0: "vm-a", g1: "vm-a", g2: "vm-b"}
    assert gpu_series(s4, "hostagent_gpu_sample_age_seconds") == {g0: 62, g1: 15, g2: 5}
    # released: the GPUs are free again and every series of their holder's samples is gone with it
    assert (await rig.client.delete(f"/v1/leases/{a['id']}", headers=rig.auth("vm-a"))).status == 200
    s5 = await op(rig)
    assert gpu_labels(s5, "hostagent_gpu_state", "state") == await gpu_states(rig)
    assert gpu_labels(s5, "hostagent_gpu_state", "state")[g0] == "free"
    assert gpu_labels(s5, "hostagent_gpu_holder", "domain") == {g2: "vm-b"}
    assert all(set(gpu_series(s5, name)) <= {g2} for name in samples)
    assert gpu_series(s5, "hostagent_gpu_sampled") == {g2: 0}
    assert len([k for k in s5.samples if k[0] == "hostagent_gpu_state"]) == 8 * 7


# ---- the reaper ------------------------------------------------------------------------------------------------


RECLAIM = {"enabled": True, "check_interval_s": 3600.0, "grace_s": 120.0, "min_lease_age_s": 0.0,
           "notice_window_s": 30.0, "idle_util_pct": 5.0}


async def reaper_rig(tmp_path: Path, aiohttp_client: Any, **kw: Any) -> AgentRig:
    clock = Clock(time.time())
    r = make_rig(tmp_path, clock=clock, reclaim=RECLAIM, **kw)
    r.extra["clock"] = clock
    r.runtime.use_store = False  # samples carry the test clock's times
    return await start_rig(r, aiohttp_client)


async def check(rig: AgentRig, lease_id: str, advance: float, util: float | None = None) -> Action | None:
    """Advance the clock; with `util`, the guest reported 3 samples of it meanwhile; then one reaper check."""
    clock: Clock = rig.extra["clock"]
    clock.advance(advance)
    if util is not None:
        lz = rig.runtime.manager.leases[lease_id]
        await rig.runtime.accept_samples(lz, [{"ts": clock.now - i * advance / 4, "gpu_id": lz.devices[0].gpu_id,
                                               "util_pct": util, "mem_used_bytes": 0, "work_rate": None}
                                              for i in range(3)])
    return await rig.runtime.reaper.check(lease_id, clock.now, rig.runtime.host.vfio_interrupts())


async def test_an_idle_reclaim_counts_once_and_warns_first(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await reaper_rig(tmp_path, aiohttp_client)
    idle = await post_lease(rig.client, rig, "vm-a")
    stuck = await post_lease(rig.client, rig, "vm-b")
    rig.hv.set_refuse_detach("vm-b")  # this guest never lets go of its GPU
    s0 = await op(rig)
    assert s0.by_label("hostagent_reclaims_total", "outcome") == {}
    for lease in (idle, stuck):
        assert await check(rig, lease["id"], 61, util=0.0) is Action.STRIKE_ONE
    s1 = await op(rig)
    assert s1.value("hostagent_gpus", state="warned") == 2 and s1.value("hostagent_gpus", state="leased") == 0
    for lease in (idle, stuck):
        assert await check(rig, lease["id"], 121, util=0.0) is Action.RECLAIM  # the notice
    s2 = await op(rig)
    assert s2.value("hostagent_gpus", state="warned") == 2 and s2.value("hostagent_gpus", state="leased") == 0
    assert s2.by_label("hostagent_reclaims_total", "outcome") == {}  # told, not reclaimed yet
    for lease in (idle, stuck):
        assert await check(rig, lease["id"], 31) is Action.RECLAIM  # the window passed
    s3 = await op(rig)
    assert s3.by_label("hostagent_reclaims_total", "outcome") == {"released": 1, "detach_pending": 1}
    assert s3.value("hostagent_gpus", state="detach-pending") == 1 and s3.value("hostagent_gpus", state="free") == 7
    assert s3.value("hostagent_leases", state="DETACH_PENDING") == 1 and s3.value("hostagent_gpus", state="warned") == 0
    s4 = await op(rig)  # a scrape is a read: counting again counts nothing new
    assert s4.by_label("hostagent_reclaims_total", "outcome") == s3.by_label("hostagent_reclaims_total", "outcome")


async def test_a_disputed_lease_is_counted_while_the_dispute_lasts(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await reaper_rig(tmp_path, aiohttp_client)
    leases = [await post_lease(rig.client, rig, vm) for vm in ("vm-a", "vm-b")]
    fns = [x["devices"][0]["functions"][0] for x in leases]
    for fn in fns:
        record_interrupts(rig.settings.proc_root, fn, 5)
    for lease in leases:
        assert await check(rig, lease["id"], 61, util=90.0) is Action.NONE  # the host's baseline
    assert (await op(rig)).value("hostagent_leases_disputed") == 0
    for lease in leases:  # busy guests, flat host counters: flagged
        assert await check(rig, lease["id"], 61, util=90.0) is Action.NONE
    assert (await op(rig)).value("hostagent_leases_disputed") == 2
    record_interrupts(rig.settings.proc_root, fns[0], 500)  # the host sees vm-a's GPU work again
    assert await check(rig, leases[0]["id"], 61, util=90.0) is Action.NONE
    assert (await op(rig)).value("hostagent_leases_disputed") == 1
    assert (await rig.client.delete(f"/v1/leases/{leases[1]['id']}", headers=rig.auth("vm-b"))).status == 200
    assert (await op(rig)).value("hostagent_leases_disputed") == 0, "a lease that ended is no longer disputed"


async def test_a_preemption_counts_once_and_not_as_an_idle_reclaim(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, leases={"guest_max_priority": 10, "preempt_min_priority": 5},
                                   reclaim={"notice_window_s": 0.5}), aiohttp_client)
    await post_lease(rig.client, rig, "vm-a", gpus=4, priority=1)
    low = await post_lease(rig.client, rig, "vm-b", gpus=4, priority=0)
    high = await post_lease(rig.client, rig, "vm-c", status=202, gpus=2, priority=6, accept_deferred=True)

    async def state(vm: str, lid: str) -> str:
        return str((await (await rig.client.get(f"/v1/leases/{lid}", headers=rig.auth(vm))).json())["state"])

    deadline = time.monotonic() + 10
    while await state("vm-c", high["id"]) != "ACTIVE":
        assert time.monotonic() < deadline, "the preempting request was not granted"
        await asyncio.sleep(0.02)
    assert await state("vm-b", low["id"]) == "RELEASED"
    s = await op(rig)
    assert s.by_label("hostagent_preemptions_total", "outcome") == {"released": 1}
    assert s.by_label("hostagent_reclaims_total", "outcome") == {}


# ---- quarantine ------------------------------------------------------------------------------------------------


async def test_quarantine_and_clear(tmp_path: Path, aiohttp_client: Any) -> None:
    health = FakeHealthRunner(problems={g: ("1 uncorrectable ECC error(s) since the driver loaded",) for g in ALL[:2]})
    rig, app, _ = topology_rig(tmp_path, runners=[health])
    client = await aiohttp_client(app)
    s = await op(rig, client)
    assert s.value("hostagent_quarantined_gpus") == 0
    for n, gpu in enumerate(ALL[:2], 1):
        body = await (await client.post(f"/v1/gpus/{gpu}/probe", headers=rig.auth("operator"))).json()
        assert body["quarantined"]
        s = await op(rig, client)
        assert s.value("hostagent_quarantined_gpus") == n == s.value("hostagent_gpus", state="quarantined")
        assert s.value("hostagent_gpus", state="free") == 8 - n
    r = await client.post(f"/v1/gpus/{ALL[0]}/clear-quarantine", headers=rig.auth("operator"))
    assert r.status == 200, await r.text()
    s = await op(rig, client)
    assert s.value("hostagent_quarantined_gpus") == 1 == s.value("hostagent_gpus", state="quarantined")


# ---- the usage store -------------------------------------------------------------------------------------------


async def settle(rig: AgentRig) -> None:
    """Flush queued samples and mirror the whole journal."""
    rt = rig.runtime
    await rt.ingestor.flush()
    while await rt.run(rt._mirror_batch):
        pass


async def test_store_outage_degrades_spools_and_recovers(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    rt = rig.runtime
    await settle(rig)
    s0 = await op(rig)
    assert (s0.value("hostagent_store_degraded"), s0.value("hostagent_store_healthy"),
            s0.value("hostagent_store_spool_depth")) == (0, 1, 0)
    fault = StoreFault(rt.store.store.engine)
    fault.unreachable()
    try:
        lease = await post_lease(rig.client, rig, "vm-a")  # leasing goes on; its journal entries spool
        await until(lambda: rt.store.status()["degraded"] and not rt.journal.unmirrored(1), 10, "spooled")
        s1 = await op(rig)
        on_disk = Spool(rig.settings.spool_path)  # the spool file, read on its own
        try:
            waiting = on_disk.depth
        finally:
            on_disk.close()
        assert waiting > 0 and s1.value("hostagent_store_spool_depth") == waiting
        assert s1.value("hostagent_store_degraded") == 1 and s1.value("hostagent_store_healthy") == 0
        r = await rig.client.post(f"/v1/leases/{lease['id']}/heartbeat", headers=rig.auth("vm-a"), json={
            "samples": [{"ts": time.time(), "gpu": lease["devices"][0]["gpu_id"], "util_pct": 5, "mem_used_bytes": 0}]})
        assert r.status == 200
        await rt.ingestor.flush()  # one more write, spooled
        assert (await op(rig)).value("hostagent_store_spool_depth") == waiting + 1
    finally:
        fault.remove()
    rt.store.kick()
    await until(lambda: not rt.store.status()["degraded"], 10, "spool replayed")
    s2 = await op(rig)
    assert (s2.value("hostagent_store_degraded"), s2.value("hostagent_store_healthy"),
            s2.value("hostagent_store_spool_depth")) == (0, 1, 0)
    assert (await rt.store.get_lease(lease["id"]))["state"] == "ACTIVE"  # what was spooled reached the store


async def test_a_failing_mirror_shows_its_backlog_and_lag(tmp_path: Path, aiohttp_client: Any) -> None:
    clock = Clock(time.time())
    rig = await start_rig(make_rig(tmp_path, clock=clock), aiohttp_client)
    rt = rig.runtime
    await settle(rig)
    s0 = await op(rig)
    assert s0.value("hostagent_store_unmirrored_events") == 0 and s0.value("hostagent_store_mirror_lag_seconds") == 0
    fault = StoreFault(rt.store.store.engine)
    fault.broken()
    try:
        written_at = clock.now
        await post_lease(rig.client, rig, "vm-a")
        await until(lambda: rt.mirror_error is not None and rt.mirror_backlog[0] > 0, 10, "the mirror failing")
        clock.advance(100.0)
        s1 = await op(rig)
        pending = len(rt.journal.unmirrored(1000))  # the journal's own count
        assert pending > 0 and s1.value("hostagent_store_unmirrored_events") == pending
        assert s1.value("hostagent_store_mirror_lag_seconds") == pytest.approx(clock.now - written_at) == 100.0
        assert s1.value("hostagent_store_healthy") == 0
    finally:
        fault.remove()
    await until(lambda: rt.mirror_error is None and rt.mirror_backlog == (0, None), 10, "the mirror caught up")
    s2 = await op(rig)
    assert s2.value("hostagent_store_unmirrored_events") == 0 and s2.value("hostagent_store_mirror_lag_seconds") == 0
    assert s2.value("hostagent_store_healthy") == 1


async def test_refused_rows_are_set_aside_then_lost_when_full(tmp_path: Path, aiohttp_client: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    rt = rig.runtime
    await settle(rig)
    s0 = await op(rig)
    assert [s0.value(n) for n in ("hostagent_store_set_aside_writes", "hostagent_store_rows_set_aside_total",
                                  "hostagent_store_rows_lost_total")] == [0, 0, 0]
    narrow_actor(rig.settings.store_url, 8)  # "agent", "mirror", "reaper" fit; "guest:vm-a" no longer does

    def refused(lease_id: str) -> list[Any]:
        return [e for e in rt.journal.events(lease_id=lease_id, limit=1000) if len(e.actor) > 8]

    lease = await post_lease(rig.client, rig, "vm-a")
    await settle(rig)
    first = refused(lease["id"])
    assert first, "the guest's own transitions are written with its actor"
    s1 = await op(rig)
    assert s1.value("hostagent_store_set_aside_writes") == len(first) == len(rt.store.store.rejected())
    assert s1.value("hostagent_store_rows_set_aside_total") == len(first)
    assert s1.value("hostagent_store_rows_lost_total") == 0
    assert s1.value("hostagent_store_healthy") == 0
    # the set-aside table is full (its bound lowered to what it holds): the next refused rows are lost, and counted
    monkeypatch.setattr(spool_module, "SET_ASIDE_MAX", len(first))
    monkeypatch.setattr(writes_module, "SET_ASIDE_MAX", len(first))
    assert (await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-a"))).status == 200
    await settle(rig)
    lost = len(refused(lease["id"])) - len(first)
    assert lost > 0
    s2 = await op(rig)
    assert s2.value("hostagent_store_rows_lost_total") == lost
    assert s2.value("hostagent_store_set_aside_writes") == len(first)  # nothing more kept
    assert s2.value("hostagent_store_rows_set_aside_total") == len(first)


# ---- the model, readiness, memory ------------------------------------------------------------------------------


async def test_model_version_names_the_model_in_use(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    rt = rig.runtime
    s0 = await op(rig)
    assert {k: v for k, v in s0.samples.items() if k[0] == "hostagent_model_version"} == {
        ("hostagent_model_version", frozenset({("version", "none"), ("rule", "cold-start")})): 1.0}
    fill_store(rig.settings.store_url, "fleet-1", tmp_path / "fill.sqlite3", 120, 1_700_000_000.0, seed=3)
    trained = await rt.run(lifecycle.train, rt.store.store, min_records=100)
    assert trained.decision == "promoted"
    await rt._load_model()  # what its next model check (placement.model_check_interval_s) does
    s1 = await op(rig)
    assert {k: v for k, v in s1.samples.items() if k[0] == "hostagent_model_version"} == {
        ("hostagent_model_version", frozenset({("version", trained.version), ("rule", "model")})): 1.0}


async def test_ready_follows_the_hypervisor_connection(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    assert (await op(rig)).value("hostagent_ready") == 1
    rig.hv._emit(DomainEvent("", "", EventKind.DISCONNECTED))
    assert (await op(rig)).value("hostagent_ready") == 0
    assert (await rig.client.get("/readyz")).status == 503  # the same verdict as the readiness probe
    rig.hv._emit(DomainEvent("", "", EventKind.RECONNECTED))
    assert (await op(rig)).value("hostagent_ready") == 1


async def test_memory_by_holder_and_python_blocks(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    mib = 1 << 20
    s0 = await op(rig)
    parts0 = s0.by_label("hostagent_memory_bytes", "part")
    assert set(parts0) == {"rss", "malloc_in_use", "malloc_free", "sqlite"} and parts0["rss"] > parts0["sqlite"] > 0
    blob = b"x" * (64 * mib)  # touched: resident, and held by malloc
    small = [(i, float(i)) for i in range(200_000)]  # 200 000 tuples and floats: Python's small-object blocks
    db = sqlite3.connect(":memory:")  # SQLite's own allocations
    db.execute("CREATE TABLE t (x BLOB)")
    db.executemany("INSERT INTO t VALUES (?)", [(b"y" * 1000,) for _ in range(8000)])
    s1 = await op(rig)
    parts1 = s1.by_label("hostagent_memory_bytes", "part")
    assert parts1["rss"] - parts0["rss"] >= 60 * mib
    assert parts1["malloc_in_use"] - parts0["malloc_in_use"] >= 60 * mib
    assert parts1["sqlite"] - parts0["sqlite"] >= 6 * mib
    assert delta(s0, s1, "hostagent_python_allocated_blocks") >= 350_000
    # freed below memory malloc keeps (the newest chunk stays, so the heap cannot shrink): free memory grows
    chunks = [bytes(2000) + bytes([i % 256]) for i in range(20_000)]
    s2 = await op(rig)
    del chunks[:-1]
    s3 = await op(rig)
    assert s3.value("hostagent_memory_bytes", part="malloc_free") - \
        s2.value("hostagent_memory_bytes", part="malloc_free") >= 30 * mib
    del blob, small
    db.close()
    s4 = await op(rig)
    assert parts1["malloc_in_use"] - s4.value("hostagent_memory_bytes", part="malloc_in_use") >= 60 * mib
    assert delta(s4, s1, "hostagent_python_allocated_blocks") >= 350_000
    assert len(chunks) == 1  # the last chunk lived until here


# ---- changes made outside the agent (the kernel's uevents) -------------------------------------------------------


async def test_out_of_band_changes_and_missing_functions(tmp_path: Path, aiohttp_client: Any) -> None:
    from hostagent.host.fakekernel import FakeKernel

    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    m = rig.runtime.manager
    before = await op(rig)
    assert before.value("hostagent_uevents_watching") == 1
    assert before.value("hostagent_gpu_functions_missing") == 0
    first, second = sorted(m.gpus)[:2]
    outside = FakeKernel(rig.tree.sys_root)
    outside.write(f"bus/pci/devices/{m.gpus[first].address}/remove", "1")
    outside.write("bus/pci/drivers/nvidia/unbind", str(m.gpus[second].address))
    counts = rig.runtime.watcher.counts
    # a change is counted once acted on (after its mark): wait for the counts, the last thing a finding does
    await until(lambda: first in m.quarantined and second in m.attention and counts["removed"] == 1
                and counts["unbound"] == 1, 5.0, "both findings")
    mid = await op(rig)
    assert delta(before, mid, "hostagent_out_of_band_changes_total", change="removed") == 1
    assert delta(before, mid, "hostagent_out_of_band_changes_total", change="unbound") == 1
    assert delta(before, mid, "hostagent_out_of_band_changes_total", change="vfio-bound") == 0
    assert mid.value("hostagent_gpu_functions_missing") == 1
    outside.write("bus/pci/rescan", "1")
    await until(lambda: not m.missing and rig.runtime.watcher.counts["returned"] == 1, 5.0, "the return")
    after = await op(rig)
    assert delta(mid, after, "hostagent_out_of_band_changes_total", change="returned") == 1
    assert after.value("hostagent_gpu_functions_missing") == 0
    # once it stops following the uevents (as when the netlink socket cannot be opened), the gauge says so
    await rig.runtime.watcher.stop()
    assert (await op(rig)).value("hostagent_uevents_watching") == 0

