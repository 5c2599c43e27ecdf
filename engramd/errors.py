"""The daemon's errors, and the one place that turns any exception into a gRPC status.

Each error carries its status code and a short reason that travels in the
trailing metadata (`engramd-reason`), so the client can raise one exception
class per cause without parsing messages.
"""

from __future__ import annotations

import logging

import grpc

from engramd_client.errors import REASON_KEY, CheckpointError

log = logging.getLogger("engramd")


class ServiceError(Exception):
    """An error the daemon reports to its caller; the message says what to do."""

    code = grpc.StatusCode.INTERNAL
    reason = "internal"


class InvalidRequest(ServiceError):
    """A request with malformed fields."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "invalid-request"


class UnknownSet(ServiceError):
    """No such set, and nothing to load it from."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "unknown-set"


class NotAllowed(ServiceError):
    """The caller may not make the daemon load this checkpoint."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "not-allowed"


class ShmFull(ServiceError):
    """The shm folder cannot hold the set."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "capacity"


class BudgetExceeded(ServiceError):
    """The set would take the daemon past its memory budget."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "budget"


class FingerprintDiffers(ServiceError):
    """The daemon's copy of the checkpoint is not the worker's."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "fingerprint"


class LoadFailed(ServiceError):
    """A load stopped for a reason other than capacity or a bad checkpoint."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "load-failed"


class Draining(ServiceError):
    """The daemon is stopping."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "draining"


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, reason, message) for any exception raised while serving."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.reason, str(exc)
    if isinstance(exc, CheckpointError):
        return grpc.StatusCode.INVALID_ARGUMENT, "checkpoint", str(exc)
    log.exception("internal error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal", f"internal error: {exc!r}; see the daemon's log"


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status that `exc` maps to."""
    code, reason, message = to_status(exc)
    await context.abort(code, message, trailing_metadata=((REASON_KEY, reason),))
