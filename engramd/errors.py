"""The daemon's errors, and the one place that turns any exception into a gRPC status.

Each error carries its status code and a short reason that travels in the
trailing metadata (`engramd-reason`), so the client can raise one exception
class per cause without parsing messages.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from engramd_client.core.beneath import OutsideRoot
from engramd_client.core.errors import REASON_KEY, CheckpointError, Reason

log = logging.getLogger("engramd")


class ServiceError(Exception):
    """An error the daemon reports to its caller; the message says what to do."""

    code = grpc.StatusCode.INTERNAL
    reason: Reason = Reason.INTERNAL


class InvalidRequest(ServiceError):
    """A request with malformed fields."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = Reason.INVALID_REQUEST


class SelectionRefused(ServiceError):
    """A worker asked the daemon to load another selection of tensors than it is configured for."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = Reason.SELECTION


class TooManyLeases(ServiceError):
    """The daemon holds as many leases as it is configured to."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.LEASES


class UnknownSet(ServiceError):
    """No such set, and nothing to load it from."""

    code = grpc.StatusCode.NOT_FOUND
    reason = Reason.UNKNOWN_SET


class NotAllowed(ServiceError):
    """The caller may not make the daemon load this checkpoint."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = Reason.NOT_ALLOWED


class ShmFull(ServiceError):
    """The shm folder cannot hold the set."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.CAPACITY


class BudgetExceeded(ServiceError):
    """The set would take the daemon past its memory budget."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.BUDGET


class FingerprintDiffers(ServiceError):
    """The daemon's copy of the checkpoint is not the worker's."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.FINGERPRINT


class LoadFailed(ServiceError):
    """A load stopped for a reason other than capacity or a bad checkpoint."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.LOAD_FAILED


class DropRefused(ServiceError):
    """A drop of a set that is loading, or leased without `force`: nothing was dropped."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.DROP_REFUSED


class Draining(ServiceError):
    """The daemon is stopping."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = Reason.DRAINING


class QuotaExceeded(ServiceError):
    """Sets workers loaded from one uid's files would take more than its share."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.QUOTA


class ReadersBusy(ServiceError):
    """One owner's files already hold the daemon's share of large header reads."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.READERS


class UntrustedShm(RuntimeError):
    """The shm folder's `engramd/` is not the daemon's own and cannot be made so."""


class NotInSocketGroup(RuntimeError):
    """The daemon's user may not give its sockets and sets the --socket-group it names."""


class UntrustedSocketFolder(RuntimeError):
    """The sockets' folder is not the daemon's own, or others may write it."""


class ShmOnDisk(RuntimeError):
    """The shm folder is on a disk filesystem, and the operator did not accept that."""


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, reason, message) for any exception raised while serving."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.reason, str(exc)
    if isinstance(exc, OutsideRoot):
        return grpc.StatusCode.PERMISSION_DENIED, NotAllowed.reason, str(exc)
    if isinstance(exc, CheckpointError):
        return grpc.StatusCode.INVALID_ARGUMENT, Reason.CHECKPOINT, str(exc)
    log.exception("internal error while serving a request", exc_info=exc)
    return (
        grpc.StatusCode.INTERNAL,
        Reason.INTERNAL,
        f"internal error: {exc!r}; see the daemon's log",
    )


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status that `exc` maps to."""
    code, reason, message = to_status(exc)
    await context.abort(code, message, trailing_metadata=((REASON_KEY, reason),))


class _Undecodable:
    """Stands in for a request whose bytes are not the expected message."""

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def run(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Undecodable(str(e))

    return run


async def _reject(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid message ({request.error}); "
        "use the stubs generated from proto/engramd/v1",
        trailing_metadata=((REASON_KEY, InvalidRequest.reason),),
    )


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Answers undecodable requests (bad UTF-8, corrupt wire format) with INVALID_ARGUMENT.

    gRPC would otherwise answer UNKNOWN and log a traceback for every one.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The method's handler, its deserializer made tolerant."""
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        tolerant = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await _reject(request, context)
                return await unary(request, context)

            return handler._replace(request_deserializer=tolerant, unary_unary=unary_unary)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            # (Handlers that stream with context.write, like health's Watch,
            # keep gRPC's own decoding: they cannot be wrapped as generators.)
            stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await _reject(request, context)
                    return
                async for reply in stream(request, context):
                    yield reply

            return handler._replace(request_deserializer=tolerant, unary_stream=unary_stream)
        return handler
