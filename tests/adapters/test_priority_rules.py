"""Priority from the operator's policy (issue #22): a request that states no priority gets the first of
`leases.priority_rules` it matches (task type, project, VM, length), named in its reasons; a stated priority is
still capped by the guests' policy; bad rules refuse to load. Through the API, configured as the agent is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hostagent.config import settings_from_dict
from hostagent.domain.errors import ConfigError
from tests.support.agent import AgentRig, make_rig, start_rig

RULES = {
    "short": {"priority": 5, "max_duration_s": 3600},
    "notebooks": {"priority": -5, "task_type": "notebook"},
    "research": {"priority": 3, "project": "research"},
    "vm-d": {"priority": 7, "domains": ["vm-d"], "task_type": "training"},
}


async def lease(rig: AgentRig, who: str, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json={"gpus": 1, **body}, headers=rig.auth(who))
    data = await r.json()
    assert r.status == 201, data
    return data


async def test_a_request_that_states_no_priority_gets_the_first_rule_it_matches(tmp_path: Path,
                                                                                aiohttp_client: Any) -> None:
    rig = await start_rig(make_rig(tmp_path, leases={
        "priority_rules": RULES, "projects": {"research": {"domains": ["vm-c"]}}}), aiohttp_client)
    short = await lease(rig, "vm-a", duration_s=600, task_type="notebook")  # "short" comes first in the file
    assert short["request"]["priority"] == 5
    assert any("from the operator's rule 'short'" in r for r in short["reasons"]), short["reasons"]
    notebook = await lease(rig, "vm-a", task_type="notebook")  # 8 hours by default: not short
    assert notebook["request"]["priority"] == -5
    member = await lease(rig, "vm-c")  # vm-c is in the research project
    assert member["request"]["priority"] == 3
    named = await lease(rig, "vm-b", project="research")  # or the request names it
    assert named["request"]["priority"] == 3
    mine = await lease(rig, "vm-d", task_type="training")
    assert mine["request"]["priority"] == 7
    other = await lease(rig, "vm-b", task_type="training")  # no rule: 0, and nothing said
    assert other["request"]["priority"] == 0 and not any("operator's rule" in r for r in other["reasons"]), other
    # a stated priority is the guest's own, capped by the guests' policy (0 here), not raised by a rule
    stated = await lease(rig, "vm-d", task_type="training", priority=9)
    assert stated["request"]["priority"] == 0 and any("capped to 0" in r for r in stated["reasons"])


@pytest.mark.parametrize(("rules", "field"), [
    ({"x": {"task_type": "a"}}, "leases.priority_rules.x.priority"),  # a rule must say its priority
    ({"x": {"priority": 1, "taks_type": "a"}}, "leases.priority_rules.x.taks_type"),  # a typo is refused
    ({"x": {"priority": 1, "project": "nope"}}, "leases.priority_rules.x.project"),  # no such project
    ({"x": {"priority": 5000}}, "leases.priority_rules.x.priority"),
    ({"x": {"priority": 1, "max_duration_s": 0}}, "leases.priority_rules.x.max_duration_s"),
    ({"x": {"priority": 1, "domains": "vm-a"}}, "leases.priority_rules.x.domains"),
])
def test_bad_rules_refuse_to_load(rules: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict({"leases": {"priority_rules": rules}})
    assert info.value.field == field
