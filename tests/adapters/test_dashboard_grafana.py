"""docs/grafana/hostagent.json is valid, and every series its panels query shows data after one exercise of the agent:
each query's selectors (metric name and label matchers, less the `host` label the Prometheus scrape adds) must match
at least one sample of /metrics, parsed with prometheus_client's parser, whose value is not 0. A series merely
exported (a `# TYPE` line) is not enough: a counter nothing increments, or a per-GPU gauge stuck at 0, would draw a
flat line on the board and still pass such a check."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from hostagent.domain.reclaim import Action
from tests.adapters.test_metrics_values import RECLAIM, check
from tests.support.agent import Clock
from tests.support.metrics import Scrape, scrape
from tests.support.storefault import StoreFault
from tests.support.topology import FakeHealthRunner, topology_rig
from tests.support.waits import until

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docs" / "grafana" / "hostagent.json"
SELECTOR = re.compile(r"\b(hostagent_[a-z0-9_]+)\b\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r'\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
TARGET_LABELS = {"host"}  # added by the scrape (relabel_configs), never by the agent
# series the board queries that this exercise cannot move, each with the reason; empty: every one moves
CANNOT_MOVE: dict[str, str] = {}


def exprs(doc: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the board: panel targets and template-variable queries."""
    out = [t["expr"] for p in doc["panels"] for t in p.get("targets", []) if t.get("expr")]
    for var in doc.get("templating", {}).get("list", []):
        q = var.get("query")
        if var.get("type") == "query":
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The series selectors of a PromQL expression: (metric name, [(label, op, value)]), target labels left out."""
    out = []
    for name, body in SELECTOR.findall(expr):
        matchers, rest = [], body
        while rest.strip():
            m = MATCHER.match(rest)
            assert m, f"cannot read the label matchers {body!r} in {expr!r}"
            matchers.append(m.groups())
            rest = rest[m.end():]
        out.append((name, [x for x in matchers if x[0] not in TARGET_LABELS]))
    return out


def matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    """PromQL's label matching (regular expressions anchored at both ends, a missing label reads as "")."""
    for label, op, value in matchers:
        have = labels.get(label, "")
        ok = {"=": have == value, "!=": have != value,
              "=~": re.fullmatch(value, have) is not None, "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def nonzero(s: Scrape, name: str, matchers: list[tuple[str, str, str]]) -> list[float]:
    """The non-zero values of the samples `name{matchers}` selects."""
    return [v for (n, labels), v in s.samples.items() if n == name and v != 0 and matches(dict(labels), matchers)]


class HeldHealthRunner(FakeHealthRunner):
    """A health runner that holds the probe of the GPUs in `held` (in the probe's worker thread) until `gate`
    opens, saying when it started: the GPU reads `probing` meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[str] = set()
        self.started = threading.Event()
        self.gate = threading.Event()

    def run(self, gpu: Any, budget_s: float) -> Any:
        if gpu.id in self.held:
            self.started.set()
            self.gate.wait(30)
        return super().run(gpu, budget_s)


def test_board_is_well_formed() -> None:
    doc = json.loads(GRAFANA.read_text())
    assert doc["uid"] and doc["title"] and doc["panels"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
    # every query names a series, with label matchers this test can read (host's aside)
    for expr in exprs(doc):
        assert selectors(expr), f"no hostagent_* series in {expr!r}"
    assert selectors('sum(x{host=~"$host",state="free"}) + hostagent_gpus{host=~"$host", state=~"free|leased"}') \
        == [("hostagent_gpus", [("state", "=~", "free|leased")])]


async def test_every_board_query_has_data_after_an_exercise(tmp_path: Path, aiohttp_client: Any) -> None:
    """One run that moves everything the board draws: a guest reporting, an idle reclaim, a warning, a stuck detach,
    a quarantine, a GPU the host preflight refuses (a failed lease: a step failure and a 500), a queued request, a
    probe under way, and a usage store that cannot be reached (spooling, with samples waiting to be written); then
    one scrape."""
    clock = Clock(time.time())
    health = HeldHealthRunner()
    rig, app, parts = topology_rig(tmp_path, runners=[health], clock=clock, reclaim=RECLAIM,
                               vms=("vm-a", "vm-b", "vm-c", "vm-d", "vm-e", "vm-f"),
                               store={"flush_interval_s": 60.0, "flush_batch": 10_000})
    rig.extra["clock"] = clock
    rig.client = await aiohttp_client(app)
    rt, m = rig.runtime, rig.runtime.manager

    async def lease(vm: str, status: int = 201, **body: Any) -> dict[str, Any]:
        r = await rig.client.post("/v1/leases", json=body or {"gpus": 1}, headers=rig.auth(vm))
        data = await r.json()
        assert r.status == status, data
        return dict(data)

    async def heartbeat(util: float, mem: int) -> None:  # vm-a's lease reports (timed by the guest's real clock)
        r = await rig.client.post(f"/v1/leases/{busy['id']}/heartbeat", headers=rig.auth("vm-a"), json={"samples": [
            {"ts": time.time(), "gpu": busy["devices"][0]["gpu_id"], "util_pct": util, "mem_used_bytes": mem}]})
        assert r.status == 200, await r.text()

    def free() -> list[str]:
        return sorted(g for g in m.gpus if m.gpu_state(g).value == "free")

    busy = await lease("vm-a")
    await heartbeat(50.0, 2 << 30)  # per-GPU utilisation and memory, the sample counter
    idle, warned = await lease("vm-b"), await lease("vm-c")
    assert await check(rig, idle["id"], 61, util=0.0) is Action.STRIKE_ONE
    assert await check(rig, idle["id"], 121, util=0.0) is Action.RECLAIM  # the notice
    assert await check(rig, idle["id"], 31) is Action.RECLAIM  # reclaimed: hostagent_reclaims_total
    assert await check(rig, warned["id"], 61, util=0.0) is Action.STRIKE_ONE  # stays warned
    stuck = await lease("vm-d")
    rig.hv.set_refuse_detach("vm-d")
    assert (await rig.client.delete(f"/v1/leases/{stuck['id']}", headers=rig.auth("vm-d"))).status == 202
    sick = free()[0]
    health.problems[sick] = ("1 uncorrectable ECC error(s) since the driver loaded",)
    r = await rig.client.post(f"/v1/gpus/{sick}/probe", headers=rig.auth("operator"))
    assert r.status == 200 and (await r.json())["quarantined"]
    # every free GPU is the firmware's boot display for one request: the GPU placed is refused and set aside
    boot_vga = {g: rig.tree.sys_root / "bus/pci/devices" / str(m.gpus[g].address) / "boot_vga" for g in free()}
    for path in boot_vga.values():
        path.write_text("1\n")
    await lease("vm-e", status=500)
    for path in boot_vga.values():
        path.write_text("0\n")
    assert len(free()) == 3
    await lease("vm-f", status=202, gpus=4, accept_deferred=True)  # more than is free: it waits
    health.held.add(free()[0])
    probing = parts.probes.schedule(free()[0], actor="test")  # held open across the scrape: a GPU probing
    await asyncio.get_running_loop().run_in_executor(None, health.started.wait, 10)
    fault = StoreFault(rt.store.store.engine)
    fault.unreachable()
    try:
        await heartbeat(60.0, 3 << 30)
        await rt.ingestor.flush()  # written to the spool
        await until(lambda: rt.store.status()["degraded"], 10, "the store degraded")
        await heartbeat(70.0, 3 << 30)  # waits in the ingest queue
        s = await scrape(rig.client, rig.operator)
    finally:
        fault.remove()
        health.gate.set()
        await probing

    doc = json.loads(GRAFANA.read_text())
    assert set(CANNOT_MOVE) <= {name for e in exprs(doc) for name, _ in selectors(e)}, "CANNOT_MOVE: not on the board"
    silent = []
    for expr in exprs(doc):
        for name, matchers in selectors(expr):
            if name in CANNOT_MOVE:
                continue
            if not nonzero(s, name, matchers):
                shown = ",".join(f'{k}{op}"{v}"' for k, op, v in matchers)
                silent.append(f"{name}{{{shown}}} (in {expr!r})")
    assert not silent, "board queries with no non-zero sample after the exercise:\n" + "\n".join(silent)
    # every GPU state the agent reports has a panel, so a new state cannot go unseen
    states = {dict(labels)["state"] for (n, labels) in s.samples if n == "hostagent_gpus"}
    assert states <= {t for e in exprs(doc) for t in re.findall(r'state="([a-z-]+)"', e)}
