"""An object store's address and keys, and the few small reads that plan a checkpoint there.

The bulk of a set moves through NIXL's OBJ backend (objstore.py). Planning a
checkpoint that has no files on the node (`--checkpoint s3://bucket/prefix`)
takes a few hundred KiB of it: its index, config.json, each file's size
and header and the data samples of the fingerprint. NIXL cannot tell an
object's size (a read past the end only fails), so these are plain HTTP
GETs signed with AWS Signature Version 4: a ranged GET's Content-Range
gives the object's size with its first bytes.

Every request ends within REQUEST_TIMEOUT_S, its status line and headers
included (http.client reads those bounded only by the socket's timeout,
which each byte received restarts: a timer shuts the socket at the
deadline, whatever is being read), and within the deadline of the planning
it serves (objectplan.PLANNING_TIMEOUT_S).

Endpoint and keys come from the variables the AWS tools read:
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (path-style addresses there),
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION / AWS_DEFAULT_REGION.
Static keys only: without them the requests go unsigned (a public bucket);
session tokens, profiles and instance roles are not read.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import http.client
import re
import socket
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, urlparse

#: The default region where none is configured (the AWS tools' too).
DEFAULT_REGION = "us-east-1"
#: Seconds one request may take, from its connection to its body's last byte.
REQUEST_TIMEOUT_S = 30.0
#: The longest page of a listing read (S3 lists at most 1,000 keys a page: about 300 KB).
LISTING_BYTES = 4 << 20
#: Pages of a listing read at most: a checkpoint's prefix holds a few hundred objects.
LISTING_PAGES = 100
#: The hash of an empty payload, which every GET signs.
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: A ranged reply's range and the object's size: "bytes START-END/SIZE" (at most 2^64).
_CONTENT_RANGE = re.compile(r"^bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})$")
#: A refused range's reply: "bytes */SIZE".
_UNSATISFIED = re.compile(r"^bytes \*/([0-9]{1,20})$")


#: What a planning is charged per byte of a body it reads: the bytes, and their text decoded
#: (up to 4 bytes a character where one character needs them).
COPIES = 5
#: What it is charged per JSON or XML value of a body it parses (a delimiter counted: `{`,
#: `[`, `,`, `<`): json.loads' object (a dict and the pairs hook's list, at most about 120
#: bytes), or the parsed entry it becomes (about 410 bytes a tensor, which has at least 8
#: values): measured by bench/proof.py.
VALUE_BYTES = 160


def values_in(text: bytes) -> int:
    """How many JSON or XML values `text` may parse into, at most: one more than its
    delimiters (a value after the first in a container follows a comma; each object, array
    or element opens with a bracket of its own)."""
    return 1 + sum(text.count(c) for c in (b"{", b"[", b",", b"<"))


def parse_cost(text: bytes) -> int:
    """What parsing `text` may take beyond the COPIES of its bytes."""
    return VALUE_BYTES * values_in(text)


class Charges(Protocol):
    """A planning's memory charges (sets/objectplan.PlanningCharges)."""

    def charge(self, n: int) -> None:
        """Charge `n` bytes before they are held; raises when they may not be."""

    def give(self, n: int) -> None:
        """Give back `n` bytes held no more."""


class StoreError(Exception):
    """A request to the object store failed; the message names the object and the reply."""


@dataclass(frozen=True)
class StoreAccess:
    """Where an s3://bucket/prefix is and the keys it is read with."""

    bucket: str
    #: The prefix, without slashes at either end ("" for the bucket's top).
    prefix: str
    #: AWS_ENDPOINT_URL(_S3): an S3-compatible server, addressed path-style ("": AWS's).
    endpoint: str = ""
    #: AWS_REGION / AWS_DEFAULT_REGION ("": the SDK's own choice; requests are signed for
    #: DEFAULT_REGION).
    region: str = ""
    access_key: str = ""
    secret_key: str = ""

    @classmethod
    def of(cls, url: str, env: Mapping[str, str], flag: str) -> StoreAccess:
        """The store `url` names, with the AWS variables of `env`; ValueError naming `flag`
        when `url` is not s3://bucket/prefix."""
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(
                f"{flag} {url!r} is not s3://bucket/prefix; name the bucket and the "
                "prefix that holds the checkpoint's files"
            )
        return cls(
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            endpoint=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or "",
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "",
            access_key=env.get("AWS_ACCESS_KEY_ID", ""),
            secret_key=env.get("AWS_SECRET_ACCESS_KEY", ""),
        )

    @property
    def url(self) -> str:
        """s3://bucket/prefix, as status names it."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, name: str) -> str:
        """The object key of a checkpoint file named `name`."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def nixl_params(self, threads: int) -> dict[str, str]:
        """The NIXL OBJ backend's parameters for this store, reading on `threads` threads."""
        params = {"bucket": self.bucket, "num_threads": str(threads)}
        if self.region:
            params["region"] = self.region
        if self.endpoint:
            params["endpoint_override"] = self.endpoint
            params["scheme"] = urlparse(self.endpoint).scheme or "https"
            # S3-compatible servers behind an endpoint take path-style addresses.
            params["use_virtual_addressing"] = "false"
        if self.access_key:
            params["access_key"] = self.access_key
            params["secret_key"] = self.secret_key
        return params


class ObjectReader:
    """Signed GETs of one store's objects: ranges with the object's size, small whole
    objects, the names under the prefix."""

    def __init__(
        self, access: StoreAccess, timeout: float = REQUEST_TIMEOUT_S, deadline: float = 0.0
    ) -> None:
        """Requests of `access`'s store, each ended at `timeout` seconds, and none past
        `deadline` (time.monotonic(); 0: none), the end of the work they serve."""
        self._access = access
        self._timeout = timeout
        self._deadline = deadline
        if access.endpoint:
            parsed = urlparse(access.endpoint)
            self._scheme = parsed.scheme or "https"
            self._host = parsed.netloc
            self._base = f"{parsed.path.rstrip('/')}/{access.bucket}"
        else:
            self._scheme = "https"
            self._host = f"{access.bucket}.s3.{access.region or DEFAULT_REGION}.amazonaws.com"
            self._base = ""

    def read(self, name: str, at: int, n: int) -> tuple[bytes, int]:
        """Bytes `at`..`at + n` of the object of file `name` (fewer where it ends first) and
        the object's size."""
        status, headers, body = self._get(
            self._access.key(name), {}, {"range": f"bytes={at}-{at + n - 1}"}, n
        )
        where = f"{self._access.url}/{name}"
        if status == 416:  # the range starts at or past the end: "bytes */SIZE"
            found = _UNSATISFIED.match(headers.get("content-range", ""))
            if found is None:
                raise StoreError(f"{where}: HTTP 416 without the object's size")
            return b"", int(found.group(1))
        if status == 200:
            raise StoreError(
                f"{where}: the server ignored the Range header and sent the whole object; "
                "engramd plans a checkpoint by reading a few KiB of each object"
            )
        if status != 206:
            raise self._failed(name, status, body)
        found = _CONTENT_RANGE.match(headers.get("content-range", ""))
        if found is None or int(found.group(1)) != at or len(body) > n:
            raise StoreError(
                f"{where}: the reply to a read of bytes {at}-{at + n - 1} is another range "
                f"({headers.get('content-range', 'no Content-Range')[:80]})"
            )
        return body, int(found.group(3))

    def get(self, name: str, limit: int) -> bytes | None:
        """The whole object of file `name`, of at most `limit` bytes; None when there is none
        (S3 answers 403 for a missing key to whom may not list the bucket)."""
        status, _, body = self._get(self._access.key(name), {}, {}, limit + 1)
        if status in (403, 404):
            return None
        if status != 200:
            raise self._failed(name, status, body)
        if len(body) > limit:
            raise StoreError(f"{self._access.url}/{name}: larger than {limit} bytes")
        return body

    def names(self, suffix: str, held: Charges) -> list[str]:
        """The names (below the prefix, no further slash) of the objects ending in `suffix`;
        each page charged to `held` while it is read and parsed, the names kept after."""
        below = f"{self._access.prefix}/" if self._access.prefix else ""
        found: list[str] = []
        token = ""
        asked: set[str] = set()
        for _ in range(LISTING_PAGES):
            query = {"list-type": "2", "prefix": below, "delimiter": "/"}
            if token:
                query["continuation-token"] = token
            held.charge(COPIES * LISTING_BYTES)
            status, _, body = self._get("", query, {}, LISTING_BYTES)
            page = COPIES * LISTING_BYTES + parse_cost(body)
            held.charge(page - COPIES * LISTING_BYTES)
            if status != 200:
                raise self._failed(f"(the listing of {below or 'the bucket'})", status, body)
            try:
                doc = ET.fromstring(body)
            except ET.ParseError as e:
                raise StoreError(f"{self._access.url}: the listing does not parse ({e})") from None
            del body
            # By local name: S3-compatible servers differ in the namespace they put.
            texts: dict[str, list[str]] = {}
            for element in doc.iter():
                texts.setdefault(element.tag.rpartition("}")[2], []).append(element.text or "")
            kept = 0
            for key in texts.get("Key", []):
                name = key[len(below) :]
                if key.startswith(below) and name.endswith(suffix) and "/" not in name:
                    found.append(name)
                    kept += VALUE_BYTES + COPIES * len(name)
            del doc
            held.charge(kept)
            held.give(page)
            token = (texts.get("NextContinuationToken") or [""])[0]
            if texts.get("IsTruncated") != ["true"] or not token:
                return sorted(found)
            if token in asked:
                raise StoreError(f"{self._access.url}: the listing repeats a page")
            asked.add(token)
        raise StoreError(
            f"{self._access.url}: more than {LISTING_PAGES} pages of objects under the prefix; "
            "name the prefix that holds the checkpoint's files"
        )

    def _failed(self, name: str, status: int, body: bytes) -> StoreError:
        code = re.search(rb"<Code>([^<]{1,64})</Code>", body)
        said = (
            code.group(1).decode(errors="replace") if code else body[:120].decode(errors="replace")
        )
        return StoreError(f"{self._access.url}/{name}: HTTP {status} ({said})")

    def _get(
        self, key: str, query: dict[str, str], extra: dict[str, str], limit: int
    ) -> tuple[int, dict[str, str], bytes]:
        """A signed GET: its status, headers and at most `limit` bytes of its body."""
        path = f"{self._base}/{key}"
        headers = sign(
            "GET",
            self._host,
            path,
            query,
            extra,
            self._access,
            datetime.datetime.now(datetime.UTC),
        )
        target = quote(path, safe="/~") + (f"?{canonical_query(query)}" if query else "")
        kind = (
            http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        )
        now = time.monotonic()
        ends = now + self._timeout
        if self._deadline:
            if now >= self._deadline:
                raise StoreError(f"{self._access.url}/{key}: the planning's time is up")
            ends = min(ends, self._deadline)
        late = StoreError(
            f"{self._access.url}/{key}: no whole reply within {ends - now:.0f} s (status line, "
            "headers and body)"
        )
        connection = kind(self._host, timeout=ends - now)
        cutoff = _Cutoff(connection, ends - now)
        try:
            connection.connect()
            if cutoff.fired:
                raise late
            connection.request("GET", target, headers=headers)
            reply = connection.getresponse()
            parts, got = [], 0
            while got < limit:
                part = reply.read1(min(limit - got, 1 << 20))
                if not part:
                    break
                parts.append(part)
                got += len(part)
            if cutoff.fired or time.monotonic() > ends:
                raise late
            return reply.status, {k.lower(): v for k, v in reply.getheaders()}, b"".join(parts)
        except (OSError, http.client.HTTPException, ValueError) as e:
            if cutoff.fired:
                raise late from None
            raise StoreError(f"{self._access.url}/{key}: {e}") from None
        finally:
            cutoff.cancel()
            connection.close()


class _Cutoff:
    """Shuts a connection's socket once `seconds` pass: whatever http.client is reading then
    (a connection's handshake, the status line, a header, the body) ends at once."""

    def __init__(self, connection: http.client.HTTPConnection, seconds: float) -> None:
        self._connection = connection
        #: The deadline passed: the socket was shut (a read's error is the deadline's).
        self.fired = False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        self.fired = True
        sock = self._connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                # The plain socket's own shutdown: an SSL socket's would drop its TLS state
                # under the thread reading it.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def cancel(self) -> None:
        """The request ended: no cut."""
        self._timer.cancel()


def canonical_query(query: Mapping[str, str]) -> str:
    """A query string as Signature Version 4 signs it (sorted, every reserved byte encoded)."""
    return "&".join(f"{quote(k, safe='~')}={quote(v, safe='~')}" for k, v in sorted(query.items()))


def sign(
    method: str,
    host: str,
    path: str,
    query: Mapping[str, str],
    extra: Mapping[str, str],
    access: StoreAccess,
    now: datetime.datetime,
) -> dict[str, str]:
    """The headers of a request signed with AWS Signature Version 4 (none but `extra` and the
    host when the store has no keys)."""
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    headers = {"host": host, **{k.lower(): v for k, v in extra.items()}}
    if not access.access_key:
        return headers
    headers |= {"x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": stamp}
    names = sorted(headers)
    signed = ";".join(names)
    request = "\n".join(
        [
            method,
            quote(path, safe="/~"),
            canonical_query(query),
            "".join(f"{k}:{headers[k].strip()}\n" for k in names),
            signed,
            _EMPTY_SHA256,
        ]
    )
    region = access.region or DEFAULT_REGION
    scope = f"{stamp[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(request.encode()).hexdigest()]
    )
    key = f"AWS4{access.secret_key}".encode()
    for part in (stamp[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access.access_key}/{scope}, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    return headers
