"""What the block device under a file takes: the size of its largest request and the
requests it queues, read from sysfs.

`/sys/dev/block/MAJ:MIN` names the device a file's st_dev is on; a
partition's queue is its disk's (the folder above it). A device built of
others (md RAID, device-mapper) lists them in `slaves/`: its queue is as
deep as theirs together, so a 4-drive RAID0 keeps four drives' requests in
flight. A file on no block device (tmpfs, NFS, overlayfs' anonymous device,
a FUSE mount) has no queue: the loader's own sizes apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SYS_DEV_BLOCK = Path("/sys/dev/block")


@dataclass(frozen=True)
class DeviceQueue:
    """One block device's request queue, as the kernel describes it."""

    #: The device's name (nvme0n1, md0, vda).
    name: str
    #: Bytes of the largest request the kernel sends it (max_sectors_kb).
    max_request: int
    #: Requests it queues (nr_requests), its members' together for md and dm.
    depth: int
    #: Devices under it: 1 for a disk, the members for md RAID and device-mapper.
    members: int


def queue_of(dev: int, root: Path = SYS_DEV_BLOCK) -> DeviceQueue | None:
    """The queue of block device `dev` (a file's st_dev), or None where it is none."""
    folder = root / f"{os.major(dev)}:{os.minor(dev)}"
    try:
        device = folder.resolve(strict=True)
    except OSError:
        return None
    if not (device / "queue").is_dir() and (device / "partition").is_file():
        device = device.parent
    own = _queue(device)
    if own is None:
        return None
    members = [q for q in map(_queue, _slaves(device)) if q is not None]
    if not members:
        return own
    return DeviceQueue(
        name=own.name,
        max_request=own.max_request,
        depth=sum(m.depth for m in members),
        members=len(members),
    )


def _slaves(device: Path) -> list[Path]:
    try:
        found = sorted((device / "slaves").iterdir())
    except OSError:
        return []
    # A member may be a partition: its queue is its disk's.
    return [s.resolve().parent if (s / "partition").is_file() else s.resolve() for s in found]


def _queue(device: Path) -> DeviceQueue | None:
    queue = device / "queue"
    try:
        max_request = int((queue / "max_sectors_kb").read_text()) << 10
        # A bio-based device (md, some dm) may keep no request queue of its own.
        depth_file = queue / "nr_requests"
        depth = int(depth_file.read_text()) if depth_file.exists() else 0
    except (OSError, ValueError):
        return None
    return DeviceQueue(device.name, max_request, depth, members=1)
