"""The OpenAPI 3 document served at /v1/openapi.json. A test walks it against the registered routes."""

from __future__ import annotations

from typing import Any

from hostagent import __version__
from hostagent.config import LeaseSettings
from hostagent.domain.capabilities import FEATURES
from hostagent.domain.inventory import GpuState
from hostagent.domain.lease import (
    LABEL_FIELDS,
    LABEL_PATTERN,
    MAX_GPUS_PER_REQUEST,
    NUMA_POLICIES,
    PRECISIONS,
    LeaseState,
)

_ERROR = {"$ref": "#/components/schemas/Error"}


def _err(desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": _ERROR}}}


def _ok(desc: str, ref: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


_STD = {"400": _err("invalid input"), "401": _err("missing or bad token"), "403": _err("not allowed"),
        "404": _err("not found")}
_LEASE_ID = {"name": "lease_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 64}}
_GPU_ID = {"name": "gpu_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 64}}
_SECURED = [{"bearer": []}]
MAX_PAGE = 1000  # GET /v1/leases returns at most this many per page; next_cursor leads on

_NULLABLE_NUM = {"type": "number", "nullable": True}
_NULLABLE_STR = {"type": "string", "nullable": True}
# Comma-separated lease states, any letter case, blanks around the names (GET /v1/leases?state=); the handler
# checks the same pattern before it parses, so what the document allows and what the server accepts are one set.
STATE_FILTER_PATTERN = "^ *({names})? *(, *({names})? *)*$".format(names="|".join(
    "".join(f"[{c}{c.lower()}]" if c.isalpha() else c for c in s.value) for s in LeaseState))
MAX_HEARTBEAT_MEM_BYTES = 2**50
MAX_WORK_RATE = 1e15  # the usage store's bound; the heartbeat handler checks it before anything is written


_FLEET_HOST = {"type": "object", "required": ["id", "last_seen", "stale", "gpus", "states"], "properties": {
    "id": {"type": "string"}, "hostname": _NULLABLE_STR, "agent_version": _NULLABLE_STR, "this": {"type": "boolean"},
    "url": {**_NULLABLE_STR, "description": "the host's own dashboard (agent.public_url, else its bound address)"},
    "last_seen": _NULLABLE_NUM, "age": {"type": "number"}, "interval_s": {"type": "number"},
    "stale_after": {"type": "number"},
    "stale": {"type": "boolean", "description": "not heard from in 3 of its publish intervals"},
    "stopped": {"type": "boolean"}, "publishing": {"type": "boolean"}, "gpus": {"type": "integer"},
    "states": {"type": "object", "additionalProperties": {"type": "integer"}, "description": "GPUs by state"},
    "util_pct": _NULLABLE_NUM, "queue": {"type": "integer", "nullable": True},
    "active_leases": {"type": "integer", "nullable": True}, "model_version": _NULLABLE_STR,
    "model_current": {"type": "boolean"}, "idle": {"type": "array", "items": {"type": "object"}}}}
_FLEET = {"type": "object", "required": ["hosts", "idle", "totals", "store"], "properties": {
    "now": {"type": "number"}, "store": {"type": "boolean", "description": "false: this agent has no usage store"},
    "hosts": {"type": "array", "items": _FLEET_HOST},
    "idle": {"type": "array", "items": {"type": "object"}, "description": "leases on an idle strike, every host's"},
    "totals": {"type": "object"}, "active_model": _NULLABLE_STR}}


def _label(max_len: int, **extra: Any) -> dict[str, Any]:
    """A free-text label of the lease request: no control or invisible formatting characters, as the request
    parser checks (the same pattern)."""
    return {"type": "string", "minLength": 1, "maxLength": max_len, "pattern": LABEL_PATTERN, **extra}


def document(*, max_duration_s: int = LeaseSettings.max_duration_s) -> dict[str, Any]:
    """The whole OpenAPI document; `max_duration_s` is the agent's configured [leases] maximum.

    Each operation's `x-runtime-checks` names the request fields whose last check depends on the caller or on
    the server's state or clock (a static schema cannot say it): a schema-valid value there may still get a 400
    whose error `field` names it. The schemathesis test tolerates a 400 on a valid request for those fields only.
    """
    lease_request = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "gpus": {"type": "integer", "minimum": 1, "maximum": MAX_GPUS_PER_REQUEST, "default": 1},
            "task_type": _label(64),
            "data_scale": {"type": "number", "minimum": 0, "maximum": 1e18, "nullable": True},
            "precision": {"type": "string", "enum": list(PRECISIONS), "nullable": True},
            "min_memory_gib": {"type": "number", "minimum": 0, "maximum": 4096},
            "duration_s": {"type": "integer", "minimum": 1, "maximum": max_duration_s, "nullable": True},
            "priority": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "accept_partial": {"type": "boolean"},
            "top_up": {"type": "boolean", "default": True,
                       "description": "a partial grant (accept_partial) is topped up as GPUs free, one at a time, "
                                      "hot-attached to the same VM (the heartbeat reply's granted_gpus rises); "
                                      "false keeps what was granted"},
            "accept_deferred": {"type": "boolean"},
            "movable": {"type": "boolean", "default": False,
                        "description": "the guest can move its work to another GPU when told (the guest agent "
                                       "sends it when it has an on_move hook): the agent may then move this "
                                       "lease make-before-break to free a whole block for a waiting request "
                                       "(leases.consolidate)"},
            "not_after": {"type": "number", "minimum": 0, "maximum": 1e11, "nullable": True,
                          "description": "unix seconds, in the future (checked against the agent's clock)"},
            "start_at": {"type": "number", "minimum": 0, "maximum": 1e11, "nullable": True,
                         "description": "a booking: the GPUs from this time (unix seconds, in the future, within "
                                        "leases.booking_horizon_s) for duration_s (required), state BOOKED until "
                                        "then. Refused (409, with earliest_start and available_in_s) when they are "
                                        "not free; accept_deferred books the earliest window instead, "
                                        "accept_partial takes what is free at start_at"},
            "idempotency_key": _label(128, nullable=True),
            "vendor": _label(128, nullable=True),
            "model": _label(128, nullable=True),
            "numa_policy": {"type": "string", "enum": list(NUMA_POLICIES), "nullable": True},
            "project": _label(128, nullable=True),
            "requires": {"type": "array", "items": {"type": "string", "enum": list(FEATURES)},
                         "maxItems": 2 * len(FEATURES), "nullable": True,
                         "description": "features every GPU of the lease must have (from its chip and the host's "
                                        "NVLink hints); a request no GPU here could serve is refused (409)"},
            "total_memory_gib": {"type": "number", "minimum": 0.001, "maximum": 4096 * MAX_GPUS_PER_REQUEST,
                                 "nullable": True,
                                 "description": "instead of gpus: the fewest GPUs of which each holds at least this "
                                                "much divided by their number (400 when gpus is given too)"},
            "target_work_rate": {"type": "number", "minimum": 1e-6, "maximum": 1e15, "nullable": True,
                                 "description": "instead of gpus: the fewest GPUs whose work rates, as the active "
                                                "model predicts them for task_type (required), sum to this (the unit "
                                                "the guest agent reports as work_rate, per second); the reasons give "
                                                "the prediction for the GPUs granted. 409 without a model that "
                                                "covers the task type, or when no set of this host's GPUs reaches it"},
            "domain": {"type": "string", "minLength": 1, "maxLength": 256,
                       "description": "the VM (name or UUID) to lease for: required from an operator (400 without "
                                      "it); a guest may send only its own VM's name or UUID (403 otherwise)"},
        },
    }
    lease = {
        "type": "object",
        "required": ["id", "state", "domain", "devices", "created_at", "reasons", "warnings"],
        "properties": {
            "id": {"type": "string"},
            "state": {"type": "string", "enum": [s.value for s in LeaseState]},
            "domain": {"type": "object", "properties": {"uuid": {"type": "string"}, "name": {"type": "string"}}},
            "request": {"type": "object"},
            "granted_gpus": {"type": "integer"},
            "devices": {"type": "array", "items": {"type": "object", "properties": {
                "gpu_id": {"type": "string"}, "functions": {"type": "array", "items": {"type": "string"}},
                "guest_addresses": {"type": "array", "items": {"type": "string"}},
                "iommu_group": {"type": "integer"}}}},
            "created_at": {"type": "number"},
            "granted_at": _NULLABLE_NUM,
            "expires_at": _NULLABLE_NUM,
            "ended_at": _NULLABLE_NUM,
            "end_reason": _NULLABLE_STR,
            "reasons": {"type": "array", "items": {"type": "string"}},
            "distance": {"type": "number", "nullable": True},
            "error": _NULLABLE_STR,
            "warnings": {"type": "array", "items": {"type": "object"}},
            "reclaim": {"type": "object"},
            "queue": {"type": "object", "properties": {"position": {"type": "integer", "nullable": True},
                                                        "eta": _NULLABLE_NUM,
                                                        "deadline": {**_NULLABLE_NUM, "description":
                                                                     "when the request expires if still queued "
                                                                     "(not_after or leases.queue_max_wait_s)"},
                                                        "note": {**_NULLABLE_STR, "description":
                                                                 "why it waits beyond its turn: passed over by "
                                                                 "requests that gain more from the free GPUs, or "
                                                                 "waiting for a better GPU"},
                                                        "consolidation": {"type": "object", "nullable": True,
                                                                          "description": "it waits only because "
                                                                          "the free GPUs are scattered: the fewest "
                                                                          "moves that would free a block for it "
                                                                          "(block, frees, moves, message, "
                                                                          "performed)"}}},
            "usage": {"type": "object"},
            "placement": {"type": "object"},
            "partial": {"type": "object", "description": "an ACTIVE lease granted fewer GPUs than it asked",
                        "properties": {"asked": {"type": "integer"}, "granted": {"type": "integer"},
                                       "top_up": {"type": "boolean"},
                                       "adding": {"type": "array", "items": {"type": "string"}},
                                       "rest_expected_at": {**_NULLABLE_NUM, "description": "when the GPUs it "
                                                            "still waits for are expected free"}}},
            "booking": {"type": "object", "description": "a booking's window and GPUs (start_at requests)",
                        "properties": {"start_at": {"type": "number"}, "end_at": {"type": "number"},
                                       "gpus": {"type": "array", "items": {"type": "string"}},
                                       "binds_at": {**_NULLABLE_NUM, "description": "when the agent binds and "
                                                    "attaches its GPUs (its start less the lead time), while "
                                                    "BOOKED"}}},
        },
    }
    gpu = {
        "type": "object",
        "required": ["id", "address", "vendor", "model", "memory_bytes", "numa_node", "iommu_group", "functions",
                     "state"],
        "properties": {
            "id": {"type": "string"},
            "address": {"type": "string", "pattern": "^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\\.[0-7]$"},
            "vendor": {"type": "string"},
            "model": {"type": "string"},
            "memory_bytes": {"type": "integer", "nullable": True},
            "memory_source": {"type": "string", "enum": ["sysfs", "name", "bar", "probe", "unknown"],
                              "description": "where memory_bytes comes from: the driver's sysfs, the pci.ids name, "
                                             "the largest BAR (an upper bound), a probe (the driver's own figure, "
                                             "replacing bar or unknown), or unknown"},
            "capabilities": {"type": "object", "required": ["features", "source"], "properties": {
                "features": {"type": "array", "nullable": True, "items": {"type": "string", "enum": list(FEATURES)},
                             "description": "what a request may require of this GPU; null when its chip is unknown"},
                "source": {"type": "string", "description": "where the features were read from, and what its "
                                                            "latest probe added or removed"}}},
            "numa_node": {"type": "integer", "nullable": True},
            "iommu_group": {"type": "integer", "nullable": True},
            "functions": {"type": "array", "items": {"type": "object", "required": ["address", "class", "driver"],
                                                     "properties": {"address": {"type": "string"},
                                                                    "class": {"type": "string"},
                                                                    "driver": _NULLABLE_STR,
                                                                    "name": {"type": "string"}}}},
            "state": {"type": "string", "enum": [s.value for s in GpuState]},
            "missing_functions": {"type": "array", "items": {"type": "string"},
                                  "description": "functions the kernel took off the PCI bus (removed through sysfs, "
                                                 "or fallen off) and not back yet; the GPU is quarantined meanwhile"},
        },
    }
    sample = {
        "type": "object", "additionalProperties": False, "required": ["ts", "gpu", "util_pct"],
        "properties": {
            "ts": {"type": "number", "description": "unix seconds, at most 300 s ahead of the agent's clock and at "
                                                   "most 7 days behind it"},
            "gpu": {"type": "string", "description": "a GPU id of this lease"},
            "util_pct": {"type": "number", "minimum": 0, "maximum": 100},
            "mem_used_bytes": {"type": "integer", "minimum": 0, "maximum": MAX_HEARTBEAT_MEM_BYTES},
            "work_rate": {"type": "number", "minimum": 0, "maximum": MAX_WORK_RATE, "nullable": True},
        },
    }
    paths: dict[str, Any] = {
        "/healthz": {"get": {"summary": "liveness", "operationId": "healthz", "security": [],
                             "responses": {"200": {"description": "alive", "content": {"application/json": {
                                 "schema": {"type": "object"}}}}}}},
        "/readyz": {"get": {"summary": "readiness (reconciled, hypervisor, store)", "operationId": "readyz",
                            "security": [],
                            "responses": {"200": {"description": "ready", "content": {"application/json": {
                                "schema": {"type": "object"}}}},
                                "503": {"description": "not ready", "content": {"application/json": {
                                    "schema": {"type": "object"}}}}}}},
        "/v1/openapi.json": {"get": {"summary": "this document", "operationId": "openapi", "security": _SECURED,
                                     "responses": {"200": {"description": "OpenAPI document", "content": {
                                         "application/json": {"schema": {"type": "object"}}}}}}},
        "/v1/gpus": {"get": {"summary": "every GPU with its state", "operationId": "listGpus", "security": _SECURED,
                             "responses": {"200": {"description": "GPUs", "content": {"application/json": {"schema": {
                                 "type": "object", "properties": {"gpus": {"type": "array", "items": {
                                     "$ref": "#/components/schemas/Gpu"}}}}}}}}}},
        "/v1/gpus/{gpu_id}": {"get": {"summary": "one GPU with its lease and history", "operationId": "getGpu",
                                      "security": _SECURED,
                                      "parameters": [_GPU_ID],
                                      "responses": {"200": _ok("the GPU", "Gpu"), "404": _err("unknown GPU")}}},
        "/v1/gpus/{gpu_id}/clear-quarantine": {"post": {
            "summary": "operator: clear a quarantine", "operationId": "clearQuarantine", "security": _SECURED,
            "parameters": [_GPU_ID],
            "responses": {"200": _ok("the GPU", "Gpu"),
                          "409": _err("not quarantined, or not safe to give back to the host (attached without a "
                                      "lease, domains unreadable, give-back failed): the quarantine is kept"),
                          **_STD}}},
        "/v1/leases": {
            "post": {"summary": "ask for GPUs", "operationId": "createLease", "security": _SECURED,
                     "x-runtime-checks": {"domain": "an operator must name the VM; a guest may name only its own",
                                          "not_after": "must be in the future",
                                          "start_at": "must be in the future, within leases.booking_horizon_s; "
                                                      "needs duration_s",
                                          "total_memory_gib": "not together with gpus",
                                          "target_work_rate": "not together with gpus or total_memory_gib; needs "
                                                              "task_type",
                                          **{f: "no tag characters (U+E0000-U+E007F, invisible), which lie "
                                                "outside the BMP where schema patterns differ between validators"
                                             for f in LABEL_FIELDS}},
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": "#/components/schemas/LeaseRequest"}}}},
                     "responses": {"201": _ok("granted and attached (ACTIVE), or booked ahead (BOOKED: start_at)",
                                              "Lease"),
                                   "202": _ok("queued (see queue.position and queue.eta)", "Lease"),
                                   "409": _err("refused: no capacity, quota, or queue full"),
                                   "415": _err("wrong content type"),
                                   "429": _err("this VM already has its share of the queue waiting "
                                               "(leases.queue_max_per_vm; Retry-After)"),
                                   "500": _err("failed and rolled back"),
                                   "503": _err("overloaded or hypervisor unavailable"), **_STD}},
            "get": {"summary": "leases, newest first (a guest sees its own)", "operationId": "listLeases",
                    "security": _SECURED,
                    "x-runtime-checks": {"cursor": "a next_cursor this API issued"},
                    "parameters": [
                        {"name": "state", "in": "query", "schema": {"type": "string",
                                                                    "pattern": STATE_FILTER_PATTERN},
                         "description": "comma-separated states (any letter case)"},
                        {"name": "since", "in": "query", "schema": {"type": "number"},
                         "description": "unix seconds: leases created or still running since then"},
                        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                    "maximum": MAX_PAGE},
                         "description": f"leases per page (default 200, at most {MAX_PAGE})"},
                        {"name": "cursor", "in": "query",
                         "schema": {"type": "string", "maxLength": 200, "pattern": "^[A-Za-z0-9_-]*$"},
                         "description": "next_cursor of the previous page: the page after it"}],
                    "responses": {"200": {"description": "one page of leases", "content": {"application/json": {
                        "schema": {"type": "object", "required": ["leases", "next_cursor"], "properties": {
                            "leases": {"type": "array", "items": {"$ref": "#/components/schemas/Lease"}},
                            "next_cursor": {"type": "string", "nullable": True,
                                            "description": "pass as cursor for the next page; null on the last"}}}}}},
                                  **_STD}},
        },
        "/v1/leases/{lease_id}": {
            "get": {"summary": "one lease: state, devices, usage, warnings", "operationId": "getLease",
                    "security": _SECURED, "parameters": [_LEASE_ID],
                    "responses": {"200": _ok("the lease", "Lease"), **_STD}},
            "delete": {"summary": "release", "operationId": "releaseLease", "security": _SECURED,
                       "parameters": [_LEASE_ID],
                       "responses": {"200": _ok("released: GPUs back on the host", "Lease"),
                                     "202": _ok("detach not yet acknowledged by the guest", "Lease"),
                                     "409": _err("being set up; retry"), **_STD}},
        },
        "/v1/leases/{lease_id}/heartbeat": {"post": {
            "summary": "usage samples; the reply carries warnings and reclaim notices", "operationId": "heartbeat",
            "security": _SECURED, "parameters": [_LEASE_ID],
            "x-runtime-checks": {"samples[].ts": "within the skew bounds of the agent's clock, and not before the "
                                                  "lease had its GPUs",
                                 "samples[].gpu": "one of the lease's GPUs",
                                 "samples[].mem_used_bytes": "no more than the GPU has",
                                 "samples": "no more than this agent's burst (store.samples_per_lease_per_s x 60 s)"},
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False,
                "properties": {"samples": {"type": "array", "maxItems": 1000, "items": sample}}}}}},
            "responses": {"200": {"description": "accepted", "content": {"application/json": {"schema": {
                "type": "object", "required": ["accepted", "state", "warnings"],
                "properties": {"accepted": {"type": "integer"}, "state": {"type": "string"},
                               "warnings": {"type": "array", "items": {"type": "object"}},
                               "reclaim": {"type": "object"}, "expires_at": _NULLABLE_NUM}}}}},
                          "409": _err("lease has ended"), "415": _err("wrong content type"),
                          "429": _err("over the lease's sample rate (store.samples_per_lease_per_s) or its VM's "
                                      "share of the sample queue (store.ingest_share); Retry-After says when"),
                          "503": _err("ingestion queue full (Retry-After)"), **_STD}}},
        "/v1/leases/{lease_id}/renew": {"post": {
            "summary": "extend the TTL", "operationId": "renewLease", "security": _SECURED,
            "parameters": [_LEASE_ID],
            "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False,
                "properties": {"duration_s": {"type": "integer", "minimum": 1, "maximum": max_duration_s,
                                              "nullable": True, "description": "absent or null: the lease's own "
                                                                               "duration, else the default"}}}}}},
            "responses": {"200": _ok("renewed", "Lease"), "409": _err("not renewable in this state"),
                          "415": _err("wrong content type"), **_STD}}},
        "/v1/leases/{lease_id}/reclaim": {"post": {
            "summary": "operator: pause or resume idle reclaim on a lease", "operationId": "reclaimControl",
            "security": _SECURED, "parameters": [_LEASE_ID],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "required": ["paused"],
                "properties": {"paused": {"type": "boolean"}}}}}},
            "responses": {"200": _ok("the lease", "Lease"), "409": _err("lease has ended"),
                          "415": _err("wrong content type"), **_STD}}},
        "/v1/leases/{lease_id}/move": {"post": {
            "summary": "operator: make-before-break move of one of the lease's GPUs to another", "operationId":
            "moveLease", "security": _SECURED, "parameters": [_LEASE_ID],
            "description": "The target is bound and attached beside the old GPU (202), the guest is told (a `move` "
                           "warning in its lease and heartbeat replies), and the old GPU is detached and given back "
                           "when the guest confirms (POST .../move/done) or at the deadline. A failure before the "
                           "guest is told leaves it with the GPU it had (409).",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "required": ["to"],
                "properties": {"to": {"type": "string", "maxLength": 128},
                               "from": {"type": "string", "maxLength": 128,
                                        "description": "required when the lease holds several GPUs"},
                               "deadline_s": {"type": "integer", "minimum": 1, "maximum": 3600, "default": 300}}}}}},
            "responses": {"202": _ok("the lease, its new GPU attached beside the old one", "Lease"),
                          "409": _err("the lease is not ACTIVE or already changing, the target is busy, booked, "
                                      "unfit or cannot be passed through, or the move failed (the guest keeps its "
                                      "GPU)"),
                          "415": _err("wrong content type"), **_STD}}},
        "/v1/leases/{lease_id}/move/done": {"post": {
            "summary": "the guest moved its work: detach and give back the old GPU now", "operationId": "moveDone",
            "security": _SECURED, "parameters": [_LEASE_ID],
            "responses": {"200": _ok("the lease (its move over, or still waiting for the guest to let go of the "
                                     "old GPU)", "Lease"),
                          "409": _err("no move waiting to finish"), **_STD}}},
        "/v1/reaper": {"get": {
            "summary": "operator: strike state and next check of every lease", "operationId": "reaperStatus",
            "security": _SECURED,
            "responses": {"200": {"description": "reaper status", "content": {"application/json": {"schema": {
                "type": "object"}}}}, **_STD}}},
        "/v1/events": {"get": {
            "summary": "operator: journal events, the newest page first (each page oldest first)",
            "operationId": "listEvents", "security": _SECURED,
            "x-runtime-checks": {"cursor": "a next_cursor this API issued"},
            "parameters": [{"name": "lease_id", "in": "query", "schema": {"type": "string"}},
                           {"name": "gpu_id", "in": "query", "schema": {"type": "string"}},
                           {"name": "kind", "in": "query", "schema": {"type": "string"},
                            "description": "comma-separated event kinds"},
                           {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                       "maximum": MAX_PAGE},
                            "description": f"events per page (default 500, at most {MAX_PAGE})"},
                           {"name": "cursor", "in": "query", "schema": {"type": "string", "pattern": "^[0-9]{1,19}$"},
                            "description": "next_cursor of the previous page: the events before it"}],
            "responses": {"200": {"description": "events", "content": {"application/json": {"schema": {
                "type": "object", "required": ["events", "next_cursor"],
                "properties": {"events": {"type": "array", "items": {"type": "object"}},
                               "next_cursor": {"type": "string", "nullable": True,
                                               "description": "older events follow; null on the last page"}}}}}},
                          "400": _err("bad limit or cursor"), **_STD}}},
        "/v1/fleet": {"get": {
            "summary": "operator: every host sharing the usage store, as each last published itself (GPUs by state, "
                       "utilization, queue, model version in use, dashboard URL, stale mark), the fleet's idle "
                       "candidates and totals", "operationId": "getFleet", "security": _SECURED,
            "responses": {"200": {"description": "the fleet", "content": {"application/json": {"schema": _FLEET}}},
                          "503": _err("the usage store cannot be read"), **_STD}}},
    }
    from hostagent.web import openapi_ext

    openapi_ext.extend(paths)
    for ops in paths.values():
        for op in ops.values():
            if op.get("security", _SECURED):  # every operation but healthz and readyz
                op["responses"].setdefault("401", _err("missing or bad token"))
                op["responses"].setdefault("429", _err("this VM already has agent.max_inflight_per_token requests "
                                                       "in progress; Retry-After says when to try again"))
    return {
        "openapi": "3.0.3",
        "info": {"title": "hostagent API", "version": __version__,
                 "description": "Lease whole GPUs to KVM/libvirt guests over VFIO passthrough. Every error body is "
                                "{\"error\": {\"code\", \"message\", \"field\"?}}. Every operation but "
                                "healthz and readyz needs a bearer token; a guest's token sees its own VM's leases."},
        "security": _SECURED,
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["code", "message"],
                    "properties": {"code": {"type": "string"}, "message": {"type": "string"},
                                   "field": {"type": "string"},
                                   "available_in_s": {"type": "number", "minimum": 0, "description":
                                                      "a request refused for want of free GPUs: seconds until as "
                                                      "many are expected free (from the leases' ends and the "
                                                      "requests ahead); absent when no end is known"},
                                   "earliest_start": {"type": "number", "description":
                                                      "a booking refused at its start_at: the earliest start "
                                                      "(unix seconds) at which as many GPUs are free for its "
                                                      "duration_s"}}}}},
                "LeaseRequest": lease_request,
                "Lease": lease,
                "Gpu": gpu,
            },
        },
    }
