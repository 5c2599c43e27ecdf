"""engramd's exceptions, the daemon's and the worker's: one class per cause of failure.

`CheckpointError` means the checkpoint itself is unusable: neither sharing nor
a private load can help. Every `ShareError` means sharing is impossible but a
private load is not; in auto mode the client falls back and logs the message
once, in strict mode it raises. The daemon raises the same classes; each
reason travels with the status (REASON_KEY) and the worker raises its class
again (BY_REASON). Which gRPC status each reason gets is the daemon's
(engramd/errors.py).
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Why the daemon refused, as it travels in the trailing metadata (REASON_KEY).

    The one list both sides use: each names one class of the hierarchy below,
    which the daemon raises and the worker raises again (BY_REASON).
    """

    INTERNAL = "internal"
    INVALID_REQUEST = "invalid-request"
    CHECKPOINT = "checkpoint"
    SELECTION = "selection"
    LEASES = "leases"
    UNKNOWN_SET = "unknown-set"
    NOT_ALLOWED = "not-allowed"
    CAPACITY = "capacity"
    BUDGET = "budget"
    FINGERPRINT = "fingerprint"
    LOAD_FAILED = "load-failed"
    #: An operator's drop of a set that loads, or that workers lease (without --force).
    DROP_REFUSED = "drop-refused"
    DRAINING = "draining"
    #: The fd channel: the daemon's own copy of the set cannot be handed out.
    NOT_VISIBLE = "not-visible"
    #: The fd channel: too many connections (of this uid, or in all); paths may still work.
    BUSY = "busy"
    #: Sets workers loaded from one uid's files would pass its share (--worker-share-per-uid).
    QUOTA = "quota"
    #: One owner's files already hold the large header reads the daemon does at once.
    READERS = "readers"
    #: A verify found bytes of the daemon's copy that no longer match their checksums.
    FAILED_VERIFICATION = "failed-verification"


class EngramdError(Exception):
    """Base class of every engramd error, the daemon's and the worker's alike.

    `reason` names the cause on the wire; a class that sets one is the one
    class both sides raise for it (BY_REASON).
    """

    reason: Reason = Reason.INTERNAL


class CheckpointError(EngramdError):
    """A checkpoint that cannot be read as safetensors: names the file, the tensor and the fix."""

    reason = Reason.CHECKPOINT


class DeviceError(EngramdError):
    """A device was asked for that this worker cannot use: names the device and the fix.

    A configuration error, raised in every share mode: private tables cannot
    give a worker a device it cannot reach.
    """


class NoCpuView(EngramdError, KeyError):
    """`tables[name]` of a set held in GPU memory: only its CUDA view (`tables.cuda`) exists."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShareError(EngramdError):
    """Sharing is impossible; the message names the cause, the sizes and the fix.

    Every refusal of the daemon is one: a worker can still load its own tables.
    """

    #: Short cause name, used in logs and metrics ("daemon-unavailable", ...).
    cause = "share"


class DaemonUnavailable(ShareError):
    """No daemon answers at the socket."""

    cause = "daemon-unavailable"


class Draining(DaemonUnavailable):
    """The daemon is stopping."""

    reason = Reason.DRAINING


class ShmCapacityError(ShareError):
    """The daemon's shm folder cannot hold the set."""

    cause = "capacity"
    reason = Reason.CAPACITY


class BudgetExceeded(ShmCapacityError):
    """The set would take the daemon past its memory budget."""

    reason = Reason.BUDGET


class QuotaExceeded(ShmCapacityError):
    """Sets workers loaded from one uid's files would take more than its share."""

    reason = Reason.QUOTA


class SegmentNotVisible(ShareError):
    """The daemon's files are not visible to this worker (another mount or IPC namespace)."""

    cause = "not-visible"
    reason = Reason.NOT_VISIBLE


class FingerprintMismatch(ShareError):
    """The daemon's copy of the checkpoint differs from the worker's."""

    cause = "fingerprint"
    reason = Reason.FINGERPRINT


class FailedVerification(ShareError):
    """The daemon's copy of the set failed verification (`engramd verify` found changed
    bytes): it hands it out no more until the operator loads it again."""

    cause = "failed-verification"
    reason = Reason.FAILED_VERIFICATION


class NotAllowed(ShareError):
    """The daemon refuses to load this checkpoint for a worker (outside its allowed roots)."""

    cause = "not-allowed"
    reason = Reason.NOT_ALLOWED


class SelectionRefused(ShareError):
    """The daemon loads for workers only its configured selection of tensors (--tensors)."""

    cause = "selection"
    reason = Reason.SELECTION


class UnknownSet(ShareError):
    """The daemon holds no such set and was given nothing to load it from."""

    cause = "unknown-set"
    reason = Reason.UNKNOWN_SET


class NoGpuRoute(DeviceError, ShareError):
    """The device cannot read the daemon's read-only mapping, and no other route is offered.

    A ShareError in auto mode (a private registered copy instead, one
    warning), a DeviceError in strict mode.
    """

    cause = "gpu-route"


class DaemonError(ShareError):
    """The daemon answered with an error that has no more specific class."""

    cause = "daemon-error"


class InvalidRequest(DaemonError):
    """A request with malformed fields."""

    reason = Reason.INVALID_REQUEST


class TooManyLeases(DaemonError):
    """The daemon holds as many leases as it is configured to."""

    reason = Reason.LEASES


class LoadFailed(DaemonError):
    """A load stopped for a reason other than capacity or a bad checkpoint."""

    reason = Reason.LOAD_FAILED


class DropRefused(DaemonError):
    """A drop of a set that is loading, or leased without `force`: nothing was dropped."""

    reason = Reason.DROP_REFUSED


class ReadersBusy(DaemonError):
    """One owner's files already hold the daemon's share of large header reads."""

    reason = Reason.READERS


def _with_own_reason(cls: type[ShareError]) -> list[type[ShareError]]:
    found = [cls] if "reason" in vars(cls) else []
    for sub in cls.__subclasses__():
        found += _with_own_reason(sub)
    return found


#: Wire reason (trailing metadata "engramd-reason") -> the exception a worker raises.
#: Reasons not listed (a checkpoint the daemon cannot read where the worker
#: can, an internal error) become DaemonError: the worker can still load its own.
BY_REASON: dict[str, type[ShareError]] = {cls.reason: cls for cls in _with_own_reason(ShareError)}

#: Every cause a worker may report in ReportFallback; the daemon accepts no other.
CAUSES = frozenset(
    cls.cause
    for cls in (
        DaemonUnavailable,
        ShmCapacityError,
        SegmentNotVisible,
        FingerprintMismatch,
        FailedVerification,
        NotAllowed,
        SelectionRefused,
        UnknownSet,
        NoGpuRoute,
        DaemonError,
    )
)

#: Trailing-metadata key (and the fd channel's FdReply.reason) that carries the daemon's reason.
REASON_KEY = "engramd-reason"
