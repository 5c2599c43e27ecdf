"""Exceptions a worker can see, one class per cause of failure.

`CheckpointError` means the checkpoint itself is unusable: neither sharing nor
a private load can help. Every `ShareError` means sharing is impossible but a
private load is not; in auto mode the client falls back and logs the message
once, in strict mode it raises.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Why the daemon refused, as it travels in the trailing metadata (REASON_KEY).

    The one list both sides use: the daemon's errors name one, the client maps
    them to its exception classes (BY_REASON).
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


class EngramdError(Exception):
    """Base class of every engramd error."""


class CheckpointError(EngramdError):
    """A checkpoint that cannot be read as safetensors: names the file, the tensor and the fix."""


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
    """Sharing is impossible; the message names the cause, the sizes and the fix."""

    #: Short cause name, used in logs and metrics ("daemon-unavailable", ...).
    cause = "share"


class DaemonUnavailable(ShareError):
    """No daemon answers at the socket."""

    cause = "daemon-unavailable"


class ShmCapacityError(ShareError):
    """The daemon's shm folder cannot hold the set."""

    cause = "capacity"


class SegmentNotVisible(ShareError):
    """The daemon's files are not visible to this worker (another mount or IPC namespace)."""

    cause = "not-visible"


class FingerprintMismatch(ShareError):
    """The daemon's copy of the checkpoint differs from the worker's."""

    cause = "fingerprint"


class NotAllowed(ShareError):
    """The daemon refuses to load this checkpoint for a worker (outside its allowed roots)."""

    cause = "not-allowed"


class SelectionRefused(ShareError):
    """The daemon loads for workers only its configured selection of tensors (--tensors)."""

    cause = "selection"


class UnknownSet(ShareError):
    """The daemon holds no such set and was given nothing to load it from."""

    cause = "unknown-set"


class NoGpuRoute(DeviceError, ShareError):
    """The device cannot read the daemon's read-only mapping, and no other route is offered.

    A ShareError in auto mode (a private registered copy instead, one
    warning), a DeviceError in strict mode.
    """

    cause = "gpu-route"


class DaemonError(ShareError):
    """The daemon answered with an error that has no more specific class."""

    cause = "daemon-error"


#: Wire reason (trailing metadata "engramd-reason") -> client exception class.
#: Reasons not listed (a checkpoint the daemon cannot read where the worker
#: can, an internal error) become DaemonError.
BY_REASON: dict[str, type[ShareError]] = {
    Reason.CAPACITY: ShmCapacityError,
    Reason.BUDGET: ShmCapacityError,
    Reason.QUOTA: ShmCapacityError,
    Reason.FINGERPRINT: FingerprintMismatch,
    Reason.NOT_ALLOWED: NotAllowed,
    Reason.SELECTION: SelectionRefused,
    Reason.UNKNOWN_SET: UnknownSet,
    Reason.DRAINING: DaemonUnavailable,
    Reason.NOT_VISIBLE: SegmentNotVisible,
    # Named for the fd channel, whose unnamed reasons mean NotAllowed.
    Reason.LEASES: DaemonError,
}

#: Every cause a worker may report in ReportFallback; the daemon accepts no other.
CAUSES = frozenset(
    cls.cause
    for cls in (
        DaemonUnavailable,
        ShmCapacityError,
        SegmentNotVisible,
        FingerprintMismatch,
        NotAllowed,
        SelectionRefused,
        UnknownSet,
        NoGpuRoute,
        DaemonError,
    )
)

#: Trailing-metadata key (and the fd channel's FdReply.reason) that carries the daemon's reason.
REASON_KEY = "engramd-reason"
