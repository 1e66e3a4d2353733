"""schemathesis against the OpenAPI document the demo agent serves: thousands of generated requests, zero 5xx,
every response matching the schema. Runs the agent as a subprocess on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

ROOT = Path(__file__).parents[2]
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
COUNTS: dict[str, int] = {"requests": 0, "5xx": 0}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    state = tmp_path_factory.mktemp("fuzz")
    proc = subprocess.Popen([sys.executable, "-m", "hostagent", "demo", "--port", "0", "--state-dir", str(state),
                             "--scenario", "dgx8"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = None
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"hostagent: serving on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    assert url, "the demo did not start"
    creds = json.loads((state / "demo-credentials.json").read_text())
    yield {"url": url, "creds": creds, "proc": proc}
    proc.terminate()
    proc.wait(20)
    print(f"\nschemathesis: {COUNTS['requests']} requests, {COUNTS['5xx']} server errors")


def _check(case: Any, demo: dict[str, Any], token: str) -> None:
    response = case.call(base_url=demo["url"], headers={"Authorization": f"Bearer {token}"}, timeout=30)
    COUNTS["requests"] += 1
    COUNTS["5xx"] += response.status_code >= 500 and response.status_code != 503
    case.validate_response(response, checks=CHECKS)
    assert response.status_code < 500 or response.status_code == 503, response.text
    if response.status_code >= 400:
        body = response.json()
        assert set(body) >= {"error"} and {"code", "message"} <= set(body["error"]), body
        assert "Traceback" not in response.text and "/work/" not in response.text


def _fuzz(demo: dict[str, Any], token: str) -> None:
    """Every operation of the served document, driven by schemathesis' hypothesis strategies (no pytest plugin,
    so it does not depend on pytest internals)."""
    schema = schemathesis.openapi.from_url(demo["url"] + "/v1/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 14
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case: Any) -> None:
            _check(case, demo, token)

        run()


def test_api_as_operator(demo: dict[str, Any]) -> None:
    _fuzz(demo, demo["creds"]["operator"]["token"])


def test_api_as_guest(demo: dict[str, Any]) -> None:
    _fuzz(demo, demo["creds"]["vms"][0]["token"])
