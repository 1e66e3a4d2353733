"""Typed application keys."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from hostagent.runtime import Runtime

RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime")
