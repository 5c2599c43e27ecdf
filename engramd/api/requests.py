"""engramd.v1 requests as the sets' plain values (engramd.sets.intents), checked on the way.

The one place the daemon reads a request message: malformed fields are
refused here (InvalidRequest), before any verb of the sets runs. The other
direction, the sets' values as messages, is wire.py's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from engramd.api.wire import WIRE_KINDS, WIRE_ROUTES
from engramd.backings.handles import HandleKind
from engramd.sets.intents import AttachIntent, LoadIntent
from engramd_shared.checkpoint import is_set_id
from engramd_shared.errors import InvalidRequest
from engramd_shared.pb import engramd_pb2 as pb

# Kubernetes' label rules: a worker's labels stay small and print safely.
_MAX_LABELS = 16
_LABEL_KEY = re.compile(r"^[A-Za-z0-9._-]{1,63}$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9._-]{0,63}$")
_MAX_PATH = 4096
_NONCE = re.compile(r"^([0-9a-f]{32})?$")
_DEVICE = re.compile(r"^(cuda:\d{1,3})?$")
_KINDS = {number: kind for kind, number in WIRE_KINDS.items()}
_ROUTES = {number: route for route, number in WIRE_ROUTES.items()}


def attach_intent(request: pb.AttachRequest) -> AttachIntent:
    """A worker's attach; InvalidRequest names the first malformed field."""
    _validate(request)
    return AttachIntent(
        set_id=request.set_id,
        checkpoint=request.checkpoint,
        tensors=request.tensors,
        pid=request.pid,
        labels=dict(request.labels),
        accept=handle_kinds(request.accept) if request.accept else (HandleKind.SHM,),
        reattach=request.reattach,
        nonce=request.nonce,
        pid_namespace=request.pid_namespace,
        pid_start=request.pid_start,
        numa_node=request.numa_node if request.HasField("numa_node") else None,
        device=request.device,
        gpu_route=_ROUTES[request.gpu_route],
    )


def load_intent(request: pb.LoadRequest) -> LoadIntent:
    """The operator's load; InvalidRequest without a checkpoint."""
    if not request.checkpoint:
        raise InvalidRequest("checkpoint is empty; name a checkpoint folder")
    if request.replaces and not is_set_id(request.replaces):
        raise InvalidRequest(
            f"replaces must be a set id (as `engramd status` shows it), not {request.replaces!r}"
        )
    return LoadIntent(
        checkpoint=request.checkpoint, tensors=request.tensors, replaces=request.replaces
    )


def handle_kinds(accept: Iterable[int]) -> tuple[HandleKind, ...]:
    """The kinds a request accepts, in its order; kinds this daemon does not know are left out."""
    return tuple(_KINDS[number] for number in accept if number in _KINDS)


def _validate(request: pb.AttachRequest) -> None:
    if not is_set_id(request.set_id):
        raise InvalidRequest(f"set_id {request.set_id[:64]!r} is not a set id (20 hex digits)")
    if len(request.checkpoint) > _MAX_PATH or len(request.tensors) > _MAX_PATH:
        raise InvalidRequest("checkpoint or tensors is longer than 4096 characters")
    if "\0" in request.checkpoint or "\0" in request.tensors:
        raise InvalidRequest("checkpoint or tensors holds a NUL character")
    if request.pid < 0:
        raise InvalidRequest(f"pid {request.pid} is negative")
    if not _NONCE.match(request.nonce):
        raise InvalidRequest("nonce is not 32 hex digits")
    if not _DEVICE.match(request.device):
        raise InvalidRequest("device is not cuda:N (or empty)")
    if request.gpu_route not in _ROUTES:
        raise InvalidRequest(f"gpu_route {request.gpu_route} is not an engramd.v1.GpuRoute")
    if len(request.labels) > _MAX_LABELS or not all(
        _LABEL_KEY.match(k) and _LABEL_VALUE.match(v) for k, v in request.labels.items()
    ):
        raise InvalidRequest(
            f"labels: at most {_MAX_LABELS}, keys of 1 to 63 and values of up to 63 characters "
            "of A-Z a-z 0-9 . _ - (Kubernetes' label rules)"
        )
