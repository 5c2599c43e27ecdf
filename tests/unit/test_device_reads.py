"""A load's reads sized to the block device under the checkpoint (engramd.host.blockdev,
engramd.sets.loader.sized_reads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engramd.checksum import BUFFER_BYTES
from engramd.host.blockdev import DeviceQueue, queue_of
from engramd.host.blocking import cores
from engramd.sets.loader import MAX_READ_BYTES, MAX_THREADS, MIN_THREADS, sized_reads

MiB = 1 << 20


def _device(root: Path, name: str, max_kb: int, depth: int | None) -> Path:
    """A device folder as sysfs lays one out: queue/max_sectors_kb, nr_requests."""
    folder = root / "devices" / name
    (folder / "queue").mkdir(parents=True)
    (folder / "queue" / "max_sectors_kb").write_text(f"{max_kb}\n")
    if depth is not None:
        (folder / "queue" / "nr_requests").write_text(f"{depth}\n")
    return folder


def _link(root: Path, dev: int, folder: Path) -> None:
    """/sys/dev/block/MAJ:MIN, a link to the device's folder."""
    (root / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(folder)


def test_the_root_disk_is_read_from_sysfs() -> None:
    dev = os.stat("/usr").st_dev
    queue = queue_of(dev)
    if queue is None:
        pytest.skip("/usr is on no block device here (an overlay or a network file system)")
    # The same figures the kernel shows for that disk under /sys/block.
    block = Path("/sys/block") / queue.name / "queue"
    assert queue.max_request == int((block / "max_sectors_kb").read_text()) << 10
    # A bio-based device (pmem, zram) keeps no request queue: depth 0, as sysfs hides it.
    assert queue.members >= 1 and queue.depth >= 0


def test_a_file_on_no_block_device_has_no_queue(tmp_path: Path) -> None:
    assert queue_of(os.stat("/proc/self").st_dev) is None
    assert queue_of(os.makedev(0, 999), root=tmp_path) is None


def test_a_partition_reads_its_disks_queue_and_an_array_its_members_depths(
    tmp_path: Path,
) -> None:
    disk = _device(tmp_path, "nvme0n1", 128, 1023)
    (disk / "nvme0n1p1").mkdir()
    (disk / "nvme0n1p1" / "partition").write_text("1\n")
    _link(tmp_path, os.makedev(259, 1), disk / "nvme0n1p1")
    assert queue_of(os.makedev(259, 1), root=tmp_path) == DeviceQueue("nvme0n1", 128 << 10, 1023, 1)

    # md0 over four drives (one through its partition): no queue depth of its own.
    md = _device(tmp_path, "md0", 512, None)
    (md / "slaves").mkdir()
    for i in range(4):
        member = _device(tmp_path, f"nvme{i + 1}n1", 128, 255)
        if i == 0:
            (member / "p1").mkdir()
            (member / "p1" / "partition").write_text("1\n")
            member = member / "p1"
        (md / "slaves" / f"m{i}").symlink_to(member)
    _link(tmp_path, os.makedev(9, 0), md)
    assert queue_of(os.makedev(9, 0), root=tmp_path) == DeviceQueue("md0", 512 << 10, 4 * 255, 4)


def test_reads_are_the_devices_largest_request_in_whole_pieces() -> None:
    assert sized_reads(DeviceQueue("nvme0n1", 128 << 10, 1023, 1), 0).size == BUFFER_BYTES
    assert sized_reads(DeviceQueue("vda", 4 * MiB, 256, 1), 0).size == 4 * MiB
    assert sized_reads(DeviceQueue("sdb", 3 * MiB, 64, 1), 0).size == 4 * MiB
    assert sized_reads(DeviceQueue("dm-0", 1 << 30, 128, 1), 0).size == MAX_READ_BYTES
    assert sized_reads(None, 0).size == BUFFER_BYTES


def test_reads_in_flight_fill_the_devices_queue_within_the_bounds() -> None:
    floor = max(MIN_THREADS, min(MAX_THREADS, cores()))
    # 128 KiB requests and 2 MiB direct reads: a reader keeps 16 queued, so 32 are two.
    assert sized_reads(DeviceQueue("nvme0n1", 128 << 10, 1023, 1), 0).threads == floor
    # 4 MiB requests as large as the reads: 1 a reader, 32 readers.
    assert sized_reads(DeviceQueue("vda", 4 * MiB, 256, 1), 0).threads == min(
        MAX_THREADS, max(32, floor)
    )
    # A shallow queue (a SATA disk's 8) keeps no more than its depth in flight.
    assert sized_reads(DeviceQueue("sda", 2 * MiB, 8, 1), 0).threads == max(8, floor)
    # Four drives of 512 KiB requests: 128 requests, 4 a reader of 2 MiB, 32 readers.
    md = DeviceQueue("md0", 512 << 10, 4 * 255, 4)
    assert sized_reads(md, 0).threads == min(MAX_THREADS, max(32, floor))
    # --load-threads wins over the device.
    assert sized_reads(md, 3).threads == 3 and sized_reads(None, 5).threads == 5
    assert sized_reads(None, 0).threads == floor
