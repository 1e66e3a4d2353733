"""Logging: one JSON object per line when not on a TTY (or when asked), with lease and GPU ids as fields."""

from __future__ import annotations

import json
import logging
import sys
import time

_FIELDS = ("lease_id", "gpu_id", "domain")


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        """Render the record as JSON, carrying lease/GPU ids when present."""
        body = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + "Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for f in _FIELDS:
            v = getattr(record, f, None)
            if v is not None:
                body[f] = v
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body)


class TextFormatter(logging.Formatter):
    """Readable lines for a terminal, ids appended."""

    def format(self, record: logging.LogRecord) -> str:
        """Render as text."""
        base = super().format(record)
        extra = " ".join(f"{f}={getattr(record, f)}" for f in _FIELDS if getattr(record, f, None) is not None)
        return f"{base} {extra}".rstrip()


def setup_logging(fmt: str = "auto", level: str = "INFO") -> None:
    """Configure the root logger once."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
