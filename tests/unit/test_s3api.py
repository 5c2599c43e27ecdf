"""Signature Version 4 as AWS documents it, the store's address from the AWS variables, and
planning against an endpoint that answers as no S3 does (a real HTTP server on loopback)."""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from engramd.fleet.objectplan import plan_objects
from engramd.fleet.s3api import ObjectReader, StoreAccess, StoreError, sign
from engramd.sets.seams import StoreUnreadable
from engramd_shared.checkpoint import TablePlan

#: The example keys of AWS's Signature Version 4 documentation (Amazon S3, "Examples of
#: signature calculations"), whose requests' signatures it gives.
EXAMPLE = StoreAccess(
    "examplebucket",
    "",
    region="us-east-1",
    access_key="AKIAIOSFODNN7EXAMPLE",
    secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
)
WHEN = datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC)
HOST = "examplebucket.s3.amazonaws.com"


@pytest.mark.parametrize(
    ("path", "query", "extra", "signed", "signature"),
    [
        (
            "/test.txt",
            {},
            {"Range": "bytes=0-9"},
            "host;range;x-amz-content-sha256;x-amz-date",
            "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
        ),
        (
            "/",
            {"max-keys": "2", "prefix": "J"},
            {},
            "host;x-amz-content-sha256;x-amz-date",
            "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7",
        ),
    ],
)
def test_requests_are_signed_as_aws_documents(
    path: str, query: dict[str, str], extra: dict[str, str], signed: str, signature: str
) -> None:
    """A ranged GET of an object and a listing, signed: AWS's published signatures."""
    headers = sign("GET", HOST, path, query, extra, EXAMPLE, WHEN)
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    assert headers["x-amz-date"] == "20130524T000000Z"


def test_without_keys_nothing_is_signed() -> None:
    """A public bucket: the request carries no signature (and no date to sign)."""
    headers = sign("GET", HOST, "/x", {}, {}, StoreAccess("examplebucket", ""), WHEN)
    assert headers == {"host": HOST}


def test_the_store_is_read_from_the_aws_variables() -> None:
    """Endpoint (S3's own first), region and keys as the AWS tools take them; path-style
    addresses behind an endpoint; a URL that is no s3://bucket/prefix names the flag."""
    access = StoreAccess.of(
        "s3://tables/models/engram/",
        {
            "AWS_ENDPOINT_URL": "http://other:1",
            "AWS_ENDPOINT_URL_S3": "http://minio:9000",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_ACCESS_KEY_ID": "id",
            "AWS_SECRET_ACCESS_KEY": "secret",
        },
        "--checkpoint",
    )
    assert (access.url, access.key("a.safetensors")) == (
        "s3://tables/models/engram",
        "models/engram/a.safetensors",
    )
    assert access.nixl_params(4) == {
        "bucket": "tables",
        "num_threads": "4",
        "region": "eu-west-1",
        "endpoint_override": "http://minio:9000",
        "scheme": "http",
        "use_virtual_addressing": "false",
        "access_key": "id",
        "secret_key": "secret",
    }
    with pytest.raises(ValueError, match="--checkpoint 'gs://b/p' is not s3://bucket/prefix"):
        StoreAccess.of("gs://b/p", {}, "--checkpoint")
    # No region configured: the OBJ backend's SDK picks its own (a profile's, the instance's).
    assert "region" not in StoreAccess.of("s3://b/p", {}, "--checkpoint").nixl_params(1)


# -- an endpoint that answers as no S3 does ------------------------------------------------

#: One small safetensors file: a 4-float table.
_HEADER = json.dumps(
    {"layers.1.engram.embed.weight": {"dtype": "F32", "shape": [1, 4], "data_offsets": [0, 16]}}
).encode()
_OBJECT = struct.pack("<Q", len(_HEADER)) + _HEADER + bytes(16)
#: What the flooding endpoint sends beyond every range (made once: not counted as the
#: planning's memory).
_FLOOD = bytes(8 << 20)


class _Hostile(BaseHTTPRequestHandler):
    """Answers GETs of bucket `mode` as that mode misbehaves (a well-behaved store: "good")."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        mode, _, rest = self.path.lstrip("/").partition("/")
        if rest.startswith("?") or not rest:
            # The listing: one object, and with "pages" the same next page forever.
            more = "true" if mode == "pages" else "false"
            self._send(
                200,
                {},
                f"<ListBucketResult><IsTruncated>{more}</IsTruncated><NextContinuationToken>t"
                "</NextContinuationToken><Contents><Key>p/a.safetensors</Key></Contents>"
                "</ListBucketResult>".encode(),
            )
            return
        if not rest.endswith(".safetensors"):
            self._send(404, {}, b"<Error><Code>NoSuchKey</Code></Error>")
            return
        found = re.match(r"bytes=(\d+)-(\d+)", self.headers.get("range", ""))
        assert found is not None
        at, end = int(found.group(1)), int(found.group(2))
        size = len(_OBJECT)
        if mode == "whole":  # ignores the range
            self._send(200, {}, _OBJECT)
        elif mode == "digits":  # a size of 5,000 digits
            self._send(206, {"Content-Range": f"bytes {at}-{end}/{'9' * 5000}"}, _OBJECT)
        elif mode == "shifted":  # another range than the one asked
            self._send(206, {"Content-Range": f"bytes {at + 1}-{end + 1}/{size}"}, _OBJECT)
        elif mode == "flood":  # claims 64 MiB, and sends 8 MiB more than any range asked
            headers = {"Content-Range": f"bytes {at}-{end}/{64 << 20}"}
            self._send(206, headers, _OBJECT[at : end + 1], _FLOOD)
        elif mode == "head":  # the status line, then a header's byte now and then, for ever
            with contextlib.suppress(OSError):
                self.wfile.write(b"HTTP/1.1 206 Partial Content\r\nX-Slow: ")
                for _ in range(600):
                    self.wfile.write(b"a")
                    self.wfile.flush()
                    time.sleep(0.1)
        elif mode == "trickle":  # a byte now and then, for ever
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {at}-{end}/{size}")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(600):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.1)
        else:
            self._send(206, {"Content-Range": f"bytes {at}-{end}/{size}"}, _OBJECT[at : end + 1])

    def _send(self, status: int, headers: dict[str, str], *body: bytes) -> None:
        self.send_response(status)
        length = str(sum(len(part) for part in body))
        for key, value in {**headers, "Content-Length": length}.items():
            self.send_header(key, value)
        self.end_headers()
        with contextlib.suppress(OSError):
            for part in body:
                self.wfile.write(part)


@pytest.fixture(scope="module")
def hostile() -> Iterator[str]:
    """The hostile endpoint's URL, on loopback."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _plan(endpoint: str, mode: str) -> TablePlan:
    return plan_objects(f"s3://{mode}/p", "auto", {"AWS_ENDPOINT_URL": endpoint})


def test_a_store_that_answers_as_a_store_is_planned(hostile: str) -> None:
    """The same endpoint, behaving: the one object listed, planned (what the others break)."""
    plan = _plan(hostile, "good")
    assert [t.name for t in plan.tensors] == ["layers.1.engram.embed.weight"]
    assert plan.objects == {"a.safetensors": len(_OBJECT)}


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("whole", "ignored the Range header"),
        ("digits", "is another range"),
        ("shifted", "is another range"),
        ("pages", "the listing repeats a page"),
    ],
)
def test_replies_no_store_gives_are_refused_by_name(hostile: str, mode: str, said: str) -> None:
    """A reply of the whole object, a size of 5,000 digits, another range than asked, a
    listing that never ends: each a StoreUnreadable naming the object and the fault."""
    with pytest.raises(StoreUnreadable, match=said):
        _plan(hostile, mode)


def test_a_reply_longer_than_asked_is_read_no_further(hostile: str) -> None:
    """8 MiB more than asked sent for every read of a few KiB: each reply is read up to what
    was asked (the planning never holds one of those 8 MiB), and the object (claimed 64 MiB)
    is planned from those bytes."""
    tracemalloc.start()
    try:
        plan = _plan(hostile, "flood")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.objects == {"a.safetensors": 64 << 20}
    assert peak < 4 << 20, peak


def test_a_reply_that_trickles_in_is_cut_at_the_deadline(hostile: str) -> None:
    """A byte every 100 ms: the request ends at its deadline, not when the endpoint stops."""
    access = StoreAccess.of("s3://trickle/p", {"AWS_ENDPOINT_URL": hostile}, "--checkpoint")
    with pytest.raises(StoreError, match="no whole reply within 1 s"):
        ObjectReader(access, timeout=1.0).read("a.safetensors", 0, 4096)


@pytest.mark.parametrize("limit", ["request", "planning"])
def test_a_head_that_trickles_in_is_cut_at_the_deadline(hostile: str, limit: str) -> None:
    """The status line, then a header's byte every 100 ms (http.client reads the head bounded
    only by the socket's timeout, which each byte restarts): the request ends at its own
    deadline, or at the planning's where that comes first."""
    access = StoreAccess.of("s3://head/p", {"AWS_ENDPOINT_URL": hostile}, "--checkpoint")
    reader = (
        ObjectReader(access, timeout=1.0)
        if limit == "request"
        else ObjectReader(access, deadline=time.monotonic() + 1.0)
    )
    started = time.monotonic()
    with pytest.raises(StoreError, match="no whole reply within 1 s"):
        reader.read("a.safetensors", 0, 4096)
    assert time.monotonic() - started < 10
    if limit == "planning":
        with pytest.raises(StoreError, match="the planning's time is up"):
            reader.read("a.safetensors", 0, 4096)
