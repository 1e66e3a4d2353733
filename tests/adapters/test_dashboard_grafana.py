"""docs/grafana/hostagent.json is valid and every series it queries is one the agent really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.support.agent import make_rig, start_rig

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docs" / "grafana" / "hostagent.json"
SUFFIXES = ("_bucket", "_count", "_sum")


def exprs(doc: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", []) if t.get("expr")]


async def test_grafana_queries_use_exported_series(tmp_path: Path, aiohttp_client: Any) -> None:
    doc = json.loads(GRAFANA.read_text())
    assert doc["uid"] and doc["title"] and doc["panels"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    assert r.status == 201
    text = await (await rig.client.get("/metrics", headers=rig.auth("operator"))).text()
    exported = set(re.findall(r"^# TYPE (hostagent_\w+) ", text, re.M))
    assert "hostagent_gpus" in exported
    used = {m for e in exprs(doc) for m in re.findall(r"hostagent_\w+", e)}
    assert used, "no hostagent_* queries"
    for name in sorted(used):
        base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s) and name[: -len(s)] in exported), name)
        assert base in exported, f"{name} is not exported by /metrics"
    # every GPU state the agent reports has a panel, so a new state cannot go unseen
    states = set(re.findall(r'hostagent_gpus\{state="([a-z-]+)"\}', text))
    assert states <= {t for e in exprs(doc) for t in re.findall(r'state="([a-z-]+)"', e)}
