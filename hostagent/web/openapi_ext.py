"""Paths added by later capabilities (topology, reaper, model, metrics) register here, keeping openapi.py stable."""

from __future__ import annotations

from typing import Any

EXTENSIONS: list[Any] = []


def extend(paths: dict[str, Any]) -> None:
    """Let each registered extension add its paths."""
    for ext in EXTENSIONS:
        ext(paths)
