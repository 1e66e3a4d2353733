"""Typed application and request keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web
from multidict import MultiDictProxy

if TYPE_CHECKING:
    from hostagent.web.auth import Identity
    from hostagent.web.ports import AgentServices
    from hostagent.web.dashboard_auth import Session

RUNTIME: web.AppKey[AgentServices] = web.AppKey("runtime")  # the running agent's services (see web.ports)
SERVED: web.AppKey[Callable[[str], None]] = web.AppKey("served")  # told the bound URL once the server listens

IDENTITY: web.RequestKey[Identity] = web.RequestKey("hostagent.identity")  # set by the API's auth middleware
SAMPLES_ACCEPTED: web.RequestKey[int] = web.RequestKey("hostagent.samples_accepted")  # a heartbeat's; metrics counts
DASH_SESSION: web.RequestKey[Session] = web.RequestKey("hostagent.dash_session")
DASH_IDENTITY: web.RequestKey[Identity] = web.RequestKey("hostagent.dash_identity")
DASH_FORM: web.RequestKey[MultiDictProxy[str | bytes | web.FileField]] = web.RequestKey("hostagent.dash_form")
