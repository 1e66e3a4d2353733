"""The packing scenario on the fake dgx8 host: the agent's chooser against first-fit and random, same jobs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hostagent.domain.topology import Level
from hostagent.learn import packing_sim as sim


def test_needs_follow_the_host() -> None:
    topo = sim.host_topology("dgx8")
    assert [sim.need_for(topo, k) for k in (1, 2, 4, 8)] == [None, Level.SWITCH, Level.ROOT_COMPLEX, Level.SYSTEM]


def test_packing_grants_more_multi_gpu_requests_at_once(capsys: Any) -> None:
    results = sim.run("dgx8", 1500, 2, 0.7, sim.DEFAULT_MIX, sim.POLICIES)
    by = {p: [r for r in results if r.policy == p] for p in sim.POLICIES}
    mean = {p: sum(r.multi_immediate for r in rs) / len(rs) for p, rs in by.items()}
    assert mean["packing"] > mean["first-fit"] + 0.1
    assert mean["packing"] > mean["random"]
    # every policy saw the same jobs and carried the same load
    assert len({(r.jobs, round(r.utilization, 1)) for r in results}) == 1
    sim.table(results)
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("policy") and "packing" in out


def test_json_output(capsys: Any) -> None:
    assert sim.main(["--jobs", "200", "--seeds", "1", "--json", "--policies", "first-fit,packing"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in body["results"]] == ["first-fit", "packing"]
    assert set(body["results"][0]) >= {"multi_immediate", "immediate_by_size", "mean_wait", "frag_blocked"}
    with pytest.raises(SystemExit):
        sim.main(["--policies", "best"])
