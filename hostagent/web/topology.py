"""Topology and probe routes: GET /v1/topology, GET /v1/probes, POST /v1/gpus/{gpu_id}/probe (operator).

`install(app, runtime)` builds the topology (with the NVLink hint file), the probe service and the topology
placer, registers the routes and a cleanup context that starts/stops the probe service after the runtime.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from hostagent.domain.errors import NotFound
from hostagent.domain.placement import Scorer
from hostagent.domain.topology import Topology
from hostagent.host.probes import TaskProbeRunner, default_runners, select_runners
from hostagent.services.probes import ProbeService, ProbeSettings
from hostagent.services.task_probes import TaskProbes
from hostagent.services.topology import TopologyPlacer, load_topology, make_topology_place, topology_view
from hostagent.web import openapi_ext
from hostagent.web.app import ident
from hostagent.web.keys import RUNTIME

if TYPE_CHECKING:
    from hostagent.web.ports import AgentServices


@dataclass
class TopologyParts:
    """What install() built, for the lead's wiring and for tests."""

    topology: Topology
    probes: ProbeService
    placer: TopologyPlacer
    task_probes: TaskProbes


TOPOLOGY: web.AppKey[TopologyParts] = web.AppKey("topology")


def build_parts(runtime: AgentServices, *, probe_settings: ProbeSettings | None = None,
                runners: list[Any] | None = None,
                scorer: Callable[[], Scorer | None] | None = None) -> TopologyParts:
    """Topology from the runtime's GPUs and `host.nvlink_hints`, the probe service, and the placer.

    `runners`: probe runners to choose from (default: every runner in hostagent.host.probes, over the runtime's own
    sysfs, opened for `host.kernel` by the composition); `scorer`: a callable returning the active learned Scorer
    or None (the cold-start rule then decides).
    """
    from hostagent.store.repo import gpu_record

    settings = runtime.settings
    manager = runtime.manager
    topology = load_topology(list(manager.gpus.values()), settings.host.nvlink_hints)
    manager.nvlinked = topology.nvlinked  # what `requires: ["nvlink"]` admits
    candidates = runners if runners is not None else default_runners(runtime.host.sysfs)
    if runners is None and settings.host.kernel == "fake":
        # a fake tree's GPUs answer no real library: the simulated compute runner measures them (per-model figures,
        # the known-answer check), composed with the fake kernel as the demo and the test rigs choose it
        from hostagent.host.fakeprobes import SimulatedComputeRunner

        candidates = [SimulatedComputeRunner(runtime.host.sysfs), *candidates]
    chosen, status = select_runners(candidates)
    probes = ProbeService(manager, chosen, settings=probe_settings or ProbeSettings(), runner_status=status,
                          gpu_row=gpu_record, clock=runtime.clock)
    task_probes = TaskProbes(probes, {task: TaskProbeRunner(task, shlex.split(command))
                                      for task, command in settings.probes.task_probes.items()})

    placer = make_topology_place(manager, topology, scorer=scorer or (lambda: None), probe_score=probes.score_of,
                                 probe_measured=manager.measured.get,
                                 default_policy=settings.leases.numa_policy,
                                 objective=settings.placement.objective,
                                 objective_per_task=settings.placement.objective_per_task)
    return TopologyParts(topology, probes, placer, task_probes)


def install(app: web.Application, runtime: AgentServices, **kwargs: Any) -> TopologyParts:
    """Register the routes and build the parts (see build_parts); the composition (runtime.make_app) hands the
    topology placer to the learned placer, which places every lease through it."""
    parts = build_parts(runtime, **kwargs)
    app[TOPOLOGY] = parts
    if runtime.watcher is not None:
        runtime.watcher.added_listeners.append(lambda added: follow_inventory(runtime, parts))

    async def probes_lifecycle(app: web.Application) -> AsyncIterator[None]:
        parts.probes.store = runtime.store  # opened by the runtime's own lifecycle, which runs first
        with contextlib.suppress(Exception):
            await parts.task_probes.load_history()  # first: the compute history keeps the task figures
        with contextlib.suppress(Exception):
            await parts.probes.load_history()
        parts.probes.start()
        parts.task_probes.start(now=parts.probes.settings.enabled)
        yield
        await parts.task_probes.stop()
        await parts.probes.stop()

    app.cleanup_ctx.append(probes_lifecycle)
    app.router.add_get("/v1/topology", get_topology)
    app.router.add_get("/v1/probes", get_probes)
    app.router.add_post("/v1/gpus/{gpu_id}/probe", post_probe)
    return parts


def follow_inventory(runtime: AgentServices, parts: TopologyParts) -> None:
    """GPUs joined the inventory (a hot-add, services.out_of_band): the topology, and the placer that packs by it,
    take them in."""
    topology = load_topology(list(runtime.manager.gpus.values()), runtime.settings.host.nvlink_hints)
    parts.topology = parts.placer.topology = topology
    runtime.manager.nvlinked = topology.nvlinked


def _states(runtime: AgentServices) -> dict[str, str]:
    return {g: runtime.manager.gpu_state(g).value for g in runtime.manager.gpus}


async def get_topology(request: web.Request) -> web.Response:
    """The free-block picture: places, distances, the block tree with free counts, the best set per size now (any
    token)."""
    ident(request)
    rt = request.app[RUNTIME]
    parts = request.app[TOPOLOGY]
    body = topology_view(parts.topology, _states(rt))
    body["probe_scores"] = {g: parts.probes.score_of(g) for g in parts.topology.gpu_ids}
    return web.json_response(body)


async def get_probes(request: web.Request) -> web.Response:
    """Probe runners available here, settings, and every GPU's latest score (any token; operators also get the
    reports)."""
    who = ident(request)
    parts = request.app[TOPOLOGY]
    body = {**parts.probes.status(), "task_probes": parts.task_probes.status()}
    if who.is_operator:
        body["reports"] = {g: r.to_dict() for g, r in parts.probes.reports.items()}
    return web.json_response(body)


async def post_probe(request: web.Request) -> web.Response:
    """Operator: probe a free GPU now (409 while it is leased or off its host driver)."""
    who = ident(request, operator=True)
    rt = request.app[RUNTIME]
    gpu_id = request.match_info["gpu_id"]
    if gpu_id not in rt.manager.gpus:
        raise NotFound(f"no GPU {gpu_id!r}; list them with GET /v1/gpus", field="gpu_id")
    report = await request.app[TOPOLOGY].probes.probe(gpu_id, actor=who.subject)
    return web.json_response(report.to_dict())


# -- OpenAPI -----------------------------------------------------------------------------------------------------

_OBJ = {"application/json": {"schema": {"type": "object"}}}
_ERR = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
_GPU_ID = {"name": "gpu_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 64}}


def _paths(paths: dict[str, Any]) -> None:
    """OpenAPI entries for these routes."""
    paths["/v1/topology"] = {"get": {
        "summary": "PCIe/NUMA/NVLink topology with the free-block picture and the best set per request size",
        "operationId": "getTopology", "security": [{"bearer": []}],
        "responses": {"200": {"description": "topology", "content": {"application/json": {"schema": {
            "type": "object", "required": ["levels", "gpus", "tree", "distances", "free"],
            "properties": {"levels": {"type": "array", "items": {"type": "object"}},
                           "gpus": {"type": "array", "items": {"type": "object"}},
                           "tree": {"type": "object"}, "nvlink": {"type": "array", "items": {"type": "array"}},
                           "distances": {"type": "object"}, "free": {"type": "object"},
                           "probe_scores": {"type": "object"}}}}}}}}}
    paths["/v1/probes"] = {"get": {
        "summary": "probe runners available on this host and every GPU's latest probe score",
        "operationId": "probeStatus", "security": [{"bearer": []}], "responses": {"200": {"description": "probe status", "content": _OBJ}}}}
    paths["/v1/gpus/{gpu_id}/probe"] = {"post": {
        "summary": "operator: probe a free GPU now (compute throughput, memory bandwidth, health signals)",
        "operationId": "probeGpu", "security": [{"bearer": []}], "parameters": [_GPU_ID],
        "responses": {"200": {"description": "the probe report", "content": {"application/json": {"schema": {
            "type": "object", "required": ["gpu_id", "ok", "score", "spread"],
            "properties": {"gpu_id": {"type": "string"}, "ok": {"type": "boolean"},
                           "score": {"type": "number", "nullable": True},
                           "spread": {"type": "number", "nullable": True},
                           "metrics": {"type": "object"}, "health": {"type": "object"},
                           "problems": {"type": "array", "items": {"type": "string"}},
                           "warnings": {"type": "array", "items": {"type": "string"}},
                           "note": {"type": "string", "nullable": True},
                           "quarantined": {"type": "string", "nullable": True}}}}}},
                      "401": {"description": "missing or bad token", "content": _ERR},
                      "403": {"description": "not an operator", "content": _ERR},
                      "404": {"description": "unknown GPU", "content": _ERR},
                      "409": {"description": "leased, being probed, or not on its host driver", "content": _ERR}}}}


if _paths not in openapi_ext.EXTENSIONS:
    openapi_ext.EXTENSIONS.append(_paths)
