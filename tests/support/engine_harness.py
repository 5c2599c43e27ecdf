"""What the engine plugins' tests share: ranks run as processes, a disk that counts reads,
and a rank's own readers of /proc (what it read, where a tensor is mapped).

Imported by tests/vllm_plugin and tests/sglang_plugin (each in its own venv)
and by the rank scripts they start, so it imports no engine and no pytest.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engramd.testing.pagecache import evict
from fleet_lab import s3rver, s3rver_missing

#: The daemon of the object-store tests: the project's own venv (`make setup`), which has
#: NIXL (the fill's transfer processes); an engine's test venv has the engine and no NIXL,
#: as a node's engine and daemon have their own installs.
DAEMON_PYTHON = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class InBucket:
    """A checkpoint in s3rver, the daemon that loaded it from there by URL alone, and the
    environment that reaches the bucket (runai's streamer's variables included)."""

    url: str
    daemon: Any
    env: dict[str, str]


@contextlib.contextmanager
def in_bucket(folder: Path, daemons: Any, tmp: Path) -> Iterator[InBucket]:
    """Every file of `folder` and its attested manifest in s3rver under s3://tables/m, and a
    daemon given only that URL (--checkpoint, no files), loaded; s3rver stopped after."""
    if s3rver_missing() or not DAEMON_PYTHON.exists():
        raise AssertionError(s3rver_missing() or f"no {DAEMON_PYTHON}: run `make setup`")
    token = tmp / "token"
    token.write_text("fleet-token-0123456789abcdef\n")
    token.chmod(0o400)
    with s3rver() as s3:
        for f in sorted(folder.iterdir()):
            s3.put(f"m/{f.name}", f.read_bytes())
        s3.attest(folder, "m", token)
        url = f"s3://{s3.bucket}/m"
        env = {
            **s3.env(),
            # runai's S3 client: the endpoint, path-style, no instance metadata to ask.
            "RUNAI_STREAMER_S3_ENDPOINT": s3.endpoint,
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_EC2_METADATA_DISABLED": "true",
            # Where the engines pull the model's config files to, keyed by the URL alone: a
            # cache kept between tests (~/.cache) hands a later test of s3://tables/m the
            # config of an earlier test's model.
            "SGLANG_CACHE_DIR": str(tmp / "sglang-cache"),
            "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        }
        args = ("--checkpoint", url, "--peer-token-file", str(token))
        daemon = daemons(*args, env=env, python=[str(DAEMON_PYTHON)])
        yield InBucket(url, daemon, {**env, "ENGRAMD_SOCKET": str(daemon.socket)})


def readahead(folder: Path) -> int:
    """Bytes the kernel reads ahead on the block device that holds `folder`."""
    dev = os.stat(folder).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (block / "queue", block / ".." / "queue"):
        if (queue / "read_ahead_kb").exists():
            return int((queue / "read_ahead_kb").read_text()) << 10
    return 0


@contextlib.contextmanager
def small_readahead_disk(where: Path) -> Iterator[Path | None]:
    """An ext4 on a loop device that reads ahead 8 KiB, mounted in `where`; None without root.

    The machine's disk may read ahead megabytes around every touch, which would
    hide whether the tables were read: on this device a read counts what it reads.
    """
    image = where / "disk.img"
    mount = where / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(128 << 20)

    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, capture_output=True, text=True)

    made = run("mkfs.ext4", "-q", "-F", str(image))
    device = run("losetup", "-f", "--show", str(image)) if made.returncode == 0 else made
    if device.returncode != 0:
        yield None
        return
    loop = device.stdout.strip()
    try:
        run("blockdev", "--setra", "16", loop).check_returncode()
        run("mount", loop, str(mount)).check_returncode()
        try:
            yield mount
        finally:
            run("umount", str(mount))
    finally:
        run("losetup", "-d", loop)


def run_rank_processes(
    script: Path,
    world: int,
    tmp: Path,
    model_arg: str,
    env: dict[str, str],
    extra: tuple[str, ...] = (),
    timeout: float = 600,
) -> list[subprocess.CompletedProcess[str]]:
    """Run `world` ranks of `script` (RANK WORLD INIT_FILE MODEL_ARG *extra) as one group."""
    init = tmp / "dist-init"
    full_env = {**os.environ, **env}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), str(init), model_arg, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        for rank in range(world)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The rank's JSON line (fails the test with its stderr when there is none)."""
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return dict(json.loads(lines[-1]))


def io_read_bytes() -> int:
    return _io("read_bytes")


def io_write_bytes() -> int:
    """Bytes this process sent, or dirtied for, the storage layer (pages of a shared file
    mapping it wrote count when it dirties them)."""
    return _io("write_bytes")


def _io(field: str) -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/io")


def disk_read_bytes(folder: Path) -> int:
    """Bytes read so far from the block device that holds `folder` (its sectors read).

    Unlike a process's read_bytes, it counts only what came from that disk:
    not the engine's own modules imported on the way.
    """
    dev = os.stat(folder).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    return int(stat[2]) * 512


def drop_cache(folder: Path) -> None:
    """Evict the checkpoint's pages, so every byte read is counted as read from disk."""
    evict(folder, "*.safetensors")


def mapping_of(address: int) -> str:
    """The /proc/self/maps line whose range holds `address`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span = line.split()[0]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return line
    return ""


def anonymous_kib(address: int) -> int:
    """Anonymous (private, copied-on-write) KiB of the mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Anonymous:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def private_copies() -> int:
    """How many mappings of engramd's private live copies (memfds) this process holds."""
    maps = Path("/proc/self/maps").read_text()
    return sum("/memfd:engramd-private" in line for line in maps.splitlines())


def private_copy_files() -> int:
    """How many of engramd's private live copies (memfds) this process holds open."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held += "engramd-private" in os.readlink(f"/proc/self/fd/{fd}")
    return held


def move_when_told(
    rank: int, folder: Path, step: Callable[[], bool], tables: Any, max_steps: int = 1000
) -> dict[str, Any]:
    """A rank whose live tables were built while the daemon was down (or on the daemon's
    copy, before the operator loads its next generation): it says so (the file `built-RANK`
    in `folder`), waits for the test's `go` (the daemon is ready, or the generation loaded),
    then starts a step every 2 ms (`step`: the plugin's hook where the engine starts one)
    until its tables are the daemon's copy (of another set than they were on), at most
    `max_steps` (the same count on every rank: a group's ranks vote on the move together).
    What it saw, and how long the move took."""
    first = (tables.mode, tables.set_id)
    seen: dict[str, Any] = {
        "mode_before": tables.mode,
        "set_before": tables.set_id,
        "live": tables.live,
        "private_copies_before": private_copies(),
    }
    (folder / f"built-{rank}").touch()
    go = folder / "go"
    while not go.exists():
        time.sleep(0.005)
    began = time.monotonic()
    steps = 0
    while steps < max_steps:
        steps += 1
        step()
        if tables.mode == "shared" and (tables.mode, tables.set_id) != first:
            break
        time.sleep(0.002)
    seen.update(
        mode=tables.mode, set_id=tables.set_id, seconds=time.monotonic() - began, steps=steps
    )
    # Their descriptors close off the step, in a thread of the tables' own.
    waited = time.monotonic()
    while private_copy_files() and time.monotonic() - waited < 10:
        time.sleep(0.01)
    seen.update(private_copies_after=private_copies() + private_copy_files())
    return seen


@contextlib.contextmanager
def ranks_in_thread(
    run: Callable[[], list[subprocess.CompletedProcess[str]]], folder: Path, world: int
) -> Iterator[list[subprocess.CompletedProcess[str]]]:
    """`run()` (ranks run to their end) in a thread, entered once every rank wrote
    `built-RANK` in `folder`; their results in the yielded list once the block is left."""
    import threading

    done: list[subprocess.CompletedProcess[str]] = []
    thread = threading.Thread(target=lambda: done.extend(run()), daemon=True)
    thread.start()
    while not all((folder / f"built-{r}").exists() for r in range(world)):
        # Ranks that ended before they built say why in their results.
        if not thread.is_alive():
            raise AssertionError(
                "ranks ended before building: " + " | ".join(d.stderr[-2000:] for d in done)
            )
        time.sleep(0.05)
    try:
        yield done
    finally:
        thread.join()


def from_private_to_the_daemon(
    daemons: Any,
    checkpoint: Path,
    run: Callable[[tuple[str, ...]], list[subprocess.CompletedProcess[str]]],
    tmp: Path,
    engine: str,
) -> tuple[Any, list[dict[str, Any]]]:
    """Two ranks built while the daemon is down (`run(extra)` runs them with `--live`), then
    the daemon started on `checkpoint` (`daemons(...)` starts one). The daemon and each rank's
    result, each checked to have fallen back to its private live copy with one warning and to
    have moved to the daemon's copy within the issue's 2 s at the same addresses, its private
    copies gone, with one line of the plugin for `engine`'s move."""
    live = tmp / "live"
    live.mkdir()
    with ranks_in_thread(lambda: run(("--live", str(live))), live, 2) as done:
        d = daemons("--checkpoint", str(checkpoint))
        (live / "go").touch()
    outs = []
    for process in done:
        out = result(process)
        moved = out["live"]
        assert (moved["mode_before"], moved["live"]) == ("private", True), moved
        assert moved["private_copies_before"] > 0, moved
        assert moved["mode"] == "shared" and moved["seconds"] < 2.0, moved
        assert moved["same_addresses"] and moved["private_copies_after"] == 0, moved
        said = process.stdout + process.stderr
        assert said.count("Falling back to private tables") == 1, said[-3000:]
        moves = said.count(f"engramd's tables of {engine} moved to the daemon's copy")
        assert moves == 1, said[-3000:]
        outs.append(out)
    return d, outs


def on_the_daemons_pages(info: dict[str, Any], shm_dir: Path) -> None:
    """A rank's layer (its result's `weight_map`) maps the daemon's read-only pages."""
    assert str(shm_dir) in info["weight_map"], info["weight_map"]
    assert info["weight_map"].split()[1] == "r--s", info["weight_map"]


def one_generation_left(d: Any, set_id: str) -> None:
    """Wait until daemon `d` holds set `set_id` alone: the generation before it dropped."""
    deadline = time.monotonic() + 30
    while [s.set_id for s in d.status().sets] != [set_id]:
        assert time.monotonic() < deadline, "the old generation was not dropped within 30 s"
        time.sleep(0.05)


def across_a_generation(
    served: Any,
    new: Path,
    run: Callable[[tuple[str, ...]], list[subprocess.CompletedProcess[str]]],
    tmp: Path,
    engine: str,
    reference: bool = True,
) -> tuple[Any, list[dict[str, Any]]]:
    """Two ranks on daemon `served`'s copy (`run(extra)` runs them with `--live`, and
    `--reference NEW` where `reference`: ranks that check their rows against the new
    revision's files themselves); once both are built, the tables' next revision in folder `new`
    loaded as the set's next generation (--replaces), then the ranks step until they moved.
    The new set and each rank's result, each checked to have moved from the first set to
    the new one at the same addresses, with one line of the plugin for `engine`'s move."""
    from helpers import load_set

    (first,) = [s.set_id for s in served.status().sets]
    live = tmp / "live"
    live.mkdir()
    extra = ("--live", str(live)) + (("--reference", str(new)) if reference else ())
    with ranks_in_thread(lambda: run(extra), live, 2) as done:
        ready = load_set(served, new, replaces=first)
        assert ready.generation == 2
        (live / "go").touch()
    outs = []
    for process in done:
        out = result(process)
        moved = out["live"]
        assert (moved["mode_before"], moved["set_before"]) == ("shared", first), moved
        assert (moved["mode"], moved["set_id"]) == ("shared", ready.set_id), moved
        assert moved["same_addresses"], moved
        said = process.stdout + process.stderr
        assert said.count(f"engramd's tables of {engine} moved to the daemon's copy") == 1, said
        outs.append(out)
    return ready, outs
