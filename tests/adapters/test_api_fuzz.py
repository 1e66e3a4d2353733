"""schemathesis against the OpenAPI document the demo agent serves: thousands of generated requests, zero 5xx,
every response matching the schema. Runs the agent as a subprocess on loopback.

Three kinds of case per operation, as the operator and as a guest:
- positive: schema-valid data with generated ids; the server must accept it (positive_data_acceptance: 2xx or a
  401/403/404/409, never a 400/415 for a valid request, except on the fields the operation's `x-runtime-checks`
  names, whose last check depends on the caller or the agent's clock);
- seeded: positive data with a real GPU or lease id (and a real VM for createLease), so the 200-response schemas
  of getGpu, getLease, releaseLease, heartbeat, renewLease, reclaimControl, clearQuarantine and probeGpu are
  validated on real answers; every operation must show validated 2xx answers (or 403 where the guest may not);
- negative: schema-invalid data (negative_data_rejection: the server answers with a 4xx the document lists).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.parameters import ParameterLocation

ROOT = Path(__file__).parents[2]
EXAMPLES = 125  # per operation and identity, spread over the three kinds of case
SEEDED_IDS = {"getGpu": "gpu_id", "clearQuarantine": "gpu_id", "probeGpu": "gpu_id", "getLease": "lease_id",
              "releaseLease": "lease_id", "heartbeat": "lease_id", "renewLease": "lease_id",
              "reclaimControl": "lease_id", "moveLease": "lease_id", "moveDone": "lease_id"}
OPERATOR_ONLY = {"clearQuarantine", "probeGpu", "reclaimControl", "reaperStatus", "listEvents", "getFleet",
                 "moveLease"}
# from_url leaves out the operation that serves the document itself; test_openapi_document_itself covers it
NOT_FUZZED = {("GET", "/v1/openapi.json")}
STATS: dict[str, dict[str, collections.Counter[str]]] = {}


class Seeds:
    """Real ids for the seeded cases: GPUs of the demo host, a live lease of the first VM, fresh leases to release,
    and a GPU whose sysfs reports a fatal AER error, so that probing it quarantines it (for clearQuarantine)."""

    def __init__(self, url: str, creds: dict[str, Any], state: Path) -> None:
        self.url = url
        self.op = {"Authorization": f"Bearer {creds['operator']['token']}"}
        self.vm = creds["vms"][0]["domain"]
        gpus = requests.get(f"{url}/v1/gpus", headers=self.op, timeout=10).json()["gpus"]
        self.gpus = [g["id"] for g in gpus]
        sick = gpus[-1]
        self.sick = sick["id"]
        dev = state / "host/sys/bus/pci/devices" / sick["address"]
        (dev / "aer_dev_fatal").write_text("DLP 1\nTOTAL_ERR_FATAL 1\n")
        self.live: dict[str, Any] | None = None
        self.released: list[dict[str, Any]] = []

    def fresh(self) -> dict[str, Any]:
        """A new ACTIVE lease of the first VM; frees the host (releasing fuzzed leases) when it is full."""
        for _ in range(2):
            r = requests.post(f"{self.url}/v1/leases", headers=self.op, timeout=30,
                              json={"domain": self.vm, "gpus": 1, "task_type": "fuzz-seed"})
            if r.status_code == 201:
                return dict(r.json())
            if r.status_code == 202:
                requests.delete(f"{self.url}/v1/leases/{r.json()['id']}", headers=self.op, timeout=30)
            self.make_room()
        raise AssertionError(f"no fresh lease: {r.status_code} {r.text}")

    def make_room(self) -> None:
        """Release every fuzzed lease, live, queued or booked ahead (the queue backfills free GPUs with queued fuzz
        requests, so a host the fuzzer filled stays full until they go; a fuzzed booking makes its GPUs no target
        for a move of the live lease, which has no end), keeping the seeded live one."""
        live = requests.get(f"{self.url}/v1/leases?state=ACTIVE,QUEUED,BOOKED", headers=self.op, timeout=30).json()
        for lease in live["leases"]:
            if self.live is None or lease["id"] != self.live["id"]:
                requests.delete(f"{self.url}/v1/leases/{lease['id']}", headers=self.op, timeout=30)

    def lease(self, operation: str, pick: int) -> dict[str, Any]:
        """The lease a seeded case acts on: one to release (released ones again: a release is idempotent, and a
        fresh one costs the simulated guest's detach acknowledgement), else the live one, replaced once it is no
        longer ACTIVE."""
        if operation == "releaseLease":  # a fresh lease one time in four, else one released before (200 again)
            if not self.released or pick % 4 == 0:
                self.released.append(self.fresh())
            return self.released[pick % len(self.released)]
        if self.live is not None:  # ended since (an expiry after a fuzzed renew, a reclaim): every case a 409
            r = requests.get(f"{self.url}/v1/leases/{self.live['id']}", headers=self.op, timeout=30)
            if r.status_code != 200 or r.json().get("state") != "ACTIVE":
                self.live = None
        if self.live is None:
            self.live = self.fresh()
        return self.live

    def free_gpu(self, pick: int) -> str:
        """A free GPU (room made first when there is none)."""
        for _ in range(2):
            gpus = requests.get(f"{self.url}/v1/gpus", headers=self.op, timeout=10).json()["gpus"]
            free = [g["id"] for g in gpus if g["state"] == "free"]
            if free:
                return str(free[pick % len(free)])
            self.make_room()
        return self.gpus[0]

    def settle_move(self, lease: dict[str, Any]) -> None:
        """Finish a move a seeded case left waiting on the live lease (a second move would be a 409)."""
        requests.post(f"{self.url}/v1/leases/{lease['id']}/move/done", headers=self.op, timeout=30)
        current = requests.get(f"{self.url}/v1/leases/{lease['id']}", headers=self.op, timeout=30).json()
        if current.get("devices"):
            lease["devices"] = current["devices"]

    def start_move(self, lease: dict[str, Any]) -> None:
        """Move the live lease to a free GPU (the guest's confirmation is the case); where the first one cannot take
        it (booked ahead by a fuzzed request, say), room is made and another one tried."""
        for _ in range(2):
            r = requests.post(f"{self.url}/v1/leases/{lease['id']}/move", headers=self.op, timeout=30,
                              json={"to": self.free_gpu(0)})
            if r.status_code != 409:
                return
            self.make_room()

    def gpu(self, operation: str, pick: int) -> str:
        """A GPU id; clearQuarantine gets the sick GPU, quarantined just before (probing it quarantines it)."""
        if operation == "clearQuarantine":
            requests.post(f"{self.url}/v1/gpus/{self.sick}/probe", headers=self.op, timeout=30)
            return self.sick
        if operation == "probeGpu" and pick % 2 == 0:
            # one seeded probe in two finds its GPU free (probes run only between leases: a GPU the fuzzed
            # createLease cases hold answers 409), so that a probe's 200 is validated however the leases fell
            self.make_room()
            gpus = requests.get(f"{self.url}/v1/gpus", headers=self.op, timeout=10).json()["gpus"]
            free = [g["id"] for g in gpus if g["state"] == "free"]
            if free:
                return str(free[pick % len(free)])
        return self.gpus[pick % len(self.gpus)]

    def apply(self, case: Any, operation: str, pick: int, *, ids_only: bool = False) -> None:
        """Put real ids into a case (and, unless ids_only, a real GPU and time into heartbeat samples and a real VM
        into createLease); the values stay schema-valid, so a positive case stays positive, and a negative case
        whose path was not negated keeps its invalid body (ids_only) but now reaches the body's validation."""
        if operation in SEEDED_IDS and SEEDED_IDS[operation] == "gpu_id":
            case.path_parameters["gpu_id"] = self.gpu(operation, pick)
        elif operation in SEEDED_IDS:
            lease = self.lease(operation, pick)
            case.path_parameters["lease_id"] = lease["id"]
            if operation == "heartbeat" and isinstance(case.body, dict) and not ids_only:
                for sample in case.body.get("samples") or []:
                    sample.update(gpu=lease["devices"][0]["gpu_id"], ts=time.time() - 1)
            if operation in ("moveLease", "moveDone") and not ids_only:
                self.settle_move(lease)
                if operation == "moveDone":  # a move waiting for the guest's word, so that a 200 is validated
                    self.start_move(lease)
                elif isinstance(case.body, dict):  # a free GPU to move to (else every answer is a 409)
                    case.body.pop("from", None)
                    case.body["to"] = self.free_gpu(pick)
        elif operation == "createLease" and isinstance(case.body, dict) and not ids_only:
            case.body["domain"] = self.vm
            if pick % 2 == 0:  # one seeded request in two finds GPUs free, so that grants (201) are validated too
                self.make_room()


def _runtime_field(case: Any, response: Any) -> bool:
    """A 400 whose error field is one the operation's `x-runtime-checks` declares (samples[3].ts -> samples[].ts)."""
    if response.status_code != 400:
        return False
    declared = case.operation.definition.raw.get("x-runtime-checks", {})
    field = str(response.json()["error"].get("field") or "")
    return re.sub(r"\[\d+\]", "[]", field) in declared


def accepts_valid_data(ctx: Any, response: Any, case: Any) -> bool | None:
    """positive_data_acceptance, except a 400 on a field whose check the document declares as a runtime one."""
    if _runtime_field(case, response):
        return None
    return positive_data_acceptance(ctx, response, case)  # type: ignore[no-any-return]


def _negates_auth(mutation: Any) -> bool:
    return bool(mutation.parameter_location is ParameterLocation.HEADER
                and str(mutation.parameter or "").lower() == "authorization")


def rejects_invalid_data(ctx: Any, response: Any, case: Any) -> bool | None:
    """negative_data_rejection, judged by the request as sent: `_check` puts the Authorization header back, so a
    negation of that header is none. Without this, a case that also turned `since` into the one-element array
    [x] (sent as `since=x`, a valid query) failed as "schema-violating request accepted": schemathesis lets such
    an array pass only when every other mutation is neutralised too, and it still counted the header's."""
    data = case.meta.phase.data if case.meta is not None else None
    mutations = tuple(getattr(data, "mutations", ()) or ())
    kept = tuple(m for m in mutations if not _negates_auth(m))
    if len(kept) == len(mutations):
        return negative_data_rejection(ctx, response, case)  # type: ignore[no-any-return]
    if not kept:
        return None  # only the header was negated, and it was sent valid: nothing invalid reached the agent
    data.mutations = kept
    try:
        return negative_data_rejection(ctx, response, case)  # type: ignore[no-any-return]
    finally:
        data.mutations = mutations


CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
          accepts_valid_data, rejects_invalid_data]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    state = tmp_path_factory.mktemp("fuzz")
    log = state / "demo.log"  # a file, not a pipe: a pipe nobody drains fills up and blocks the agent's logging
    # The fuzzer sends a guest's requests far faster than a guest may (agent.guest_requests_per_s): what it tests
    # is how each request is answered, not the rate limit (tests/adapters/test_tenant_limits.py has that).
    env = {**os.environ, "HOSTAGENT_AGENT__GUEST_REQUESTS_PER_S": "1000000"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hostagent", "demo", "--port", "0", "--state-dir", str(state),
                                 "--scenario", "dgx8", "--quiet"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env=env)
    url = None
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
        m = re.search(r"hostagent: serving on (http://\S+)", log.read_text())
        url = m.group(1) if m else None
    assert url, f"the demo did not start: {log.read_text()[-2000:]}"
    creds = json.loads((state / "demo-credentials.json").read_text())
    yield {"url": url, "creds": creds, "proc": proc, "seeds": Seeds(url, creds, state)}
    proc.terminate()
    try:
        proc.wait(20)
    finally:
        proc.kill()
    _report()


def _report() -> None:
    """Per identity and operation: requests by kind, 2xx answers validated against the schema, statuses."""
    total = sum(c["kind"].total() for per_op in STATS.values() for c in per_op.values())
    errors = sum(n for per_op in STATS.values() for c in per_op.values() for s, n in c["status"].items()
                 if s >= "500")
    print(f"\nschemathesis: {total} requests, {errors} server errors")
    for who, per_op in STATS.items():
        for op, c in sorted(per_op.items()):
            kinds = " ".join(f"{k}={c['kind'][k]}" for k in ("positive", "seeded", "negative", "negative-seeded"))
            statuses = " ".join(f"{s}:{n}" for s, n in sorted(c["status"].items()))
            print(f"  {who:8} {op:16} {kinds:58} 2xx-validated={c['ok']['validated']:<4} "
                  f"{c['time']['ms'] / 1000:5.1f} s  {statuses}")


def _check(case: Any, kind: str, demo: dict[str, Any], token: str, stats: dict[str, collections.Counter[str]]) -> None:
    # On the case itself, so the checks see what was sent: a negative case whose only other negation was a
    # missing or mangled Authorization header is then judged by what remains (auth is test_auth_matrix's subject)
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
    response = case.call(base_url=demo["url"], timeout=30)
    stats["kind"][kind] += 1
    stats["status"][str(response.status_code)] += 1
    case.validate_response(response, checks=CHECKS)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert set(body) >= {"error"} and {"code", "message"} <= set(body["error"]), body
        assert "Traceback" not in response.text and "/work/" not in response.text
    elif response.status_code < 300:
        stats["ok"]["validated"] += 1  # validate_response passed: the body matched the 2xx schema


def _runner(operation: Any, name: str, demo: dict[str, Any], token: str,
            stats: dict[str, collections.Counter[str]]) -> Any:
    """A hypothesis test over the operation's positive, seeded and (where there is input to negate) negative cases."""
    kinds = [operation.as_strategy().map(lambda c: (c, "positive")),
             operation.as_strategy().map(lambda c: (c, "seeded"))]
    if operation.path_parameters or operation.query or operation.body:  # nothing to negate otherwise
        kinds.append(operation.as_strategy(GenerationMode.NEGATIVE).map(lambda c: (c, "negative")))

    @given(drawn=st.one_of(kinds), pick=st.integers(0, 63))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(drawn: tuple[Any, str], pick: int) -> None:
        case, kind = drawn
        if kind == "seeded":
            demo["seeds"].apply(case, name, pick)
        elif kind == "negative" and pick % 2 and name in SEEDED_IDS \
                and not case.meta.is_negative_at(ParameterLocation.PATH):
            kind = "negative-seeded"  # an invalid body sent to a real lease: the body's own checks must refuse it
            demo["seeds"].apply(case, name, pick, ids_only=True)
        t0 = time.perf_counter()
        _check(case, kind, demo, token, stats)
        stats["time"]["ms"] += round((time.perf_counter() - t0) * 1000)

    return run


def _fuzz(demo: dict[str, Any], who: str, token: str) -> None:
    """Every operation of the served document, driven by schemathesis' hypothesis strategies (no pytest plugin,
    so it does not depend on pytest internals)."""
    auth = {"Authorization": f"Bearer {token}"}
    served = requests.get(demo["url"] + "/v1/openapi.json", headers=auth, timeout=10).json()
    documented = {(m.upper(), p) for p, ops in served["paths"].items() for m in ops}
    schema = schemathesis.openapi.from_url(demo["url"] + "/v1/openapi.json", headers=auth)
    operations = [op.ok() for op in schema.get_all_operations()]
    fuzzed = {(op.method.upper(), op.path) for op in operations}
    assert len(operations) == len(fuzzed) == len(documented) - len(NOT_FUZZED), (documented - fuzzed, fuzzed)
    assert documented - fuzzed == NOT_FUZZED and fuzzed <= documented
    per_op = STATS.setdefault(who, {})
    for operation in operations:
        name = operation.definition.raw["operationId"]
        stats = per_op.setdefault(name, {"kind": collections.Counter(), "status": collections.Counter(),
                                         "ok": collections.Counter(), "time": collections.Counter()})
        _runner(operation, name, demo, token, stats)()
    for name, stats in per_op.items():
        if who != "operator" and name in OPERATOR_ONLY:
            assert stats["status"]["403"] and not stats["ok"]["validated"], (who, name, stats)
        else:
            assert stats["ok"]["validated"] >= 3, f"{who} {name}: no 2xx answer validated: {stats}"
        assert stats["kind"]["positive"] and stats["kind"]["seeded"], (who, name, stats)


def test_api_as_operator(demo: dict[str, Any]) -> None:
    _fuzz(demo, "operator", demo["creds"]["operator"]["token"])


def test_api_as_guest(demo: dict[str, Any]) -> None:
    _fuzz(demo, "guest", demo["creds"]["vms"][0]["token"])


def test_openapi_document_itself(demo: dict[str, Any]) -> None:
    """The one operation from_url does not fuzz: it serves a valid OpenAPI 3 document, to any token holder."""
    assert requests.get(demo["url"] + "/v1/openapi.json", timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {demo['creds']['vms'][0]['token']}"}
    r = requests.get(demo["url"] + "/v1/openapi.json", headers=auth, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    validate(r.json())
