"""The project's error types. Adapters translate foreign exceptions into these; the web layer maps them to HTTP."""

from __future__ import annotations

from typing import Any


class HostAgentError(Exception):
    """Base of every error the agent raises on purpose."""

    code = "internal"
    http_status = 500
    retryable = False

    def __init__(self, message: str, *, field: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """The API's error body: code, message, the field at fault, and the public details (when the refused
        resources are expected to be available)."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field:
            body["field"] = self.field
        for key in PUBLIC_DETAILS:
            if self.details.get(key) is not None:
                body[key] = self.details[key]
        return body


PUBLIC_DETAILS = ("available_in_s", "earliest_start")  # details the API's error body carries (the rest stay in logs and journals)


class InvalidInput(HostAgentError):
    """Malformed or out-of-range input; nothing was changed."""

    code = "invalid_input"
    http_status = 400


class NotFound(HostAgentError):
    """An unknown GPU, lease, domain or token subject."""

    code = "not_found"
    http_status = 404


class Conflict(HostAgentError):
    """The request is valid but the current state forbids it (GPU in use, illegal transition)."""

    code = "conflict"
    http_status = 409


class InvalidTransition(Conflict):
    """A state machine was asked for a transition its table does not allow."""

    code = "invalid_transition"


class Unauthorized(HostAgentError):
    """No credential, or a bad one."""

    code = "unauthorized"
    http_status = 401


class Forbidden(HostAgentError):
    """A valid credential that may not do this."""

    code = "forbidden"
    http_status = 403


class ConfigError(HostAgentError):
    """The configuration file or environment is invalid."""

    code = "config_error"


class HostError(HostAgentError):
    """sysfs or the kernel did not do what was asked (fatal for this step)."""

    code = "host_error"
    http_status = 500


class StepTimeout(HostError):
    """A sysfs write that can hang did not return in time; the device needs attention."""

    code = "step_timeout"
    retryable = True


class HypervisorError(HostAgentError):
    """libvirt (or the simulated hypervisor) refused or failed."""

    code = "hypervisor_error"
    http_status = 502


class HypervisorUnavailable(HypervisorError):
    """The hypervisor connection is down; retry later."""

    code = "hypervisor_unavailable"
    http_status = 503
    retryable = True


class StoreUnavailable(HostAgentError):
    """The usage store cannot be reached; writes are spooled."""

    code = "store_unavailable"
    http_status = 503
    retryable = True


class Overloaded(HostAgentError):
    """A bounded queue is full; the client should retry after a while."""

    code = "overloaded"
    http_status = 503
    retryable = True


class TooManyRequests(HostAgentError):
    """One tenant or source asked for more than its share (a per-VM, per-token or per-address limit); the others
    are unaffected. The client should retry after `retry_after` seconds."""

    code = "rate_limited"
    http_status = 429
    retryable = True
