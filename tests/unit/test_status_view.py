"""A set's status on the wire (engramd.api.wire) and as `engramd status` prints it."""

from __future__ import annotations

from engramd.api.wire import set_info
from engramd.backings import TmpfsBacking
from engramd.cli.status_view import as_dict, render
from engramd.sets.leases import STATUS_LEASES, Lease
from engramd.sets.tableset import SetState, TableSet
from engramd.text import escape
from engramd_shared.pb import engramd_pb2 as pb


def test_status_is_bounded_and_prints_safely() -> None:
    ts = TableSet(
        set_id="ab" * 10,
        checkpoint="/models/evil\n    lease forged",
        selection="*",
        fingerprint="f",
        nbytes=1 << 30,
        ntensors=2,
        backing=TmpfsBacking("/dev/shm", None),
        state=SetState.READY,
    )
    for i in range(STATUS_LEASES + 5):
        lease = Lease(
            f"l{i}",
            ts.set_id,
            "tmpfs",
            node=None,
            pid=100 + i,
            labels={"rank": str(i)},
            pid_start=None,
        )
        ts.leases[lease.lease_id] = lease
    ts.leases["l0"].stale = True
    info = set_info(ts)
    assert len(info.leases) == STATUS_LEASES and info.lease_count == STATUS_LEASES + 5
    assert info.state == "ready" and info.backing == "tmpfs"
    assert info.leases[0].stale and not info.leases[0].pid_verified
    reply = pb.StatusReply(daemon=pb.DaemonInfo(), shm=pb.ShmInfo(total_bytes=1 << 40), sets=[info])
    doc = as_dict(reply)
    assert doc["shm"]["total_bytes"] == 1 << 40  # a number, not protobuf's string
    assert doc["saved_bytes"] == (STATUS_LEASES + 4) << 30  # counted over every lease
    text = render(reply)
    assert "evil\\x0a    lease forged" in text
    assert not any(line.startswith("    lease forged") for line in text.splitlines())
    assert "and 5 more leases" in text and "STALE" in text
    assert escape("a\tb\x1b[2J\x85") == "a\\x09b\\x1b[2J\\x85"


def test_status_names_each_sources_share() -> None:
    def shown(by_source: dict[str, int]) -> str:
        info = pb.SetInfo(set_id="cd" * 10, state="loading", bytes=100, source="peers")
        info.bytes_by_source.update(by_source)
        return " ".join(render(pb.StatusReply(sets=[info]), width=400).split())

    assert "peers 10.0.0.1:7077 25%, 10.0.0.2:7077 75%" in shown(
        {"10.0.0.2:7077": 75, "10.0.0.1:7077": 25}
    )
    assert "peer 10.0.0.1:7077 40%, s3://models/v4 50%, files 10%" in shown(
        {"files": 10, "s3://models/v4": 50, "10.0.0.1:7077": 40}
    )
    assert "s3://models/v4 90%, files 10%" in shown({"files": 10, "s3://models/v4": 90})


def test_status_shows_which_leases_are_on_which_generation() -> None:
    def lease(info: pb.SetInfo, pid: int) -> None:
        info.leases.append(pb.LeaseInfo(lease_id=f"l{pid}", pid=pid, pid_verified=True))

    old = pb.SetInfo(set_id="ab" * 10, state="ready", generation=1, replaced_by="cd" * 10)
    new = pb.SetInfo(set_id="cd" * 10, state="ready", generation=2)
    lease(old, 7)
    lease(new, 8)
    lines = render(pb.StatusReply(sets=[old, new]), width=400).splitlines()
    (moving,) = [line for line in lines if " l7 " in line]
    (moved,) = [line for line in lines if " l8 " in line]
    assert "ab" * 10 + " gen 1" in moving and "MOVING to gen 2 (" + "cd" * 10 + ")" in moving
    assert "cd" * 10 + " gen 2" in moved and "MOVING" not in moved
    doc = as_dict(pb.StatusReply(shm=pb.ShmInfo(), sets=[old, new]))
    assert [(s["generation"], s["replaced_by"]) for s in doc["sets"]] == [(1, "cd" * 10), (2, "")]
