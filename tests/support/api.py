"""One call to the agent's HTTP API as a client makes it, standard library only (the e2e guests import it too)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call_json(url: str, method: str, path: str, body: Any = None, token: str | None = None,
              timeout: float = 30.0) -> tuple[int, Any]:
    """(status, JSON body) of `method` `url + path`; an HTTP error's status and body are returned, not raised."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
