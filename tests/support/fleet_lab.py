"""A fleet on one machine, for the tests and the benchmark: two network namespaces joined by a
veth, or several on a bridge with links of a set rate, and an S3-compatible server (s3rver)
with the checkpoint's files uploaded.

Not daemon code. Both need root (namespaces) or s3rver installed (`make
test-tools` puts it in .tools/); `why_not()` says what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: Where `make test-tools` installs s3rver (npm), beside the checkout.
S3RVER = (
    Path(__file__).resolve().parents[2] / ".tools" / "s3rver" / "node_modules" / ".bin" / "s3rver"
)
#: s3rver's fixed keys.
S3RVER_KEY = "S3RVER"
#: UCX onto the network path (between processes of one host it would pick cma),
#: with the socket buffers its TCP transport needs for throughput.
UCX_TCP = {"UCX_TLS": "tcp", "UCX_TCP_SNDBUF": "8m", "UCX_TCP_RCVBUF": "8m"}


@dataclass(frozen=True)
class Net:
    """Two namespaces joined by a veth: each one's name and address."""

    a: str
    ip_a: str
    b: str
    ip_b: str

    @staticmethod
    def run_in(netns: str) -> list[str]:
        """The command prefix that runs a program in `netns` (with the namespace's own /sys,
        where UCX finds its network devices: under a plain `nsenter --net` it sees the host's)."""
        return ["ip", "netns", "exec", netns]


def netns_missing() -> str:
    """Why two namespaces cannot be made here, or ""."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "ip is missing: `make test-tools` installs iproute2"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


#: Seconds a link set up has to come up.
LINK_UP_S = 10.0


def _running(links: list[tuple[str, str]]) -> None:
    """Return once each (namespace, device) is up and running. The kernel says so up to a
    second after `link set up` (its link watch is rate-limited), and UCX uses no device that
    is not running: a daemon started sooner finds only loopback."""
    deadline = time.monotonic() + LINK_UP_S
    for ns, dev in links:
        while True:
            shown = subprocess.run(
                ["ip", "-n", ns, "-j", "link", "show", "dev", dev],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            if json.loads(shown)[0].get("operstate") == "UP":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{dev} in {ns} did not come up in {LINK_UP_S:.0f} s")
            time.sleep(0.01)


@contextlib.contextmanager
def veth_pair(tag: str) -> Iterator[Net]:
    """Namespaces `<tag>a`, `<tag>b` and a veth between them (10.231.N.1, .2); removed after."""
    subnet = f"10.231.{os.getpid() % 250}"
    a, b = f"{tag}a", f"{tag}b"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", f"{tag}x", "netns", a, "type", "veth", "peer", f"{tag}y", "netns", b)
        for ns, dev, ip in ((a, f"{tag}x", f"{subnet}.1"), (b, f"{tag}y", f"{subnet}.2")):
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        _running([(a, f"{tag}x"), (b, f"{tag}y")])
        yield Net(a, f"{subnet}.1", b, f"{subnet}.2")
    finally:
        for ns in made:
            # Removing a namespace removes its end of the veth, and so the pair.
            subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)


@dataclass(frozen=True)
class Lan:
    """Namespaces on one bridge: each node's namespace, address and link (its veth's end)."""

    names: list[str]
    ips: list[str]
    devices: list[str]

    def sent(self, node: int) -> int:
        """Bytes node `node` has sent on its link."""
        return _link_bytes(self.names[node], self.devices[node], "tx")

    def received(self, node: int) -> int:
        """Bytes node `node` has received on its link."""
        return _link_bytes(self.names[node], self.devices[node], "rx")


def _link_bytes(netns: str, device: str, way: str) -> int:
    shown = subprocess.run(
        ["ip", "-n", netns, "-j", "-s", "link", "show", "dev", device],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(json.loads(shown)[0]["stats64"][way]["bytes"])


@contextlib.contextmanager
def bridged(tag: str, count: int, rate: str = "") -> Iterator[Lan]:
    """`count` namespaces `<tag>0`.. on a bridge in a namespace of its own (`<tag>h`, so the
    host's network is untouched), at 10.232.N.1.. ; `rate` ("400mbit"): each link limited to
    it both ways (tc's token bucket on both ends of its veth). Removed after."""
    subnet = f"10.232.{os.getpid() % 250}"
    hub = f"{tag}h"
    made: list[str] = []
    names = [f"{tag}{k}" for k in range(count)]
    devices = [f"{tag}v{k}" for k in range(count)]
    try:
        _ip("netns", "add", hub)
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for k, (ns, dev) in enumerate(zip(names, devices, strict=True)):
            _ip("netns", "add", ns)
            made.append(ns)
            port = f"{tag}p{k}"
            _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", port, "netns", hub)
            _ip("-n", ns, "addr", "add", f"{subnet}.{k + 1}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", hub, "link", "set", port, "master", "br0", "up")
            if rate:
                for where, end in ((ns, dev), (hub, port)):
                    subprocess.run(
                        [
                            *("tc", "-n", where, "qdisc", "add", "dev", end, "root", "tbf"),
                            *("rate", rate, "burst", "512kb", "latency", "100ms"),
                        ],
                        check=True,
                        capture_output=True,
                    )
        _running(list(zip(names, devices, strict=True)))
        yield Lan(names, [f"{subnet}.{k + 1}" for k in range(count)], devices)
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class S3:
    """An s3rver: its endpoint and bucket."""

    endpoint: str
    bucket: str

    def put(self, key: str, data: bytes) -> None:
        """Upload an object (s3rver takes unsigned requests)."""
        request = urllib.request.Request(
            f"{self.endpoint}/{self.bucket}/{key}", data=data, method="PUT"
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            if reply.status != 200:
                raise OSError(f"PUT {key}: HTTP {reply.status}")

    def upload(self, checkpoint: Path, prefix: str, cut: dict[str, int] | None = None) -> None:
        """Put the checkpoint's safetensors files under `prefix`; `cut`: files put shortened."""
        for f in sorted(checkpoint.glob("*.safetensors")):
            data = f.read_bytes()
            if cut and f.name in cut:
                data = data[: cut[f.name]]
            self.put(f"{prefix}/{f.name}", data)

    def attest(self, checkpoint: Path, prefix: str, token_file: Path) -> str:
        """Make the checkpoint's attested manifest with `engramd manifest` and put it beside its
        files under `prefix`; its key."""
        with tempfile.TemporaryDirectory() as tmp:
            made = Path(tmp) / "manifest.json"
            subprocess.run(
                [
                    *(sys.executable, "-m", "engramd", "manifest", str(checkpoint)),
                    *("--peer-token-file", str(token_file), "-o", str(made)),
                ],
                check=True,
                capture_output=True,
                timeout=300,
            )
            data = made.read_bytes()
        set_id = json.loads(data.split(b"\n", 1)[1])["set_id"]
        key = f"{prefix}/engramd-manifest-{set_id}.json"
        self.put(key, data)
        return key

    def env(self) -> dict[str, str]:
        """The AWS variables a daemon (or boto3) reads the store with."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": S3RVER_KEY,
            "AWS_SECRET_ACCESS_KEY": S3RVER_KEY,
            "AWS_REGION": "us-east-1",
        }


def s3rver_missing() -> str:
    """Why s3rver cannot start here, or ""."""
    if not S3RVER.exists():
        return f"s3rver is not installed at {S3RVER}: `make test-tools` installs it with npm"
    return ""


@contextlib.contextmanager
def s3rver(bucket: str = "tables", timeout: float = 30) -> Iterator[S3]:
    """s3rver on a free port over a temporary folder, answering requests; stopped after."""
    port = free_port()
    store = S3(f"http://127.0.0.1:{port}", bucket)
    data = Path(tempfile.mkdtemp(prefix="engramd-s3-"))
    proc = subprocess.Popen(
        [
            *(str(S3RVER), "-a", "127.0.0.1", "-p", str(port), "-d", str(data)),
            *("--configure-bucket", bucket, "--silent"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"s3rver exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{store.endpoint}/{bucket}", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"s3rver did not answer within {timeout} s") from None
                time.sleep(0.05)
        yield store
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(data, ignore_errors=True)
