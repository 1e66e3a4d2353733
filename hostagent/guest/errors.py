"""Errors of the guest agent, each with the exit status the CLI returns for it."""

from __future__ import annotations

from typing import Any

EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4
EXIT_TIMEOUT = 5


class GuestError(Exception):
    """A failure the guest agent explains to its user in one message."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class GuestConfigError(GuestError):
    """Bad or missing configuration (URL, token file, config file)."""


class HostUnreachable(GuestError):
    """The host agent could not be reached after the retries."""

    exit_code = EXIT_UNREACHABLE


class LeaseFailed(GuestError):
    """The host ended the lease before it became ACTIVE (failed and rolled back, or expired in the queue)."""

    exit_code = EXIT_REFUSED


class WaitTimeout(GuestError):
    """A lease was not granted within the wait timeout."""

    exit_code = EXIT_TIMEOUT


# Why a refusal happened and what to do about it, by HTTP status; the server's own message follows.
_HINTS = {
    400: "the host agent rejected the request as invalid",
    401: "the host agent did not accept this VM's token; check the token file (it must hold the token issued "
         "for this VM with `hostagent token issue`)",
    403: "this token is not allowed to do that (a guest token acts only on its own VM's leases)",
    404: "not found on the host agent",
    409: "the host agent refused",
    413: "the request was too large for the host agent (lower batch_max)",
    415: "the host agent only accepts application/json bodies",
    429: "this VM asked for more than its share (see the message); retry later",
    500: "the host agent failed (see its log)",
    503: "the host agent is overloaded or its hypervisor is unavailable",
}


class ApiError(GuestError):
    """The host agent answered with an error body `{"error": {"code", "message", "field"?}}`."""

    exit_code = EXIT_REFUSED

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 retry_after: float | None = None, body: Any = None) -> None:
        self.status = status
        self.code = code
        self.server_message = message
        self.field = field
        self.retry_after = retry_after
        self.body = body
        hint = _HINTS.get(status, "the host agent answered with an error")
        where = f" [{field}]" if field else ""
        text = f"{hint} ({status} {code}){where}: {message}"
        if retry_after is not None:
            text += f" (retry after {retry_after:g} s)"
        super().__init__(text)
        if status >= 500 and status != 503:
            self.exit_code = EXIT_UNREACHABLE
