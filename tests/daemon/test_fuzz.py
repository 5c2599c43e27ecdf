"""Property-based fuzzing: malformed RPCs, safetensors headers and raw socket garbage."""

from __future__ import annotations

import json
import shutil
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Daemon
from engramd.host.hugeroot import remove_shm_folder
from engramd_client import CheckpointError
from engramd_shared.headers import read_header
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

#: What a malformed request may be answered with: a proper refusal, never a
#: crash (UNKNOWN, INTERNAL), a hang (DEADLINE_EXCEEDED) or a dead daemon.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Daemon]:
    """One daemon for all the fuzzing, with a set and an allowed root."""
    folder = tmp_path_factory.mktemp("fz")
    sock = Path("/tmp") / f"edfz{folder.name[-6:]}"
    sock.mkdir(exist_ok=True)
    shm = Path("/dev/shm") / f"engramd-test-fz{folder.name[-6:]}"
    d = Daemon(
        sock / "d.sock",
        shm,
        ["--checkpoint", str(checkpoint), "--allow-root", str(checkpoint.parent)],
        folder / "log",
    )
    d.start()
    yield d
    d.stop()
    remove_shm_folder(shm)
    shutil.rmtree(sock, ignore_errors=True)


def _alive(d: Daemon) -> None:
    assert d.proc is not None and d.proc.poll() is None, d.log
    assert d.status().daemon.pid == d.pid


#: Past the daemon's 4096-character limits, cheaply: one character repeated
#: (70,000 random characters per field exceeded hypothesis's generation budget).
#: Characters UTF-8 can encode, as st.text's are: a protobuf string can hold no
#: lone surrogate, so a client could not send one.
long_text = st.builds(lambda c, n: c * n, st.characters(codec="utf-8"), st.integers(4097, 70_000))
text = st.one_of(
    st.text(max_size=64),
    long_text,
    st.sampled_from(["../../etc", "/", "*", "[", "**/..", "\x00", "0" * 20, "f" * 20]),
)


@FUZZ
@given(
    set_id=text,
    checkpoint=text,
    tensors=text,
    pid=st.integers(-(2**31), 2**31 - 1),
    labels=st.dictionaries(
        st.one_of(st.text(max_size=80), long_text),
        st.one_of(st.text(max_size=80), long_text),
        max_size=40,
    ),
    accept=st.lists(st.integers(0, 2**31 - 1), max_size=5),
    reattach=st.booleans(),
)
def test_attach_with_anything(
    live: Daemon,
    set_id: str,
    checkpoint: str,
    tensors: str,
    pid: int,
    labels: dict[str, str],
    accept: list[int],
    reattach: bool,
) -> None:
    request = pb.AttachRequest(
        set_id=set_id,
        checkpoint=checkpoint,
        tensors=tensors,
        pid=pid,
        labels=labels,
        accept=cast(Any, accept),
        reattach=reattach,
    )
    with live.channel() as ch:
        call = pb_grpc.TableServiceStub(ch).Attach(request, timeout=20)
        try:
            event = next(iter(call))
            assert event.WhichOneof("event") in ("attached", "progress")
        except grpc.RpcError as e:
            assert e.code() in REFUSALS, (e.code(), e.details())
        finally:
            call.cancel()


@FUZZ
@given(raw=st.binary(max_size=2048), method=st.sampled_from(["Attach", "Status", "ReportFallback"]))
def test_undecodable_bytes(live: Daemon, raw: bytes, method: str) -> None:
    with live.channel() as ch:
        path = f"/engramd.v1.TableService/{method}"
        if method == "Attach":
            call: Any = ch.unary_stream(path)(raw, timeout=20)
            try:
                for _ in call:
                    break
            except grpc.RpcError as e:
                assert e.code() in REFUSALS, (e.code(), e.details())
            call.cancel()
        else:
            try:
                ch.unary_unary(path)(raw, timeout=20)
            except grpc.RpcError as e:
                assert e.code() in REFUSALS, (e.code(), e.details())


def test_daemon_survived_the_rpc_fuzzing(live: Daemon) -> None:
    _alive(live)


@FUZZ
@given(
    chunks=st.lists(
        st.one_of(
            st.binary(max_size=4096),
            st.just(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
            st.just(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            st.just(
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x04\x00\x00\x00\x00\x00" * 50
            ),
        ),
        max_size=4,
    )
)
def test_raw_garbage_on_the_socket(live: Daemon, chunks: list[bytes]) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(str(live.socket))
        for chunk in chunks:
            try:
                s.sendall(chunk)
            except OSError:
                break
    _alive(live)


@FUZZ
@given(
    request=st.one_of(
        st.binary(max_size=2048),
        st.builds(
            lambda lease, secret: pb.FdRequest(lease_id=lease, secret=secret).SerializeToString(),
            st.text(max_size=40),
            st.text(max_size=80),
        ),
    ),
    read_reply=st.booleans(),
)
def test_anything_on_the_fd_channel_is_refused(
    live: Daemon, request: bytes, read_reply: bool
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(str(live.socket.with_name("fds.sock")))
        s.send(request)
        if read_reply:
            data, fds, _, _ = socket.recv_fds(s, 65536, 8)
            assert fds == []  # no lease, no descriptor
            assert pb.FdReply.FromString(data).error
    _alive(live)


# -- safetensors headers -------------------------------------------------------


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    _nested,
    max_leaves=12,
)
entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F8_E4M3", "BF16", "F32", "I64", "F4", "XX", "", "U8"]),
        "shape": st.lists(st.integers(-4, 2**62), max_size=4),
        "data_offsets": st.lists(st.integers(-8, 2**63), min_size=0, max_size=3),
    }
)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    header=st.one_of(
        st.dictionaries(st.text(max_size=16), entry, max_size=4),
        st.dictionaries(st.text(max_size=16), json_value, max_size=4),
        json_value,
    ),
    data=st.binary(max_size=256),
    length_delta=st.integers(-16, 2**40),
    raw_header=st.booleans(),
)
def test_fuzzed_headers_raise_checkpoint_errors(
    tmp_path: Path, header: Any, data: bytes, length_delta: int, raw_header: bool
) -> None:
    body = json.dumps(header).encode()
    length = len(body) if not raw_header else max(0, len(body) + length_delta)
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(struct.pack("<Q", length % 2**64) + body + data)
    try:
        parsed = read_header(path)
    except CheckpointError as e:
        assert str(path) in str(e)
        return
    # Accepted only when every tensor lies inside the file, exactly sized.
    for t in parsed.tensors.values():
        assert t.offset >= 0 and t.offset + t.nbytes <= parsed.size
