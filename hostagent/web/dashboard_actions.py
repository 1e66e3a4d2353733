"""Dashboard operator actions: the form POSTs that change something, each guarded by `action` (CSRF token,
operator credential, the outcome flashed on the page it came from). It owns what the buttons do: release a lease
(saying so when the guest has not acknowledged the detach yet), pause or resume idle reclaim on a lease, and put
a quarantined GPU back into service, every change recorded under the actor `dashboard:<subject>`.
"""

from __future__ import annotations

from aiohttp import web

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.web.auth import Identity
from hostagent.web.dashboard_plumbing import action, dashboard_of
from hostagent.web.keys import DASH_FORM


@action
async def release_action(request: web.Request, who: Identity) -> str:
    """Operator: release a lease, or cancel a queued request."""
    rt = dashboard_of(request).rt
    lease_id = request.match_info["lease_id"]
    # the button said Cancel: a request leaves the queue, a booking the calendar
    was = rt.manager.get(lease_id).state.value
    queued = was in ("QUEUED", "BOOKED")
    reason = "cancelled by operator" if queued else "released by operator"
    lease = await rt.manager.release(lease_id, actor=f"dashboard:{who.subject}", reason=reason)
    if queued:
        return f"{'booking' if was == 'BOOKED' else 'queued request'} {lease_id} cancelled ({lease.state.value})"
    if lease.state.value == "DETACH_PENDING":
        return f"lease {lease_id}: the guest has not acknowledged the detach yet (DETACH_PENDING)"
    return f"lease {lease_id} released ({lease.state.value})"


@action
async def reclaim_action(request: web.Request, who: Identity) -> str:
    """Operator: pause or resume idle reclaim on a lease."""
    rt = dashboard_of(request).rt
    form = request[DASH_FORM]
    value = str(form.get("paused") or "")
    if value not in ("0", "1"):
        raise InvalidInput("paused must be 0 or 1", field="paused")
    lease_id = request.match_info["lease_id"]
    if rt.reaper is None:
        raise NotFound("idle reclaim is not running on this agent", field="reaper")
    await rt.reaper.set_paused(lease_id, value == "1", actor=f"dashboard:{who.subject}")
    return f"idle reclaim {'paused' if value == '1' else 'resumed'} for lease {lease_id}"


@action
async def clear_quarantine_action(request: web.Request, who: Identity) -> str:
    """Operator: put a quarantined GPU back into service."""
    rt = dashboard_of(request).rt
    gpu_id = request.match_info["gpu_id"]
    await rt.manager.clear_quarantine(gpu_id, actor=f"dashboard:{who.subject}")
    return f"quarantine cleared on {gpu_id}"


__all__ = ["clear_quarantine_action", "reclaim_action", "release_action"]
