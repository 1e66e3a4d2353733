"""The lease queue by comparative advantage (#21), through the API, on the 16-GPU demo host (A100, V100, T4,
RTX 6000): when a T4 frees, a queued request that runs best on a T4 gets it ahead of an earlier one that runs
ten times faster elsewhere; the earlier one is told it was passed over; the fairness bound and the strict order
are set through the configuration as an operator sets them."""

from __future__ import annotations

import asyncio
import dataclasses
import html
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.assignment import Fairness, run_left_s
from hostagent.domain.capabilities import Measured
from hostagent.domain.lease import LeaseDevice, LeaseRequest, LeaseState, new_lease
from hostagent.domain.placement import DeviceView, PlacementRequest
from hostagent.services import lease_queue
from hostagent.web.topology import TOPOLOGY
from tests.support.agent import AgentRig, Clock, make_rig, operator_login, start_rig
from tests.support.waits import until

S = LeaseState
# what a trained model would predict: bert gains from the big cards, ncf runs best on a T4
RATES = {"bert": {"A100": 10.0, "V100": 8.0, "RTX 6000": 5.0, "T4": 1.0}, "ncf": {"T4": 9.0}, "a100-job": {"A100": 9.0}}


class TableModel:
    """Stands in for a trained model (the learned scorer's interface): a relative rate per task type and model, and
    the median run time its records would show (bert: 600 s)."""

    name = "v-table"

    def covers(self, request: PlacementRequest) -> bool:
        return True

    def __init__(self) -> None:
        self.asked: list[tuple[str, tuple[float, ...]]] = []  # (task type, its leases' run times so far) per ask

    def typical_run_s(self, task_type: str, running: Sequence[float] = ()) -> float | None:
        self.asked.append((task_type, tuple(running)))
        return 600.0 if task_type == "bert" else None

    def left_run_s(self, task_type: str, done: float) -> float | None:
        # its records of a100-job: three leases of 120 s (none of the other task types)
        return run_left_s([120.0] * 3, done) if task_type == "a100-job" else None

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        rates = RATES.get(request.task_type or "", {})
        return [next((r for k, r in rates.items() if k in d.model), 1.0) for d in devices]


async def rig_with(tmp_path: Path, aiohttp_client: Any, clock: Clock | None = None, **leases: Any) -> AgentRig:
    rig = make_rig(tmp_path, scenario="demo16", clock=clock, leases=leases)
    rig.runtime.placer.use(TableModel(), "v-table")
    return await start_rig(rig, aiohttp_client)


async def post(rig: AgentRig, who: str, status: int, **body: Any) -> dict[str, Any]:
    r = await rig.client.post("/v1/leases", json=body, headers=rig.auth(who))
    data = await r.json()
    assert r.status == status, data
    return data


async def free_a_t4(rig: AgentRig, fillers: list[dict[str, Any]]) -> str:
    """Release one filler lease that holds a T4; return the GPU once the queue has decided who gets it."""
    m = rig.runtime.manager
    lease = next(x for x in fillers if "T4" in m.gpus[x["devices"][0]["gpu_id"]].model)
    fillers.remove(lease)
    gid = lease["devices"][0]["gpu_id"]
    r = await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("vm-c"))
    assert r.status == 200, await r.text()
    await until(lambda: lease["id"] not in m.leases, 10, "the release")  # the queue's task may take the T4 at once
    await m.drain_queue()
    await until(lambda: not any(x.state in (S.BINDING, S.ATTACHING) for x in m.leases.values()), 10, "grants")
    return gid


async def fill(rig: AgentRig, short_a100: bool = False) -> list[dict[str, Any]]:
    """Every GPU held by vm-c (one lease each); with `short_a100`, first a one-minute lease that lands on an A100."""
    fillers = [await post(rig, "vm-c", 201, gpus=1, task_type="a100-job", duration_s=60)] if short_a100 else []
    if short_a100:
        assert "A100" in rig.runtime.manager.gpus[fillers[0]["devices"][0]["gpu_id"]].model
    fillers += [await post(rig, "vm-c", 201, gpus=1, task_type="filler") for _ in range(16 - len(fillers))]
    return fillers


async def full_host_and_two_queued(rig: AgentRig) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    fillers = await fill(rig)
    bert = await post(rig, "vm-a", 202, gpus=1, task_type="bert", accept_deferred=True)
    ncf = await post(rig, "vm-b", 202, gpus=1, task_type="ncf", accept_deferred=True)
    assert (bert["queue"]["position"], ncf["queue"]["position"]) == (1, 2)
    return fillers, bert, ncf


async def view(rig: AgentRig, who: str, lease_id: str) -> dict[str, Any]:
    return await (await rig.client.get(f"/v1/leases/{lease_id}", headers=rig.auth(who))).json()


async def test_a_freed_t4_goes_to_the_request_that_gains_most_from_it(tmp_path: Path, aiohttp_client: Any) -> None:
    rig = await rig_with(tmp_path, aiohttp_client)
    fillers, bert, ncf = await full_host_and_two_queued(rig)
    m = rig.runtime.manager
    m.queue_waits[bert["id"]] = m.clock() + 9999  # as if it had waited for a better GPU before
    t4 = await free_a_t4(rig, fillers)
    got = await view(rig, "vm-b", ncf["id"])
    assert got["state"] == "ACTIVE" and [d["gpu_id"] for d in got["devices"]] == [t4], got
    assert bert["id"] not in m.queue_waits  # passed over now, not waiting: its ETA is the queue's again
    said = " ".join(got["reasons"])
    assert "comparative advantage: 100% of its best rate on the GPUs free now, against 10% for the request ahead" \
        in said, said
    waiting = await view(rig, "vm-a", bert["id"])
    assert waiting["state"] == "QUEUED" and waiting["queue"]["position"] == 1
    note = waiting["queue"]["note"]
    assert note.startswith("passed over 1 time(s) by requests that gain more"), waiting["queue"]
    # the operator reads the same words on the placement page (the queue, the decision), the overview and the lease
    await operator_login(rig)
    placement = html.unescape(await (await rig.client.get("/ui/model")).text())
    queue_card = placement[placement.index("<h2>The queue</h2>"):placement.index("<h2>Recent placement decisions</h2>")]
    assert bert["id"] in queue_card and note in queue_card and "comparative advantage" in queue_card
    # the rule in force, in words: waiting in line for a better GPU, and who of several served in turn goes first
    assert "waits (when every request that could start would rather wait, the free GPUs stay free)" in placement
    assert "is served in turn (of several, the one that gains most from the GPUs free first)" in placement
    assert "a task type the model has too few records of is compared by its predictions, and counts as equal where " \
           "the model is unsure of them" in placement
    assert "its wait is weighed against a draw within the model's doubt, afresh at each decision (priority 5 and " \
           "under; placement.explore_epsilon 0.05)" in placement  # exploration on, as by default
    assert "comparative advantage: 100% of its best rate" in placement[placement.index("Recent placement decisions"):]
    for page in ("/", f"/ui/leases/{bert['id']}"):
        assert note in html.unescape(await (await rig.client.get(page)).text()), page


class Unsure(TableModel):
    """The table model, as unsure of bert's rates as `sd` says (log-space standard deviation per prediction)."""

    def __init__(self, sd: float) -> None:
        super().__init__()
        self.sd = sd

    def uncertainty(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        return [self.sd if request.task_type == "bert" else 0.01 for _ in devices]


@pytest.mark.parametrize("sd", [0.5, 2.0])
async def test_a_request_is_passed_over_only_where_the_model_tells_the_two_apart(tmp_path: Path, aiohttp_client: Any,
                                                                               sd: float) -> None:
    # bert would run at 10 % of its best on the freed T4, ncf at 100 %: a log gap of ln 10 = 2.3. Where the model
    # knows bert's rates to sd 0.5 (combined 0.71) ncf goes first; to sd 2.0 (combined 2.83) the two count as equal
    # and bert, first in serve order, keeps its turn (the placer passes the model's deviations to the queue). No
    # draws of the model's doubt (exploration off): at sd 2.0 one could make bert wait for a better GPU instead
    rig = make_rig(tmp_path, scenario="demo16", placement={"explore_epsilon": 0.0})
    rig.runtime.placer.use(Unsure(sd), "v-unsure")
    rig = await start_rig(rig, aiohttp_client)
    fillers, bert, ncf = await full_host_and_two_queued(rig)
    t4 = await free_a_t4(rig, fillers)
    first, second = (ncf, bert) if sd < 2.3 / 2 ** 0.5 else (bert, ncf)
    got = await view(rig, "vm-b" if first is ncf else "vm-a", first["id"])
    assert got["state"] == "ACTIVE" and got["devices"][0]["gpu_id"] == t4, got
    waiting = await view(rig, "vm-a" if first is ncf else "vm-b", second["id"])
    assert waiting["state"] == "QUEUED"
    if first is bert:  # nobody passed over: nothing to explain
        assert waiting["queue"]["note"] is None and not any("comparative" in r for r in got["reasons"]), got
        assert f"first in serve order (10% of its best rate on the GPUs free now; {ncf['id']}'s 100% is within the " \
               "model's uncertainty of it)" in " ".join(got["reasons"]), got["reasons"]
    else:
        assert waiting["queue"]["note"].startswith("passed over 1 time(s)")


@pytest.mark.parametrize("leases", [{"queue_order": "strict"}, {"fairness_max_passes": 1},
                                    {"fairness_max_delay_s": 60.0}])
async def test_the_operator_bounds_it_or_turns_it_off(tmp_path: Path, aiohttp_client: Any,
                                                     leases: dict[str, Any]) -> None:
    clock = Clock()
    rig = await rig_with(tmp_path, aiohttp_client, clock, **leases)
    fillers, bert, ncf = await full_host_and_two_queued(rig)
    if leases.get("queue_order") == "strict":  # serve order only: the T4 goes to the head
        t4 = await free_a_t4(rig, fillers)
        got = await view(rig, "vm-a", bert["id"])
        assert got["state"] == "ACTIVE" and got["devices"][0]["gpu_id"] == t4
        assert (await view(rig, "vm-b", ncf["id"]))["queue"]["note"] is None
        return
    assert rig.runtime.manager.policy.fairness.max_passes == leases.get("fairness_max_passes", Fairness().max_passes)
    await free_a_t4(rig, fillers)  # passed over once: with a bound of 1 time, bert is due
    assert (await view(rig, "vm-b", ncf["id"]))["state"] == "ACTIVE"
    late = await post(rig, "vm-b", 202, gpus=1, task_type="ncf", accept_deferred=True)
    if "fairness_max_delay_s" in leases:  # under the default bound of passes it is passed over again ...
        clock.advance(30.0)  # (the bound counts from the first time it was passed over, not the latest)
        t4 = await free_a_t4(rig, fillers)
        assert (await view(rig, "vm-b", late["id"]))["state"] == "ACTIVE"
        assert (await view(rig, "vm-a", bert["id"]))["queue"]["note"].startswith("passed over 2 time(s)")
        late = await post(rig, "vm-b", 202, gpus=1, task_type="ncf", accept_deferred=True)
        clock.advance(31.0)  # ... until it was first passed over more than fairness_max_delay_s ago
    t4 = await free_a_t4(rig, fillers)
    got = await view(rig, "vm-a", bert["id"])
    assert got["state"] == "ACTIVE" and got["devices"][0]["gpu_id"] == t4, got
    said = "served in turn: passed over 2 time(s) for 61 s" if "fairness_max_delay_s" in leases else \
        "served in turn: passed over 1 time(s)"
    assert any(said in x for x in got["reasons"]), got["reasons"]
    assert (await view(rig, "vm-b", late["id"]))["state"] == "QUEUED"


class Counting(TableModel):
    """The table model, counting the devices it is asked to score."""

    def __init__(self) -> None:
        super().__init__()
        self.scored = 0

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        self.scored += len(devices)
        return super().score(request, devices)


def counted(tmp_path: Path, version: str) -> tuple[Any, Any, Counting]:
    """The demo host's placer and lease manager, the placer using a Counting model."""
    rig = make_rig(tmp_path, scenario="demo16")
    model = Counting()
    rig.runtime.placer.use(model, version)
    return rig.runtime.placer, rig.runtime.manager, model


def test_the_placer_predicts_each_request_and_gpu_once_per_model_and_probe(tmp_path: Path) -> None:
    placer, m, model = counted(tmp_path, "v-count")
    gpus = list(m.gpus.values())
    bert = LeaseRequest(task_type="bert")
    first = placer.relative_rates(bert, gpus)
    # asked again with nothing changed: the very same answer (the queue keeps its ranking of it while it is)
    assert model.scored == 16 and placer.relative_rates(bert, gpus) is first and model.scored == 16
    assert placer.relative_rates(bert, gpus[:4]) == first[:4] and model.scored == 16  # a subset: no new prediction
    assert placer.relative_rates(LeaseRequest(task_type="ncf"), gpus) is not None and model.scored == 32
    first = placer.relative_rates(bert, gpus)  # (after the subset, made again from what it kept)
    assert model.scored == 32 and placer.relative_rates(bert, gpus) is first
    m.measured[gpus[0].id] = Measured()  # a new probe's figures for one GPU: only that one is predicted again
    probed = placer.relative_rates(bert, gpus)
    assert probed == first and probed is not first and model.scored == 33
    placer.use(model, "v-count-2")  # a model switch forgets every prediction
    assert placer.relative_rates(bert, gpus) is not probed
    assert model.scored == 49


def test_the_queue_ranks_a_request_shape_again_only_when_the_placer_answers_anew(tmp_path: Path) -> None:
    # the queue keeps each shape's ranking across decisions while the placer hands back the very same tuple (its
    # promise when neither the model, the GPUs nor their probes changed); a new tuple, even an equal one, is ranked
    # again, so a model switch or a probe is followed at the next decision
    rig = make_rig(tmp_path, scenario="demo16")
    m = rig.runtime.manager
    gpus = list(m.gpus.values())
    answer = {"now": tuple(float(i) for i in range(len(gpus)))}
    asked: list[int] = []
    m.relative_rates = lambda request, g: asked.append(len(g)) or answer["now"]
    m.rates_token = lambda: None  # no token: asked at every decision
    bert = LeaseRequest(task_type="bert", duration_s=600, priority=2)
    first = lease_queue._Usable(m).ranked(bert)
    assert first is not None and first.order[0] == gpus[-1].id and first.order[-1] == gpus[0].id
    assert first.plain.duration_s is None and first.plain.priority == 0
    longer = dataclasses.replace(bert, duration_s=7200)  # the same shape: its ranking is kept
    assert lease_queue._Usable(m).ranked(longer) is first and asked == [len(gpus)] * 2
    answer["now"] = tuple(reversed(answer["now"]))  # the placer answers anew: ranked again
    second = lease_queue._Usable(m).ranked(bert)
    assert second is not first and second.order[0] == gpus[0].id
    answer["now"] = tuple(list(answer["now"]))  # equal figures, a new tuple: ranked again all the same
    assert lease_queue._Usable(m).ranked(bert) is not second
    usable = lease_queue._Usable(m)  # within one decision the placer is asked once per shape
    usable.ranked(bert), usable.ranked(longer), usable.figures(bert, 1), usable.figures(bert, 2)
    assert len(asked) == 5
    answer["now"] = None  # type: ignore[assignment]  # no model any more: strict order
    assert lease_queue._Usable(m).ranked(bert) is None


def test_the_queue_asks_the_placer_again_only_when_its_token_changes(tmp_path: Path) -> None:
    # the placer's token (the model, every GPU's probe figures) is read once per decision; while it is unchanged
    # the queue uses each shape's kept predictions without asking; a model switch or a new probe changes it
    placer, m, model = counted(tmp_path, "v-a")
    gpus = list(m.gpus.values())
    bert, ncf = LeaseRequest(task_type="bert"), LeaseRequest(task_type="ncf")
    first = lease_queue._Usable(m)
    assert first.ranked(bert) is not None and first.sds(bert) is not None and first.ranked(ncf) is not None
    assert model.scored == 32
    asked: list[str] = []
    real = placer.relative_rates
    m.relative_rates = lambda request, g: asked.append(request.task_type) or real(request, g)
    kept = lease_queue._Usable(m).ranked(bert)  # a new function answers: asked once, its answer the same tuple
    assert asked == ["bert"] and kept is m.queue_shapes[lease_queue._shape(bert)]
    for _ in range(3):
        usable = lease_queue._Usable(m)
        assert usable.ranked(bert) is kept and usable.figures(bert, 1) is not None
    assert asked == ["bert"] and model.scored == 32  # three decisions, nothing asked
    m.measured[gpus[3].id] = Measured()  # a new probe's figures: the token changes, asked again (one GPU scored)
    assert lease_queue._Usable(m).ranked(bert) is not kept and asked == ["bert", "bert"] and model.scored == 33
    placer.use(model, "v-b")  # a model switch: asked again, every GPU scored
    lease_queue._Usable(m).ranked(bert)
    assert asked == ["bert"] * 3 and model.scored == 49
    assert placer.rates_token() == placer.rates_token() and lease_queue._Usable(m).ranked(bert) is not None
    assert asked == ["bert"] * 3


def test_each_request_shape_has_its_own_uncertainty_asked_once_per_token(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, scenario="demo16")
    placer, m = rig.runtime.placer, rig.runtime.manager
    placer.use(Unsure(0.5), "v-unsure")
    asked: list[str] = []
    real = m.rate_uncertainty
    m.rate_uncertainty = lambda request, gpus: asked.append(request.task_type) or real(request, gpus)
    bert, ncf = LeaseRequest(task_type="bert"), LeaseRequest(task_type="ncf")
    usable = lease_queue._Usable(m)
    assert set(usable.sds(bert).values()) == {0.5} and set(usable.sds(ncf).values()) == {0.01}
    assert len(usable.sds(bert)) == len(m.gpus) and asked == ["bert", "ncf"]
    again = lease_queue._Usable(m)  # the next decision, nothing changed: as they were, not asked
    assert again.sds(bert) == usable.sds(bert) and again.sds(ncf) == usable.sds(ncf) and asked == ["bert", "ncf"]
    # the token changes (a probe of a GPU too small for the request) while the placer's answers stay the very same:
    # asked again, the same figures
    big = LeaseRequest(task_type="bert", min_memory_gib=30)
    first = lease_queue._Usable(m).sds(big)
    assert set(first.values()) == {0.5} and len(first) == 8 and asked[-1] == "bert"
    m.measured[next(g.id for g in m.gpus.values() if "T4" in g.model)] = Measured()
    n = len(asked)
    assert lease_queue._Usable(m).sds(big) == first and len(asked) == n + 1
    m.rate_uncertainty = lambda request, gpus: [0.3] * len(gpus)  # a new answer under a new token: the new figures
    assert set(lease_queue._Usable(m).sds(bert).values()) == {0.3}
    m.rate_uncertainty = lambda request, gpus: asked.append(request.task_type) or real(request, gpus)
    placer.use(Unsure(0.2), "v-unsure-2")  # a model switch: asked again, the new model's figures
    n = len(asked)
    assert set(lease_queue._Usable(m).sds(bert).values()) == {0.2} and len(asked) == n + 1
    m.relative_rates = lambda request, gpus: None  # no model: no deviations
    assert lease_queue._Usable(m).sds(bert) == {}


def _hold(m: Any, gpu: Any, ends: float) -> None:
    """An ACTIVE lease of vm-h on the GPU, expected to end at `ends` (what busy_until reads)."""
    lease = new_lease(f"l-hold-{gpu.id}", "uuid-h", "vm-h", LeaseRequest(task_type="filler"), ends - 3600)
    device = LeaseDevice(gpu.id, tuple(str(f.address) for f in gpu.functions), ("nvidia",), 0)
    lease = lease.transition(S.BINDING, devices=(device,), granted_gpus=1, expires_at=ends)
    m.leases[lease.id] = lease.transition(S.ATTACHING).transition(S.ACTIVE, granted_at=ends - 3600)
    m.claims[gpu.id] = lease.id


def test_the_wait_for_a_better_gpu_and_a_backfills_rate_are_worked_out_per_request(tmp_path: Path) -> None:
    # bert's best GPU is an A100, ncf's a T4: each request's wait is for its own best card, in the same decision
    rig = make_rig(tmp_path, scenario="demo16")
    m = rig.runtime.manager
    rig.runtime.placer.use(TableModel(), "v-table")
    now = m.clock()
    by_model = {k: [g for g in m.gpus.values() if k in g.model] for k in ("A100", "V100", "RTX 6000", "T4")}
    _hold(m, by_model["A100"][0], now + 300)
    _hold(m, by_model["T4"][0], now + 900)
    _hold(m, by_model["V100"][0], now + 60)  # sooner, but not bert's best: no wait for it
    m.claims[by_model["A100"][1].id] = "probe-1"  # claimed by no lease (a probe): dated the default duration on
    usable = lease_queue._Usable(m)
    bert, ncf = LeaseRequest(task_type="bert"), LeaseRequest(task_type="ncf")
    default = m.policy.default_duration_s
    ids = {k: frozenset(g.id for g in v) for k, v in by_model.items()}
    # each GPU of its best rate, soonest first (0 for a free one; the probe's A100 dated the default duration on),
    # and which GPUs of the host are at that rate: the line it stands in
    for request, frees, gpus in ((bert, (0, 0, 300, default), ids["A100"]), (ncf, (0, 0, 0, 900), ids["T4"])):
        got = usable.ranked(request)
        assert got is not None
        line = usable.better_in(request, got.by_id, got.by_id[got.order[0]], now)
        assert line is not None and line.frees_in == pytest.approx(frees) and line.gpus == gpus
    del m.claims[by_model["A100"][1].id], m.claims[by_model["T4"][0].id]  # every T4 free: nothing to wait for
    later = lease_queue._Usable(m)
    got = later.ranked(ncf)
    assert got is not None and later.better_in(ncf, got.by_id, 9.0, now) is None
    line = later.better_in(bert, later.ranked(bert).by_id, 10.0, now)  # type: ignore[union-attr]
    assert line is not None and line.frees_in == pytest.approx((0, 0, 0, 300))
    # a backfill may take only its room: its rate is that of the count-th best GPU there
    room = [by_model["T4"][1], by_model["V100"][1], by_model["A100"][2], by_model["RTX 6000"][0]]
    assert [usable.kth_of(bert, room, n) for n in (1, 2, 3, 4, 5)] == [
        by_model["A100"][2].id, by_model["V100"][1].id, by_model["RTX 6000"][0].id, by_model["T4"][1].id, None]
    assert usable.kth_of(ncf, room, 1) == by_model["T4"][1].id
    # for a set of k, the best it could ever have runs at the k-th best GPU's rate (4 A100s, 4 V100s, 4 RTX 6000s)
    ranks = [usable.figures(bert, k) for k in (1, 4, 5, 9)]
    assert [m.gpus[f[0]].model.split()[1] for f in ranks if f] == ["[A100", "[A100", "[Tesla", "[Quadro"]
    m.relative_rates = lambda request, gpus: None  # no model: no figure
    assert lease_queue._Usable(m).kth_of(bert, room, 1) is None and lease_queue._Usable(m).figures(bert, 1) is None


@pytest.mark.parametrize("stated", [600, 1200, None])
async def test_a_request_waits_for_a_better_gpu_about_to_free(tmp_path: Path, aiohttp_client: Any,
                                                             stated: int | None) -> None:
    # bert runs 600 s on a typical GPU (as it says, or as the model's records show when it says nothing): 600 s on
    # the freed T4 (rate 1), or 60 s for an A100 to free plus 60 s there; what it states wins over the records
    rig = await rig_with(tmp_path, aiohttp_client, Clock())
    fillers = await fill(rig, short_a100=True)
    bert = await post(rig, "vm-a", 202, gpus=1, task_type="bert", accept_deferred=True,
                      **({"duration_s": stated} if stated else {}))
    ncf = await post(rig, "vm-b", 202, gpus=1, task_type="ncf", accept_deferred=True)
    t4 = await free_a_t4(rig, fillers)
    assert (await view(rig, "vm-b", ncf["id"]))["devices"][0]["gpu_id"] == t4
    note = (await view(rig, "vm-a", bert["id"]))["queue"]["note"]
    run = stated or 600
    assert note.startswith(f"waiting for a better GPU: predicted to end in {60 + run // 10} s there (free in 60 s) "
                           f"against {run} s on the GPUs free now (10% of its best rate)"), note


async def test_the_queue_asks_a_run_time_with_how_long_the_leases_of_its_kind_have_run(tmp_path: Path,
                                                                                      aiohttp_client: Any) -> None:
    # a task type's expected run time counts its leases still running (short ones end first: the ended alone would
    # expect every lease to be short): the queue hands the model how long each ACTIVE lease of the type has run
    clock = Clock()
    rig = await rig_with(tmp_path, aiohttp_client, clock)
    model = rig.runtime.placer.scorer
    fillers = await fill(rig, short_a100=True)  # 15 "filler" leases and one "a100-job", granted now
    queued = await post(rig, "vm-a", 202, gpus=1, task_type="filler", accept_deferred=True)
    clock.advance(300.0)
    model.asked.clear()
    await free_a_t4(rig, fillers)  # one filler released: the queued one is weighed (and granted the T4)
    assert rig.runtime.manager.leases[queued["id"]].state is S.ACTIVE
    assert ("filler", (300.0,) * 14) in model.asked, model.asked


async def test_a_lone_request_waits_for_a_better_gpu_and_takes_it_when_it_frees(tmp_path: Path,
                                                                             aiohttp_client: Any) -> None:
    # bert alone in the queue: the T4 freed would run it 600 s (a tenth of its A100 rate); an A100 frees in 60 s and
    # runs it 60 s. It stays queued, told why, and the T4 stays free (nobody else wants it); when the A100 frees,
    # bert takes it
    rig = await rig_with(tmp_path, aiohttp_client, Clock())
    m = rig.runtime.manager
    fillers = await fill(rig, short_a100=True)
    bert = await post(rig, "vm-a", 202, gpus=1, task_type="bert", accept_deferred=True)
    t4 = await free_a_t4(rig, fillers)
    got = await view(rig, "vm-a", bert["id"])
    assert got["state"] == "QUEUED" and t4 not in m.claims, got
    assert got["queue"]["note"].startswith("waiting for a better GPU: predicted to end in 120 s there (free in 60 s) "
                                           "against 600 s on the GPUs free now (10% of its best rate)"), got["queue"]
    assert got["queue"]["eta"] == m.clock() + 60  # its ETA is when the A100 frees, not now (the T4 is free now)
    a100 = fillers[0]["devices"][0]["gpu_id"]
    r = await rig.client.delete(f"/v1/leases/{fillers[0]['id']}", headers=rig.auth("vm-c"))
    assert r.status == 200, await r.text()
    await until(lambda: m.leases[bert["id"]].state is S.ACTIVE, 10, "bert granted the A100")
    assert m.leases[bert["id"]].gpu_ids == (a100,) and t4 not in m.claims


class UnsureTable(TableModel):
    """The table model, unsure of every rate to a log-space deviation of 0.5 (a ratio of two: 0.71)."""

    def uncertainty(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        return [0.5 for _ in devices]


class Draws(random.Random):
    """The placer's generator with every normal draw fixed, and every uniform one 0.99 (so nothing explores)."""

    def __init__(self, z: float) -> None:
        super().__init__(0)
        self.z = z
        self.gaussed = 0

    def gauss(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        self.gaussed += 1
        return mu + sigma * self.z

    def random(self) -> float:
        return 0.99


@pytest.mark.parametrize("epsilon", [0.05, 0.0])
async def test_a_draw_within_the_models_doubt_may_start_a_request_that_would_wait(tmp_path: Path, aiohttp_client: Any,
                                                                                epsilon: float) -> None:
    # bert alone: 600 s on the freed T4 by the prediction against 60 s for an A100 to free plus 60 s there, so it
    # waits. The model is unsure of the ratio (0.71): the placer draws where within it the T4's rate lies, here 2.5
    # deviations up (1.77 in log space): 600 * exp(-1.77) = 102 s on the T4, sooner than 120 s, and bert starts there
    # and says why. With exploration off (`placement.explore_epsilon` 0) nothing is drawn: it waits, as predicted
    rig = make_rig(tmp_path, scenario="demo16", clock=Clock(), placement={"explore_epsilon": epsilon})
    rig.runtime.placer.use(UnsureTable(), "v-unsure")
    rig.runtime.placer.rng = draws = Draws(2.5)
    rig = await start_rig(rig, aiohttp_client)
    m = rig.runtime.manager
    fillers = await fill(rig, short_a100=True)
    bert = await post(rig, "vm-a", 202, gpus=1, task_type="bert", accept_deferred=True)
    t4 = await free_a_t4(rig, fillers)
    got = await view(rig, "vm-a", bert["id"])
    await operator_login(rig)
    placement = html.unescape(await (await rig.client.get("/ui/model")).text())
    assert ("Waits are weighed on the predictions alone (placement.explore_epsilon = 0: no draws of the model's "
            "doubt)" in placement) is (epsilon == 0), placement  # the rule in force, in words
    if epsilon == 0:
        assert got["state"] == "QUEUED" and t4 not in m.claims and draws.gaussed == 0, got
        assert got["queue"]["note"].startswith("waiting for a better GPU: predicted to end in 120 s there (free in 60 "
                                               "s) against 600 s on the GPUs free now (10% of its best rate)"), got
        return
    assert got["state"] == "ACTIVE" and [d["gpu_id"] for d in got["devices"]] == [t4] and draws.gaussed >= 1, got
    assert ("started rather than wait for a better GPU by a draw within the model's doubt of its rate on the GPUs "
            "free now (deviation 0.71, drawn +2.50): 102 s here against 120 s there (free in 60 s); by the prediction "
            "alone 600 s here") in " ".join(got["reasons"]), got["reasons"]


@pytest.mark.parametrize("stated", [None, 7200])
async def test_a_gpu_held_by_a_lease_that_stated_no_length_frees_when_the_records_say(
        tmp_path: Path, aiohttp_client: Any, stated: int | None) -> None:
    # the A100's lease stated no length: its expiry is only the 8 h default, but the records show a100-job leases of
    # 120 s and it has run 60 s, so it is expected to free in 60 s: bert waits for it, as the simulator's jobs do
    # (dated by its expiry, it would take the T4 freed now). One that stated 2 h is taken at its word.
    clock = Clock()
    rig = await rig_with(tmp_path, aiohttp_client, clock)
    m = rig.runtime.manager
    first = await post(rig, "vm-c", 201, gpus=1, task_type="a100-job", **({"duration_s": stated} if stated else {}))
    a100 = first["devices"][0]["gpu_id"]
    assert "A100" in m.gpus[a100].model
    fillers = [first] + [await post(rig, "vm-c", 201, gpus=1, task_type="filler") for _ in range(15)]
    clock.advance(60.0)
    bert = await post(rig, "vm-a", 202, gpus=1, task_type="bert", accept_deferred=True)
    t4 = await free_a_t4(rig, fillers)
    got = await view(rig, "vm-a", bert["id"])
    if stated:
        assert got["state"] == "ACTIVE" and [d["gpu_id"] for d in got["devices"]] == [t4], got
        return
    assert got["state"] == "QUEUED" and t4 not in m.claims, got
    assert got["queue"]["note"].startswith("waiting for a better GPU: predicted to end in 120 s there (free in 60 s) "
                                           "against 600 s on the GPUs free now (10% of its best rate)"), got["queue"]
    assert got["queue"]["eta"] == m.clock() + 60


async def bert_waiting_beside_a_free_t4(tmp_path: Path, aiohttp_client: Any
                                        ) -> tuple[AgentRig, list[dict[str, Any]], dict[str, Any], str]:
    """A lone bert queued, waiting for the A100 that frees in 60 s (the first filler's) beside a freed T4, once the
    queue's task has nothing left to wake it: the freed GPU's health probe (it claims the GPU, then wakes the queue)
    has run and the queue has drained since. (The rig, the fillers, bert, the T4.)"""
    rig = await rig_with(tmp_path, aiohttp_client, Clock())
    m = rig.runtime.manager
    fillers = await fill(rig, short_a100=True)
    bert = await post(rig, "vm-a", 202, gpus=1, task_type="bert", accept_deferred=True)
    t4 = await free_a_t4(rig, fillers)
    probes = rig.client.app[TOPOLOGY].probes
    await until(lambda: not probes._pending, 10, "the probe after the release")
    await until(lambda: not m._wake_queue.is_set(), 10, "the queue's task idle")
    await asyncio.sleep(0.2)
    assert not m._wake_queue.is_set()
    assert m.leases[bert["id"]].state is S.QUEUED and t4 not in m.claims
    return rig, fillers, bert, t4


async def test_a_waiting_request_weighs_its_wait_again_when_the_gpu_it_waits_for_is_renewed(
        tmp_path: Path, aiohttp_client: Any) -> None:
    # bert waits for the A100 that frees in 60 s, the T4 left free; the A100's holder renews for an hour: its wait is
    # now 3660 s against 600 s on the T4, so bert takes the T4 at once, with no release or new request to wake the
    # queue (before, it waited for the next queue event: here, the hour)
    rig, fillers, bert, t4 = await bert_waiting_beside_a_free_t4(tmp_path, aiohttp_client)
    m = rig.runtime.manager
    r = await rig.client.post(f"/v1/leases/{fillers[0]['id']}/renew", json={"duration_s": 3600},
                              headers=rig.auth("vm-c"))
    assert r.status == 200, await r.text()
    await until(lambda: m.leases[bert["id"]].state is S.ACTIVE, 10, "bert granted the T4")
    assert m.leases[bert["id"]].gpu_ids == (t4,)


async def test_a_new_model_makes_the_queue_decide_again(tmp_path: Path, aiohttp_client: Any) -> None:
    # bert waits for the A100 (its best under the table model); a model under which every GPU runs bert alike
    # replaces it: bert no longer gains by waiting and takes the free T4 at once (the switch wakes the queue)
    rig, _, bert, t4 = await bert_waiting_beside_a_free_t4(tmp_path, aiohttp_client)
    m = rig.runtime.manager

    class Flat(TableModel):
        name = "v-flat"

        def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
            return [1.0 for _ in devices]

    rig.runtime.placer.use(Flat(), "v-flat")
    rig.runtime.models.after_switch()  # what the follower calls after it switched the placer
    await until(lambda: m.leases[bert["id"]].state is S.ACTIVE, 10, "bert granted the T4")
    assert m.leases[bert["id"]].gpu_ids == (t4,)


async def test_two_requests_waiting_for_the_same_gpu_stand_in_line_for_it(tmp_path: Path, aiohttp_client: Any) -> None:
    # two berts, the T4 freed: the first waits for the A100 that frees in 60 s (ends in 120 s against 600 s); the
    # second is second in line for it, free for it when the first's 60 s there end (ends in 180 s against 600 s), and
    # the note says so; the T4 stays free
    rig = await rig_with(tmp_path, aiohttp_client, Clock())
    m = rig.runtime.manager
    fillers = await fill(rig, short_a100=True)
    first = await post(rig, "vm-a", 202, gpus=1, task_type="bert", accept_deferred=True)
    second = await post(rig, "vm-b", 202, gpus=1, task_type="bert", accept_deferred=True)
    t4 = await free_a_t4(rig, fillers)
    notes = [(await view(rig, who, x["id"]))["queue"]["note"] for who, x in (("vm-a", first), ("vm-b", second))]
    assert notes[0].startswith("waiting for a better GPU: predicted to end in 120 s there (free in 60 s) against "
                               "600 s"), notes
    assert notes[1].startswith("waiting for a better GPU: predicted to end in 180 s there (free in 120 s, 2nd in line "
                               "for it) against 600 s"), notes
    etas = [(await view(rig, who, x["id"]))["queue"]["eta"] for who, x in (("vm-a", first), ("vm-b", second))]
    assert etas == [m.clock() + 60, m.clock() + 120], etas  # each starts when its place's GPU frees
    assert t4 not in m.claims


async def test_a_set_waits_for_as_many_gpus_of_its_best_rate(tmp_path: Path, aiohttp_client: Any) -> None:
    # a 2-GPU bert, two T4s free (rate 1: 600 s): its best set is two A100s, one free in 60 s and the next in 300 s,
    # so it could start there in 300 s and end in 360 s: it waits, and its note says when the second frees
    rig = await rig_with(tmp_path, aiohttp_client, Clock())
    m = rig.runtime.manager
    fillers = [await post(rig, "vm-c", 201, gpus=1, task_type="a100-job", duration_s=d) for d in (60, 300)]
    assert all("A100" in m.gpus[x["devices"][0]["gpu_id"]].model for x in fillers)
    fillers += [await post(rig, "vm-c", 201, gpus=1, task_type="filler") for _ in range(14)]
    bert = await post(rig, "vm-a", 202, gpus=2, task_type="bert", accept_deferred=True)
    t4s = [await free_a_t4(rig, fillers) for _ in range(2)]
    got = await view(rig, "vm-a", bert["id"])
    assert got["state"] == "QUEUED" and not any(t in m.claims for t in t4s), got
    assert got["queue"]["note"].startswith("waiting for a better GPU: predicted to end in 360 s there (free in 300 s) "
                                           "against 600 s on the GPUs free now (10% of its best rate)"), got["queue"]


async def test_a_lower_priority_takes_a_gpu_every_request_above_it_would_rather_leave(tmp_path: Path,
                                                                                   aiohttp_client: Any) -> None:
    # bert (priority 1) would rather wait 60 s for an A100 than run ten times as long on the T4 freed; ncf (priority
    # 0), which runs best on a T4, takes it meanwhile, told why; bert is not passed over (it declined the T4)
    rig = await rig_with(tmp_path, aiohttp_client, Clock(), guest_max_priority=1)
    m = rig.runtime.manager
    fillers = await fill(rig, short_a100=True)
    bert = await post(rig, "vm-a", 202, gpus=1, task_type="bert", priority=1, accept_deferred=True)
    ncf = await post(rig, "vm-b", 202, gpus=1, task_type="ncf", accept_deferred=True)
    assert m.leases[bert["id"]].request.priority == 1
    assert (bert["queue"]["position"], ncf["queue"]["position"]) == (1, 2)
    t4 = await free_a_t4(rig, fillers)
    got = await view(rig, "vm-b", ncf["id"])
    assert got["state"] == "ACTIVE" and [d["gpu_id"] for d in got["devices"]] == [t4], got
    assert "every request of a higher priority that could start would rather wait for a better GPU" in \
        " ".join(got["reasons"]), got["reasons"]
    waiting = await view(rig, "vm-a", bert["id"])
    assert waiting["queue"]["note"].startswith("waiting for a better GPU"), waiting["queue"]
    assert bert["id"] not in m.queue_passes


class NotCovered(TableModel):
    """The table model with too few records of the task type `rare` to be trusted with its placement (placement
    chooses its GPU by the cold-start rule); its throughput matrix still predicts it as it does bert, unsure of it by
    `sd` (log-space standard deviation per prediction)."""

    def __init__(self, sd: float) -> None:
        super().__init__()
        self.sd = sd

    def covers(self, request: PlacementRequest) -> bool:
        return request.task_type != "rare"

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        as_ = dataclasses.replace(request, task_type="bert") if request.task_type == "rare" else request
        return super().score(as_, devices)

    def uncertainty(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        return [self.sd if request.task_type == "rare" else 0.01 for _ in devices]


@pytest.mark.parametrize("sd", [0.01, 2.0])
async def test_a_request_the_model_does_not_cover_yet_is_compared_by_its_predictions(tmp_path: Path,
                                                                                     aiohttp_client: Any,
                                                                                     sd: float) -> None:
    # until 2026-12-01 a request of a task type the model does not cover kept the whole decision in strict serve
    # order. Now the queue compares it by the model's predictions with their deviations: "rare", first in line, is
    # predicted at 10 % of its best on the freed T4, ncf at 100 %. Where the model is sure of that (sd 0.01) ncf
    # passes it; where it is not (sd 2.0, as for a pair it has never seen: combined 2.83 > ln 10) the two count as
    # equal and "rare" keeps its turn, on a GPU placement chose by the cold-start rule. No draws of the doubt
    rig = make_rig(tmp_path, scenario="demo16", placement={"explore_epsilon": 0.0})
    rig.runtime.placer.use(NotCovered(sd), "v-not-covered")
    rig = await start_rig(rig, aiohttp_client)
    m = rig.runtime.manager
    fillers = await fill(rig)
    rare = await post(rig, "vm-a", 202, gpus=1, task_type="rare", accept_deferred=True)
    ncf = await post(rig, "vm-b", 202, gpus=1, task_type="ncf", accept_deferred=True)
    t4 = await free_a_t4(rig, fillers)
    first, second = (ncf, rare) if sd < 1 else (rare, ncf)
    assert m.leases[first["id"]].state is S.ACTIVE and m.leases[first["id"]].gpu_ids == (t4,)
    assert m.leases[second["id"]].state is S.QUEUED
    said = " ".join(m.leases[first["id"]].reasons)
    if first is ncf:
        assert "comparative advantage: 100% of its best rate on the GPUs free now, against 10% for the request " \
               f"ahead of it ({rare['id']})" in said, said
        assert m.queue_notes[rare["id"]].startswith("passed over 1 time(s)")
    else:
        assert "cold-start" in said and f"{ncf['id']}'s 100% is within the model's uncertainty of it" in said, said


async def test_a_backfill_is_rated_on_the_gpus_it_may_take(tmp_path: Path, aiohttp_client: Any) -> None:
    # the head needs three GPUs of 35 GiB (A100s only) and cannot start; behind it bert and ncf may only backfill:
    # an A100 that frees stays the head's, so the T4 that frees next is all either may take, and ncf gains most there
    rig = await rig_with(tmp_path, aiohttp_client)
    m = rig.runtime.manager
    fillers = await fill(rig)
    head = await post(rig, "vm-d", 202, gpus=3, min_memory_gib=35, task_type="bert", accept_deferred=True)
    bert = await post(rig, "vm-a", 202, gpus=1, task_type="bert", accept_deferred=True)
    ncf = await post(rig, "vm-b", 202, gpus=1, task_type="ncf", accept_deferred=True)
    a100 = next(x for x in fillers if "A100" in m.gpus[x["devices"][0]["gpu_id"]].model)
    fillers.remove(a100)
    await rig.client.delete(f"/v1/leases/{a100['id']}", headers=rig.auth("vm-c"))
    await until(lambda: a100["id"] not in m.leases, 10, "the A100 back")
    await m.drain_queue()
    for who, x in (("vm-d", head), ("vm-a", bert), ("vm-b", ncf)):
        assert (await view(rig, who, x["id"]))["state"] == "QUEUED", who
    t4 = await free_a_t4(rig, fillers)
    got = await view(rig, "vm-b", ncf["id"])
    assert got["state"] == "ACTIVE" and got["devices"][0]["gpu_id"] == t4, got
    assert (await view(rig, "vm-a", bert["id"]))["state"] == "QUEUED"
    # why it starts ahead of its turn, in one sentence: it backfills, and of those that could it is first in order
    assert got["reasons"][0].endswith(f"; backfilled: on GPUs the head of the queue ({head['id']}) will not need; "
                                      "first in serve order (100% of its best rate on the GPUs free now)"), got


async def test_the_queue_prices_each_kind_of_work_once_whatever_its_length(tmp_path: Path,
                                                                          aiohttp_client: Any) -> None:
    rig = await rig_with(tmp_path, aiohttp_client, guest_max_priority=5)
    m = rig.runtime.manager
    fillers = await fill(rig)
    for who, length in (("vm-a", 600), ("vm-b", 7200), ("vm-d", None)):
        await post(rig, who, 202, gpus=1, task_type="bert", priority=3, accept_deferred=True,
                   **({"duration_s": length} if length else {}))
    await post(rig, "vm-b", 202, gpus=1, task_type="ncf", priority=3, accept_deferred=True)
    asked: list[LeaseRequest] = []
    real = m.relative_rates
    m.relative_rates = lambda request, gpus: (asked.append(request) if gpus else None) or real(request, gpus)
    await free_a_t4(rig, fillers)
    # three bert requests of different lengths are one kind of work: one prediction for them, one for ncf, each
    # made for the work alone (no length, no priority: they move every GPU's prediction alike); and one for the
    # running fillers (the rate each runs at: how much of its run it has done, and how long the rest takes)
    assert sorted(r.task_type for r in asked) == ["bert", "filler", "ncf"], asked
    assert all(r.duration_s is None and r.priority == 0 for r in asked), asked


def test_a_request_shapes_terms_are_its_rates_their_deviation_and_its_wait(tmp_path: Path) -> None:
    # what comparative advantage weighs per request shape and size, worked out once per decision: the best rate on
    # the host, the rate now (of a backfill's own room when it has one), the deviation of their ratio (none at its
    # best rate, whichever GPU gives it) and, for a single GPU below its best, when a GPU of its best rate frees
    rig = make_rig(tmp_path, scenario="demo16")
    m = rig.runtime.manager
    rig.runtime.placer.use(Unsure(0.5), "v-unsure")
    now = m.clock()
    by_model = {k: [g for g in m.gpus.values() if k in g.model] for k in ("A100", "V100", "RTX 6000", "T4")}
    for k, gpu in enumerate(by_model["A100"]):
        _hold(m, gpu, now + 300 + 100 * k)  # every A100 busy, the first to free in 300 s
    _hold(m, by_model["T4"][0], now + 900)  # ncf's first T4 busy, another free: at its best rate all the same
    bert, ncf = LeaseRequest(task_type="bert"), LeaseRequest(task_type="ncf")
    usable = lease_queue._Usable(m)
    spread = (0.5 ** 2 + 0.5 ** 2) ** 0.5
    now_terms = usable.terms(bert, 1, None, now)
    a100s = frozenset(g.id for g in by_model["A100"])
    line = lease_queue.Line((300.0, 400.0, 500.0, 600.0), a100s)  # every A100 busy: when each frees
    assert now_terms == (10.0, 8.0, pytest.approx(spread), line)  # a V100 now, an A100 in 300 s
    room = [by_model["T4"][1]]  # a backfill's room: a T4 (rate 1), however good the other free GPUs are
    assert usable.terms(bert, 1, room, now) == (10.0, 1.0, pytest.approx(spread), line)
    assert usable.terms(bert, 1, None, now) is now_terms  # once per shape and size; a room is not kept as it
    # a set of 2 may wait too: for 2 A100s (every A100 busy: the same line, the second to free in 400 s)
    assert usable.terms(bert, 2, None, now) == (10.0, 8.0, pytest.approx(spread), line)
    assert usable.terms(ncf, 1, None, now) == (9.0, 9.0, 0.0, None)  # its best rate now (the second T4): exact
    rig.runtime.placer.use(TableModel(), "v-table")  # a model that gives no deviations: ratios count as exact
    assert lease_queue._Usable(m).terms(bert, 1, None, now) == (10.0, 8.0, 0.0, line)
    m.relative_rates = lambda request, gpus: None  # no model
    assert lease_queue._Usable(m).terms(bert, 1, None, now) is None


def test_a_lease_gone_from_the_queue_leaves_no_pass_count_or_note_behind(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, scenario="demo16")
    m = rig.runtime.manager
    rig.runtime.placer.use(TableModel(), "v-table")
    now = m.clock()
    for k, (vm, task) in enumerate((("vm-a", "bert"), ("vm-b", "ncf"))):
        lease = new_lease(f"l-q{k}", f"uuid-{vm}", vm, LeaseRequest(task_type=task, accept_deferred=True), now - 60 + k)
        m.leases[lease.id] = lease.transition(S.QUEUED, queued_at=now - 60 + k)
    m.queue_passes["l-gone"], m.queue_notes["l-gone"] = (3, now - 100), "passed over 3 time(s) ..."
    m.queue_passes["l-q1"], m.queue_notes["l-q0"] = (1, now - 10), "waiting for a better GPU: ..."
    m.queue_waits["l-gone"], m.queue_waits["l-q0"], m.queue_waits["l-q1"] = now + 5, now + 60, now + 30
    pick = lease_queue._next_grant(m)  # both could start, each at its best rate: the first in serve order goes
    assert pick is not None and pick[0].id == "l-q0" and pick[3] is None  # in its turn, nobody passed: no reason
    assert "l-gone" not in m.queue_passes and "l-gone" not in m.queue_notes and "l-gone" not in m.queue_waits
    assert "l-q0" not in m.queue_notes and "l-q0" not in m.queue_waits  # granted: no longer told why it waits
    assert m.queue_passes["l-q1"] == (1, now - 10)  # a lease still queued keeps its count
    # and the time it waits for: this decision neither passed it nor had it wait
    assert m.queue_waits["l-q1"] == now + 30


def test_only_active_leases_count_as_runs_still_going_each_once(tmp_path: Path) -> None:
    # what the queue hands the model for a task type's run time: how long each ACTIVE lease holding GPUs has run (a
    # lease on two GPUs once; one still binding, or released but still claimed while it detaches, not at all; a grant
    # dated after the clock, as 0 s)
    rig = make_rig(tmp_path, scenario="demo16")
    m = rig.runtime.manager
    now = m.clock()
    gids = list(m.gpus)
    held = [("l-pair", "bert", S.ACTIVE, now - 300, gids[0:2]), ("l-one", "bert", S.ACTIVE, now - 100, gids[2:3]),
            ("l-ncf", "ncf", S.ACTIVE, now + 5, gids[3:4]), ("l-bind", "bert", S.BINDING, now - 50, gids[4:5]),
            ("l-out", "bert", S.DETACHING, now - 900, gids[5:6])]
    for lease_id, task, state, granted, gpus in held:
        lease = new_lease(lease_id, f"uuid-{lease_id}", lease_id, LeaseRequest(task_type=task, gpus=len(gpus)),
                          now - 1000)
        m.leases[lease_id] = dataclasses.replace(lease, state=state, granted_at=granted)
        for gid in gpus:
            m.claims[gid] = lease_id
    got = lease_queue._running_by_task(m, now, lease_queue._Usable(m))
    assert sorted(got["bert"]) == [100.0, 300.0] and got["ncf"] == [0.0] and set(got) == {"bert", "ncf"}


def test_a_running_lease_is_counted_and_dated_at_the_rate_of_its_gpus(tmp_path: Path) -> None:
    # the records' run times are at rate 1 (the task type's typical rate; TableModel: three a100-job leases of
    # 120 s). An a100-job lease on an A100 runs at 9 (TableModel's rates): 10 s there is 90 s of such a run, so it
    # is expected to need 30 s more at rate 1, 3.3 s on its A100; one on a T4 (rate 0.5 here) that has run 10 s,
    # 5 s of it: 115 s more at rate 1, 230 s on its T4. A lease on a pair runs at its slower GPU's rate; one with a
    # GPU the model cannot rate, at an unknown rate (1). Without a model (no rates): the times as they are.
    rig = make_rig(tmp_path, scenario="demo16")
    rig.runtime.placer.use(SlowT4(), "v-table")
    m = rig.runtime.manager
    now = m.clock()
    a100s = [g for g, gpu in m.gpus.items() if "A100" in gpu.model]
    t4s = [g for g, gpu in m.gpus.items() if "T4" in gpu.model]
    held = {"l-a100": [a100s[0]], "l-t4": [t4s[0]], "l-pair": [a100s[1], t4s[1]], "l-gone": [t4s[2]]}
    for lease_id, gpus in held.items():
        lease = new_lease(lease_id, f"uuid-{lease_id}", lease_id, LeaseRequest(task_type="a100-job", gpus=len(gpus)),
                          now - 1000)
        devices = tuple(LeaseDevice(gid, (m.gpus[gid].address,), ("nvidia",), 0) for gid in gpus)
        if lease_id == "l-gone":  # and a GPU this host no longer lists (no prediction for it)
            devices += (LeaseDevice("gpu-gone", ("0000:ff:00.0",), ("nvidia",), 99),)
        m.leases[lease_id] = dataclasses.replace(lease, state=S.ACTIVE, granted_at=now - 10, devices=devices,
                                                 expires_at=now - 10 + m.policy.default_duration_s)
        for gid in gpus:
            m.claims[gid] = lease_id
    usable = lease_queue._Usable(m)
    assert lease_queue.running_rate(m.leases["l-a100"], usable) == 9.0
    assert lease_queue.running_rate(m.leases["l-pair"], usable) == 0.5
    assert lease_queue.running_rate(m.leases["l-gone"], usable) == 1.0  # a GPU without a prediction: rate unknown
    assert sorted(lease_queue._running_by_task(m, now, usable)["a100-job"]) == [5.0, 5.0, 10.0, 90.0]
    assert usable.frees_at(a100s[0], now) == pytest.approx(now + 30 / 9)
    assert usable.frees_at(t4s[0], now) == pytest.approx(now + 230)
    assert usable.frees_at(a100s[1], now) == usable.frees_at(t4s[1], now) == pytest.approx(now + 230)
    rig.runtime.placer.use(None, None)  # no model: no rates (and no records to date a GPU by)
    assert lease_queue.running_rate(m.leases["l-a100"], lease_queue._Usable(m)) == 1.0


def test_a_busy_gpu_is_dated_by_the_records_only_where_its_active_lease_stated_no_length(tmp_path: Path) -> None:
    # the records show a100-job leases of 120 s (TableModel.left_run_s): an ACTIVE one that stated no length and has
    # run 60 s frees in 60 s; one that has outlived them all (500 s) in as long again, unless its reclaim deadline
    # or expiry comes sooner; one granted after the clock (its host's clock stepped back) as one that has run 0 s;
    # one that stated its length, one still binding, and one of a task type without records free at their lease's
    # expiry (busy_until). Each GPU is dated once per decision.
    rig = make_rig(tmp_path, scenario="demo16")
    rig.runtime.placer.use(TableModel(), "v-table")
    m = rig.runtime.manager
    now = m.clock()
    ttl = m.policy.default_duration_s
    held = {  # lease: (task type, state, granted, stated length, expiry, reclaim deadline, when it frees)
        "l-young": ("a100-job", S.ACTIVE, now - 60, None, now - 60 + ttl, None, now + 60),
        "l-old": ("a100-job", S.ACTIVE, now - 500, None, now - 500 + ttl, None, now + 500),
        "l-notice": ("a100-job", S.ACTIVE, now - 500, None, now - 500 + ttl, now + 30, now + 30),
        "l-ending": ("a100-job", S.ACTIVE, now - 500, None, now + 200, None, now + 200),
        "l-skew": ("a100-job", S.ACTIVE, now + 5, None, now + 5 + ttl, None, now + 120),
        "l-stated": ("a100-job", S.ACTIVE, now - 60, 7200, now - 60 + 7200, None, now - 60 + 7200),
        "l-bind": ("a100-job", S.BINDING, now - 60, None, now - 60 + ttl, None, now - 60 + ttl),
        "l-other": ("filler", S.ACTIVE, now - 60, None, now - 60 + ttl, None, now - 60 + ttl),
    }
    gids = list(m.gpus)
    for gid, (lease_id, (task, state, granted, stated, expiry, deadline, _)) in zip(gids, held.items()):
        lease = new_lease(lease_id, f"uuid-{lease_id}", lease_id, LeaseRequest(task_type=task, duration_s=stated),
                          now - 1000)
        m.leases[lease_id] = dataclasses.replace(
            lease, state=state, granted_at=granted, expires_at=expiry,
            **({"notice": "reclaim", "notice_deadline": deadline} if deadline is not None else {}))
        m.claims[gid] = lease_id
    asked: list[str] = []
    records = m.left_run_s
    m.left_run_s = lambda task, done: asked.append(task) or records(task, done)
    usable = lease_queue._Usable(m)
    for _ in range(2):
        got = {lease_id: usable.frees_at(gid, now) for gid, lease_id in zip(gids, held)}
        assert got == {lease_id: row[-1] for lease_id, row in held.items()}
    assert len(asked) == 6  # the ACTIVE leases that stated no length, each once


@pytest.mark.parametrize("booked", [False, True])
def test_a_queued_requests_eta_counts_on_the_records_where_the_leases_ahead_stated_no_length(tmp_path: Path,
                                                                                            booked: bool) -> None:
    # every GPU held by an a100-job lease that stated no length (records: 120 s each), one of them granted 100 s ago
    # (20 s left), the others 60 s ago (60 s left): a request of one GPU queued now starts in 20 s, one of two behind
    # it in 60 s, not at the leases' 8 h expiry; with a booking in the calendar (tomorrow) the same
    rig = make_rig(tmp_path, scenario="demo16", clock=Clock())
    rig.runtime.placer.use(TableModel(), "v-table")
    m = rig.runtime.manager
    now = m.clock()
    for k, gid in enumerate(m.gpus):
        granted = now - (100 if k == 3 else 60)
        lease = new_lease(f"l-{k}", f"uuid-{k}", f"vm-{k}", LeaseRequest(task_type="a100-job"), granted)
        m.leases[lease.id] = dataclasses.replace(lease, state=S.ACTIVE, granted_at=granted,
                                                 expires_at=granted + m.policy.default_duration_s)
        m.claims[gid] = lease.id
    if booked:
        lease = new_lease("l-book", "uuid-book", "vm-book",
                          LeaseRequest(gpus=1, duration_s=3600, start_at=now + 86400), now)
        m.leases[lease.id] = dataclasses.replace(lease, state=S.BOOKED, booked_gpus=(next(iter(m.gpus)),))
    for k, gpus in enumerate((1, 2)):
        lease = new_lease(f"l-q{k}", f"uuid-q{k}", f"vm-q{k}", LeaseRequest(gpus=gpus, accept_deferred=True), now - 9 + k)
        m.leases[lease.id] = lease.transition(S.QUEUED, queued_at=now - 9 + k)
    m.queue_cache = None
    assert lease_queue.view(m) == {"l-q0": (1, now + 20), "l-q1": (2, now + 60)}


def test_a_waiting_leases_eta_is_when_its_gpu_frees_never_sooner_than_the_queue_says(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, scenario="demo16", clock=Clock())
    m = rig.runtime.manager
    now = m.clock()
    for k, vm in enumerate(("vm-a", "vm-b", "vm-c")):
        lease = new_lease(f"l-q{k}", f"uuid-{vm}", vm, LeaseRequest(task_type="bert", accept_deferred=True),
                          now - 60 + k)
        m.leases[lease.id] = lease.transition(S.QUEUED, queued_at=now - 60 + k)
    plain = lease_queue.view(m)  # every GPU free: each could start now
    assert plain == {"l-q0": (1, now), "l-q1": (2, now), "l-q2": (3, now)}, plain
    m.queue_waits["l-q1"], m.queue_waits["l-q2"] = now + 60, now - 30  # one waits a minute; one wait long past
    m.queue_cache = None
    assert lease_queue.view(m) == {"l-q0": (1, now), "l-q1": (2, now + 60), "l-q2": (3, now)}


class SlowT4(TableModel):
    """The table model with a100-job at half its typical rate on a T4 (a rate below 1)."""

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        got = super().score(request, devices)
        if request.task_type != "a100-job":
            return got
        return [0.5 if "T4" in d.model else r for r, d in zip(got, devices)]


class OnlyBert(TableModel):
    """The table model, trained on bert alone: it covers no other task type."""

    def covers(self, request: PlacementRequest) -> bool:
        return request.task_type == "bert"


def test_without_an_active_model_serve_order_decides(tmp_path: Path) -> None:
    # nothing to compare by: the first that could start goes, nobody is passed over. Once a model is active, a task
    # type it does not cover yet (ncf, for a model trained on bert alone) is ranked by its predictions all the same
    rig = make_rig(tmp_path, scenario="demo16")
    m = rig.runtime.manager
    now = m.clock()
    for k, (vm, task) in enumerate((("vm-a", "bert"), ("vm-b", "ncf"), ("vm-c", "bert"))):
        lease = new_lease(f"l-q{k}", f"uuid-{vm}", vm, LeaseRequest(task_type=task, accept_deferred=True), now - 60 + k)
        m.leases[lease.id] = lease.transition(S.QUEUED, queued_at=now - 60 + k)
    m.queue_passes["l-q0"] = (2, now - 30)
    ncf = LeaseRequest(task_type="ncf")
    assert lease_queue._Usable(m).ranked(ncf) is None
    pick = lease_queue._next_grant(m)
    assert pick is not None and pick[0].id == "l-q0" and pick[3] is None
    assert m.queue_passes["l-q0"] == (2, now - 30)  # strict order: nobody passed, no count moved
    rig.runtime.placer.use(OnlyBert(), "v-bert")
    ranked = lease_queue._Usable(m).ranked(ncf)
    assert ranked is not None and "T4" in m.gpus[ranked.order[0]].model and ranked.by_id[ranked.order[0]] == 9.0
