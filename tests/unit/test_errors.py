"""One exception class and one gRPC status per refusal reason (engramd_shared.errors,
engramd.errors)."""

from __future__ import annotations

import grpc

from engramd.errors import CODES, to_status
from engramd_shared.beneath import OutsideRoot
from engramd_shared.errors import (
    BY_REASON,
    BudgetExceeded,
    EngramdError,
    Reason,
    ShareError,
    ShmCapacityError,
)


def test_every_reason_names_one_class_and_one_status() -> None:
    def family(cls: type[EngramdError]) -> list[type[EngramdError]]:
        return [cls, *(c for sub in cls.__subclasses__() for c in family(sub))]

    # A worker raises the daemon's own class for each refusal, and it is a ShareError:
    # auto mode loads its own tables instead.
    refusals = [c for c in family(ShareError) if "reason" in vars(c)]
    reasons = [c.reason for c in refusals]
    assert len(reasons) == len(set(reasons)), "two errors share a reason"
    assert all(BY_REASON[c.reason] is c for c in refusals)
    assert set(CODES) == set(Reason), "a reason without a gRPC status (engramd/errors.py CODES)"
    assert {c.reason for c in family(EngramdError)} <= set(Reason)
    assert BY_REASON[Reason.BUDGET] is BudgetExceeded and issubclass(
        BudgetExceeded, ShmCapacityError
    )
    assert Reason.CHECKPOINT not in BY_REASON and Reason.INTERNAL not in BY_REASON
    assert to_status(OutsideRoot("x"))[:2] == (
        grpc.StatusCode.PERMISSION_DENIED,
        Reason.NOT_ALLOWED,
    )
