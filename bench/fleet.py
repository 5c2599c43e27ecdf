"""Fills of a set from a peer over a veth, from an object store, and from cold files, each
beside its ceiling on this machine (bench section "fleet").

- peer: daemon A in namespace a holds the set; daemon B in namespace b fills
  it (NIXL over UCX's TCP, UCX_TLS=tcp). Ceiling: a raw Python socket over
  the same veth into reserved tmpfs pages (bench/rawsock.py).
- object store: s3rver on this host; the daemon fills through NIXL's OBJ
  backend. Ceiling: boto3 with 4 ranged GETs per file in parallel.
- cold local: the daemon's load after the page cache is dropped. Ceiling: a
  sequential read of the same files (8 MiB reads), equally cold.
Each rate is the daemon's own (status: bytes / load_seconds), every turn
takes each way once, so the machine's slow minutes touch both sides alike.

Beside them, what this machine's cores allow a peer fill at best: a fill
does the raw socket's work (both ends' CPU seconds, measured) and, in the
receiving daemon, copies each piece out of its transfer process's landing
ring and digests it (landing.py; measured alone here); with every core busy
all the time it could go no faster than cores x bytes / (those seconds).
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engramd.fleet.landing import MOVE_CHUNK
from engramd.strong import PIECE_BYTES, piece_hasher
from engramd.testing.daemon_process import DaemonProcess
from engramd_shared.checkpoint import plan_tables

# The fleet's network fixtures live with the tests (tests/support), as the engine benches'
# harnesses do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from fleet_lab import (
    UCX_TCP,
    Net,
    netns_missing,
    s3rver,
    s3rver_missing,
    veth_pair,
)

from .common import Figure, compare, drop_caches, drop_page_cache, sequential_read, shm_folder

TOKEN = "bench-fleet-token-0123456789"
PEER_PORT = 7077
RAW_PORT = 7078


class _Daemon(DaemonProcess):
    """A daemon with variables of its own, perhaps in a network namespace."""

    def __init__(self, sock_dir: Path, shm: Path, args: list[str], env: dict[str, str], netns: str):
        super().__init__(sock_dir / "d.sock", shm, args, sock_dir / "log")
        self._env = env
        self._prefix = Net.run_in(netns) if netns else []

    def command(self) -> list[str]:
        return [*self._prefix, *super().command()]

    def popen_options(self) -> dict[str, Any]:
        return {**super().popen_options(), "env": {**os.environ, **UCX_TCP, **self._env}}


@contextlib.contextmanager
def netns_daemon(
    args: list[str], env: dict[str, str] | None = None, netns: str = "", wait: str = "up"
) -> Iterator[Any]:
    """A daemon with `args` (in `netns`, with `env`) over a temporary shm folder; stopped and
    its folders removed afterwards."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ebf", dir="/tmp"))
    with shm_folder() as shm:
        d = _Daemon(sock_dir, shm, ["--no-huge-tmpfs", *args], env or {}, netns)
        try:
            yield d.start(wait=wait)
        finally:
            if d.proc is not None and d.proc.poll() is None:
                d.stop()
            shutil.rmtree(sock_dir, ignore_errors=True)


def _fill_rate(
    args: list[str], source: str, env: dict[str, str] | None = None, netns: str = ""
) -> float:
    """GB/s of one fill of the set by a fresh daemon, checked to come from `source`."""
    with netns_daemon(["--drop-on-exit", *args], env, netns) as d:
        deadline = time.monotonic() + 600
        while True:
            sets = d.status().sets
            if sets and sets[0].state == "ready":
                s = sets[0]
                break
            if sets and sets[0].state == "failed":
                raise RuntimeError(f"the fill failed: {sets[0].error}")
            if time.monotonic() > deadline:
                raise RuntimeError("the fill did not finish in 600 s")
            time.sleep(0.05)
        if not s.source.startswith(source):
            raise RuntimeError(f"the set came from {s.source}, not {source}:\n{d.log}")
        return s.bytes / s.load_seconds / 1e9


def _raw_socket(net: Net, nbytes: int) -> tuple[float, float]:
    """GB/s of a raw socket over the veth, and the CPU seconds both ends took."""
    sender = subprocess.Popen(
        [
            *Net.run_in(net.a),
            sys.executable,
            "-m",
            "bench.rawsock",
            "send",
            str(RAW_PORT),
            str(nbytes),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout is not None
        if sender.stdout.readline().strip() != "ready":
            raise RuntimeError("the raw socket sender did not start")
        out = subprocess.run(
            [
                *(*Net.run_in(net.b), sys.executable, "-m", "bench.rawsock", "recv"),
                *(net.ip_a, str(RAW_PORT), str(nbytes)),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        rate, received = (float(x) for x in out.stdout.split())
        sent = float(sender.stdout.readline())
        return rate, sent + received
    finally:
        sender.wait(timeout=60)


def _fill_work(nbytes: int) -> float:
    """CPU seconds a receiving daemon spends on `nbytes` beyond a socket's: each piece
    written out of a landing slot into a new tmpfs file and digested there, a MOVE_CHUNK at
    a time (landing.py's `_move`)."""
    slot = bytearray(os.urandom(PIECE_BYTES))
    fd = os.memfd_create("engramd-bench-fill", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as staged:
            view = memoryview(staged)
            start = time.process_time()
            for at in range(0, nbytes, PIECE_BYTES):
                n = min(PIECE_BYTES, nbytes - at)
                hasher = piece_hasher()
                for part in range(at, at + n, MOVE_CHUNK):
                    end = min(part + MOVE_CHUNK, at + n)
                    os.pwrite(fd, memoryview(slot)[part - at : end - at], part)
                    hasher.update(view[part:end])
                hasher.digest()
            spent = time.process_time() - start
            view.release()
            return spent
    finally:
        os.close(fd)


def _get_range(client: Any, bucket: str, key: str, view: memoryview, at: int, end: int) -> None:
    body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={at}-{end - 1}")["Body"]
    view[at:end] = body.read()


def _boto3(env: dict[str, str], bucket: str, keys: dict[str, int], parts: int = 4) -> float:
    """GB/s of boto3 reading every object, `parts` ranged GETs per object at once."""
    boto3: Any = importlib.import_module("boto3")
    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )
    start = time.perf_counter()
    for key, size in keys.items():
        view = memoryview(bytearray(size))
        step = -(-size // parts)
        threads = [
            threading.Thread(
                target=_get_range, args=(client, bucket, key, view, at, min(at + step, size))
            )
            for at in range(0, size, step)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return sum(keys.values()) / (time.perf_counter() - start) / 1e9


def fleet_fills(ckpt: Path, reps: int) -> list[Figure]:
    """Peer, object-store and cold local fills beside their ceilings."""
    missing = netns_missing() or s3rver_missing()
    if missing:
        print(f"  fleet: not measured ({missing})", flush=True)
        return []
    try:
        importlib.import_module("boto3")
    except ImportError as e:
        print(f"  fleet: not measured ({e}; `make bench` installs boto3)", flush=True)
        return []
    plan = plan_tables(ckpt)
    files = sorted(ckpt.glob("*.safetensors"))
    file_bytes = {f"ckpt/{f.name}": f.stat().st_size for f in files}
    rates: dict[str, list[float]] = {k: [] for k in ("peer", "raw", "s3", "boto3", "cold", "read")}
    bound: list[float] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        veth_pair(f"ebf{os.getpid() % 100000}") as net,
        s3rver() as s3,
    ):
        token = Path(tmp) / "token"
        token.write_text(TOKEN)
        token.chmod(0o400)
        s3.upload(ckpt, "ckpt")
        s3.attest(ckpt, "ckpt", token)
        env = s3.env()
        peer = [
            *("--checkpoint", str(ckpt), "--peer-token-file", str(token)),
            *("--peers", f"{net.ip_a}:{PEER_PORT}"),
        ]
        serve = [
            *("--checkpoint", str(ckpt), "--peer-token-file", str(token)),
            *("--peer-listen", f"{net.ip_a}:{PEER_PORT}"),
        ]
        with netns_daemon(serve, netns=net.a, wait="serving"):
            for turn in range(reps):
                rates["peer"].append(_fill_rate(peer, "peer", netns=net.b))
                raw, raw_cpu = _raw_socket(net, plan.nbytes)
                rates["raw"].append(raw)
                cores = os.cpu_count() or 1
                bound.append(
                    min(raw, cores * plan.nbytes / (raw_cpu + _fill_work(plan.nbytes)) / 1e9)
                )
                rates["s3"].append(
                    _fill_rate(
                        [
                            *("--checkpoint", str(ckpt), "--peer-token-file", str(token)),
                            *("--object-store", f"s3://{s3.bucket}/ckpt"),
                        ],
                        "s3://",
                        env,
                    )
                )
                rates["boto3"].append(_boto3(env, s3.bucket, file_bytes))
                drop_caches()
                rates["cold"].append(_fill_rate(["--checkpoint", str(ckpt)], "files"))
                for f in files:
                    drop_page_cache(f.parent)
                drop_caches()
                rates["read"].append(sequential_read(files, 8 << 20))
                print(
                    f"  turn {turn + 1}: "
                    + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items())
                    + " GB/s",
                    flush=True,
                )
    size = f"{plan.nbytes / 2**30:.2f} GiB"
    return [
        compare(
            f"fill from a peer over a veth ({size}, UCX TCP)",
            "GB/s",
            rates["peer"],
            rates["raw"],
            higher_is_better=True,
            target=">= 0.8x a raw socket",
            at_least=0.8,
            paired=True,
        ),
        compare(
            f"a peer fill's bound on this machine's {os.cpu_count()} cores ({size})",
            "GB/s",
            bound,
            rates["raw"],
            higher_is_better=True,
            note="every core busy with the raw socket's CPU seconds and a fill's copy and digest",
            paired=True,
        ),
        compare(
            f"fill from the object store ({size}, s3rver)",
            "GB/s",
            rates["s3"],
            rates["boto3"],
            higher_is_better=True,
            target=">= 1.5x boto3, 4 ranged GETs",
            at_least=1.5,
            paired=True,
        ),
        compare(
            f"cold local load ({size})",
            "GB/s",
            rates["cold"],
            rates["read"],
            higher_is_better=True,
            note="baseline: a cold sequential read of the same files",
            paired=True,
        ),
    ]
