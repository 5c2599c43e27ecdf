"""The one place that turns any exception into a gRPC status, and the daemon's start-up errors.

The errors the daemon reports are engramd_shared.errors' classes, each keyed
by a reason that travels in the trailing metadata (`engramd-reason`), so the
client raises the same class without parsing messages; CODES gives each
reason its status code.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from engramd_shared.errors import REASON_KEY, EngramdError, InvalidRequest, Reason

log = logging.getLogger("engramd")


#: The status each reason gets: the one place a cause becomes a gRPC code.
CODES: dict[Reason, grpc.StatusCode] = {
    Reason.INTERNAL: grpc.StatusCode.INTERNAL,
    Reason.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.CHECKPOINT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.SELECTION: grpc.StatusCode.PERMISSION_DENIED,
    Reason.LEASES: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.UNKNOWN_SET: grpc.StatusCode.NOT_FOUND,
    Reason.NOT_ALLOWED: grpc.StatusCode.PERMISSION_DENIED,
    Reason.CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.FINGERPRINT: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.LOAD_FAILED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.DROP_REFUSED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.DRAINING: grpc.StatusCode.UNAVAILABLE,
    Reason.NOT_VISIBLE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.QUOTA: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.READERS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    # Not to be retried until the operator loads the set again (gRPC's own rule for it).
    Reason.FAILED_VERIFICATION: grpc.StatusCode.FAILED_PRECONDITION,
}


class UntrustedShm(RuntimeError):
    """The shm folder's `engramd/` is not the daemon's own and cannot be made so."""


class NotInSocketGroup(RuntimeError):
    """The daemon's user may not give its sockets and sets the --socket-group it names."""


class UntrustedSocketFolder(RuntimeError):
    """The sockets' folder is not the daemon's own, or others may write it."""


class ShmInUse(RuntimeError):
    """Another live daemon holds the shm folder's `engramd/` (one daemon per shm folder)."""


class ShmOnDisk(RuntimeError):
    """The shm folder is on a disk filesystem, and the operator did not accept that."""


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, reason, message) for any exception raised while serving."""
    if isinstance(exc, EngramdError) and exc.reason != Reason.INTERNAL:
        return CODES[exc.reason], exc.reason, str(exc)
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
