"""Broken checkpoints get a clear INVALID_ARGUMENT; the daemon keeps serving other sets."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import Worker
from engramd_client import CheckpointError, attach
from engramd_shared.headers import SafetensorsFile, TensorEntry, _HeaderCache, read_header
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import attach_error, reason

SHARD = "model-00001-of-00002.safetensors"


def _raw_file(path: Path, header: bytes | dict[str, Any], data: bytes = b"") -> None:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def truncate(folder: Path) -> None:
    shard = folder / SHARD
    os.truncate(shard, shard.stat().st_size - 1000)


def malformed_header(folder: Path) -> None:
    _raw_file(folder / SHARD, b'{"layers.1.engram.embed.weight": {"dtype": "F8_E4M3", "sha')


def offsets_outside(folder: Path) -> None:
    _raw_file(
        folder / SHARD,
        {
            "layers.1.engram.embed.weight": {
                "dtype": "F8_E4M3",
                "shape": [4, 256],
                "data_offsets": [4096, 5120],
            }
        },
        b"\0" * 1024,
    )


def reversed_offsets(folder: Path) -> None:
    _raw_file(
        folder / SHARD,
        {
            "layers.1.engram.embed.weight": {
                "dtype": "F8_E4M3",
                "shape": [0],
                "data_offsets": [8, 0],
            }
        },
        b"\0" * 8,
    )


def unknown_dtype(folder: Path) -> None:
    _raw_file(
        folder / SHARD,
        {
            "layers.1.engram.embed.weight": {
                "dtype": "F4_E2M1X",
                "shape": [4],
                "data_offsets": [0, 4],
            }
        },
        b"\0" * 4,
    )


def missing_tensor(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.5.engram.embed.weight"] = SHARD
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def header_past_file(folder: Path) -> None:
    (folder / SHARD).write_bytes(struct.pack("<Q", 1 << 40) + b"{}")


def _entry_header(shape: bytes, offsets: bytes = b"[0, 1024]") -> bytes:
    return (
        b'{"layers.1.engram.embed.weight": {"dtype": "F8_E4M3", "shape": '
        + shape
        + b', "data_offsets": '
        + offsets
        + b"}}"
    )


def huge_integer(folder: Path) -> None:
    # Python refuses to convert integers of more than 4300 digits with ValueError.
    _raw_file(folder / SHARD, _entry_header(b"[" + b"9" * 5000 + b"]"), b"\0" * 1024)


def deep_nesting(folder: Path) -> None:
    _raw_file(folder / SHARD, _entry_header(b"[" * 100_000 + b"]" * 100_000), b"\0" * 1024)


def not_utf8(folder: Path) -> None:
    _raw_file(folder / SHARD, _entry_header(b"[4, 256]").replace(b"layers", b"l\xffyers"))


def overlapping(folder: Path) -> None:
    _raw_file(
        folder / SHARD,
        {
            "layers.1.engram.embed.weight": {
                "dtype": "F8_E4M3",
                "shape": [4, 256],
                "data_offsets": [0, 1024],
            },
            "layers.1.engram.embed.scale": {
                "dtype": "F8_E4M3",
                "shape": [4, 256],
                "data_offsets": [512, 1536],
            },
        },
        b"\0" * 1536,
    )


def duplicate_name(folder: Path) -> None:
    entry = b'{"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}'
    name = b'"layers.1.engram.embed.weight"'
    _raw_file(folder / SHARD, b"{" + name + b": " + entry + b", " + name + b": " + entry + b"}")


Breakage = Callable[[Path], None]

#: Each breakage and the words its error must contain.
BREAKAGES: list[tuple[Breakage, str]] = [
    (truncate, "truncated"),
    (malformed_header, "malformed safetensors header"),
    (offsets_outside, "lies past the file"),
    (reversed_offsets, "reversed"),
    (unknown_dtype, "unknown dtype"),
    (missing_tensor, "missing from that file"),
    (header_past_file, "runs past the file"),
    (huge_integer, "an integer of 5000 digits"),
    (deep_nesting, "nested too deeply"),
    (not_utf8, "not UTF-8"),
    (overlapping, "overlap"),
    (duplicate_name, "appears twice"),
]


@pytest.fixture
def broken(checkpoint: Path, tmp_path: Path) -> Callable[[Breakage], Path]:
    def make(breakage: Breakage) -> Path:
        folder = tmp_path / breakage.__name__
        shutil.copytree(checkpoint, folder)
        breakage(folder)
        return folder

    return make


@pytest.mark.parametrize(("breakage", "words"), BREAKAGES, ids=[b.__name__ for b, _ in BREAKAGES])
def test_worker_gets_a_clear_error(breakage: Breakage, words: str, broken: Any) -> None:
    folder = broken(breakage)
    with pytest.raises(CheckpointError) as info:
        attach(folder, share=False)
    assert words in str(info.value)
    assert SHARD in str(info.value) or "index" in str(info.value)


def test_daemon_answers_invalid_argument_and_keeps_serving(
    checkpoint: Path,
    broken: Any,
    daemons: Any,
    workers: list[Worker],
    open_dirs: tuple[Path, Path, Path],
) -> None:
    top = open_dirs[0]
    d = daemons("--checkpoint", str(checkpoint), "--allow-root", str(top))
    for breakage, words in BREAKAGES:
        # Files every member of the socket group may read: the error names the problem.
        folder = top / breakage.__name__
        shutil.copytree(broken(breakage), folder)
        for p in (folder, *folder.iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
        err = attach_error(d, pb.AttachRequest(set_id="0" * 20, checkpoint=str(folder)))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, breakage
        assert reason(err) == "checkpoint"
        assert words in str(err.details())
        assert str(folder) in str(err.details())
        # Files some member may not read: the worker socket cannot tell who asks, so the
        # problem (a size, a header's length, bytes) is named in the daemon's log only.
        folder.chmod(0o700)
        err = attach_error(d, pb.AttachRequest(set_id="0" * 20, checkpoint=str(folder)))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, breakage
        told = str(err.details()).replace(str(folder), "<folder>")
        assert words not in told and "daemon's log alone" in told
        assert words in d.log
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared"
    assert [s.state for s in d.status().sets] == ["ready"]


def test_bad_configured_checkpoint_does_not_stop_the_daemon(
    checkpoint: Path, broken: Any, daemons: Any, workers: list[Worker]
) -> None:
    bad = [broken(b) for b in (malformed_header, huge_integer, deep_nesting, not_utf8, overlapping)]
    args = [a for folder in bad for a in ("--checkpoint", str(folder))]
    d = daemons(*args, "--checkpoint", str(checkpoint), wait="up")
    status = d.status()
    assert not status.daemon.ready
    for folder in bad:
        assert f"cannot load configured checkpoint {folder}" in d.log
    assert "Traceback" not in d.log
    # The good checkpoint among them is served.
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared"
    assert [str(s.checkpoint) for s in d.status().sets] == [str(checkpoint)]


def test_engramd_load_of_a_bad_checkpoint_is_invalid_argument(
    checkpoint: Path, broken: Any, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    admin = f"unix:{d.socket.with_name('admin.sock')}"
    with grpc.insecure_channel(admin) as channel:
        stub = pb_grpc.AdminServiceStub(channel)
        for breakage in (huge_integer, deep_nesting, not_utf8, overlapping):
            folder = broken(breakage)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Load(pb.LoadRequest(checkpoint=str(folder)), timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, breakage
            assert str(folder) in str(info.value.details())
    assert "Traceback" not in d.log
    assert [s.state for s in d.status().sets] == ["ready"]


def test_headers_are_parsed_once_per_file_identity(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    shard = copy / "model-00002-of-00002.safetensors"
    first, again = read_header(shard), read_header(shard)
    assert again.tensors is first.tensors
    # Another identity (a new mtime): parsed again, and the same tensors found.
    os.utime(shard, ns=(0, 0))
    changed = read_header(shard)
    assert changed.tensors is not first.tensors and changed.tensors == first.tensors


def test_header_cache_stays_within_its_bound(checkpoint: Path) -> None:
    headers = [read_header(p) for p in sorted(checkpoint.glob("*.safetensors"))]
    parses: list[Path] = []

    def fill(cache: _HeaderCache) -> None:
        for _ in range(2):
            for h in headers:

                def parse(h: SafetensorsFile = h) -> dict[str, TensorEntry]:
                    parses.append(h.path)
                    return h.tensors

                cache.parsed(h.source, h.header, parse)

    # Room for the largest header only: each shard pushes the other out, and is parsed again.
    fill(_HeaderCache(limit=max(len(h.header) for h in headers)))
    assert len(parses) == 2 * len(headers)
    fill(_HeaderCache(limit=sum(len(h.header) for h in headers)))
    assert len(parses) == 3 * len(headers)


def test_requests_the_daemon_must_refuse(checkpoint: Path, daemons: Any, tmp_path: Path) -> None:
    d = daemons("--allow-root", str(tmp_path / "elsewhere"))
    cases = [
        (pb.AttachRequest(set_id="not-an-id"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.AttachRequest(set_id="0" * 20), grpc.StatusCode.NOT_FOUND),
        (
            pb.AttachRequest(set_id="0" * 20, checkpoint=str(checkpoint)),
            grpc.StatusCode.PERMISSION_DENIED,
        ),
        (
            pb.AttachRequest(set_id="0" * 20, checkpoint=str(tmp_path / "elsewhere/../../x")),
            grpc.StatusCode.PERMISSION_DENIED,
        ),
        (
            pb.AttachRequest(set_id="0" * 20, accept=[pb.HANDLE_KIND_UNSPECIFIED]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.AttachRequest(set_id="0" * 20, labels={f"k{i}": "v" for i in range(100)}),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]
    for request, code in cases:
        err = attach_error(d, request)
        assert err is not None and err.code() == code, (request, err)
    assert d.status().daemon.ready


def test_fingerprint_mismatch_is_failed_precondition(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--allow-root", str(checkpoint.parent))
    err = attach_error(d, pb.AttachRequest(set_id="0" * 20, checkpoint=str(checkpoint)))
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(err) == "fingerprint"
    assert "differ" in str(err.details())
