"""`engramd demo`: N replicas share one copy of the tables; one private replica beside them.

Synthesizes a checkpoint, starts the daemon on a temporary socket and shm
folder, starts the replicas (auto mode), runs each replica's checked Engram
lookups in turn, measures every process's memory while all are attached, then
does the same with one private replica and prints the comparison. Everything
it made is removed at the end, also on Ctrl-C, SIGTERM (`timeout`, a CI
runner, a service manager) and SIGHUP (a closed terminal).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from engramd.host.blocking import cores
from engramd.host.hugeroot import remove_shm_folder
from engramd.testing.child import JsonLinesChild
from engramd.testing.daemon_process import DaemonProcess
from engramd.testing.synth import SynthSpec, synthesize
from engramd.units import gib


class Replica(JsonLinesChild):
    """A demo replica child process."""

    def __init__(
        self, checkpoint: Path, socket: Path, rank: int, share: str, steps: int, tokens: int
    ) -> None:
        super().__init__(
            [
                sys.executable,
                "-m",
                "engramd.demo.replica",
                "--checkpoint",
                str(checkpoint),
                "--socket",
                str(socket),
                "--share",
                share,
                "--rank",
                str(rank),
                "--steps",
                str(steps),
                "--tokens",
                str(tokens),
            ],
            start_new_session=True,  # Ctrl-C reaches the demo, which stops it in order
        )
        self.rank = rank
        #: How the demo's progress lines name it.
        self.label = f"replica {rank}" if share != "off" else "the private replica"
        self.hello: dict[str, Any] = {}

    def memory(self) -> dict[str, int]:
        """RSS, PSS and USS of the replica now."""
        m = psutil.Process(self.proc.pid).memory_full_info()
        return {"rss": m.rss, "pss": m.pss, "uss": m.uss}

    def close(self) -> None:
        """Ask it to close its tables and exit."""
        self.send("exit")
        self.proc.wait(timeout=30)


#: Signals that stop the demo as Ctrl-C does: everything it made is removed first.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Seconds a replica takes to start (Python, torch's import, the attach) on one core,
#: and gathered rows per second of one replica's checked lookups, as measured on the
#: 2-core development VM: the demo's estimate of its own length scales from these.
REPLICA_START_CPU_S = 4.0
#: Turns of lookups, at least: each a shared replica's run and the private replica's, in
#: alternating order, so that a busy spell of the machine falls on both alike; the
#: figure is the median turn's ratio.
TURNS = 5
CHECKED_ROWS_PER_S = 0.2e6
#: Bytes per second the checkpoint is synthesized at, there.
SYNTH_BYTES_PER_S = 200e6


class Stopped(Exception):
    """A stop signal arrived: the demo cleans up and exits 128 + the signal's number."""

    def __init__(self, sig: int) -> None:
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


def _stop(sig: int, frame: object) -> None:
    raise Stopped(sig)


def _say(text: str, started: float) -> None:
    """One progress line, with the seconds since the demo started."""
    print(f"[{time.perf_counter() - started:5.0f} s] {text}", flush=True)


def estimate_s(spec: SynthSpec, replicas: int, steps: int, tokens: int) -> float:
    """About how long the demo runs on this machine, from the development VM's rates."""
    starts = (replicas + 1) * REPLICA_START_CPU_S / min(cores(), max(replicas, 1))
    # Each turn gathers and checks 24 heads x `tokens` rows per layer and step (+1 warm-up),
    # in a shared replica and in the private one.
    rows = 2 * turns(replicas) * (steps + 1) * tokens * 24 * spec.layers
    # Synthesizing, then the daemon's load and the private replica's, each reading it once.
    return 3 * spec.table_bytes / SYNTH_BYTES_PER_S + starts + rows / CHECKED_ROWS_PER_S


def _start_replicas(
    checkpoint: Path,
    socket: Path,
    share: str,
    count: int,
    steps: int,
    tokens: int,
    started: float,
) -> list[Replica]:
    replicas = [Replica(checkpoint, socket, rank, share, steps, tokens) for rank in range(count)]
    for r in replicas:
        r.hello = r.read()
        how = "shares the daemon's copy" if r.hello["mode"] == "shared" else "loaded its own"
        _say(f"{r.label} attached in {r.hello['attach_s'] * 1e3:.1f} ms: {how}", started)
    return replicas


def turns(replicas: int) -> int:
    """Turns the demo takes: every shared replica runs once at least, TURNS at least."""
    return max(replicas, TURNS)


def _run_one(r: Replica, steps: int, started: float) -> dict[str, Any]:
    r.send("run")
    result: dict[str, Any] = r.read()
    _say(
        f"{r.label}: {steps} lookup steps, {rate(result) / 1e6:.2f} M lookups/s, "
        f"{result['bad']} of {result['checked']:,} rows wrong",
        started,
    )
    return result


def _turns(
    shared: list[Replica], private: Replica, steps: int, started: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the shared replicas' runs, the private replica's), turn by turn.

    One run at a time: on a small machine concurrent replicas would share
    cores and the lookups/s would measure the scheduler. Each turn pairs a
    shared run with a private one, first one then the other in turn.
    """
    shared_runs, private_runs = [], []
    for turn in range(turns(len(shared))):
        first, second = (shared[turn % len(shared)], private)[:: 1 if turn % 2 == 0 else -1]
        a, b = _run_one(first, steps, started), _run_one(second, steps, started)
        s, p = (a, b) if first is not private else (b, a)
        shared_runs.append(s)
        private_runs.append(p)
    return shared_runs, private_runs


def rate(run: dict[str, Any]) -> float:
    """Lookups per second of one run."""
    return float(run["lookups"]) / max(float(run["gather_s"]), 1e-9)


def run_demo(rows: int, replicas: int, steps: int, tokens: int, workdir: Path | None) -> int:
    """Run the demo; returns the process exit code (0 when every check passed).

    Ctrl-C returns 130, SIGTERM and SIGHUP 128 + their number, once everything
    the demo made is removed.
    """
    previous = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    try:
        return _demo(rows, replicas, steps, tokens, workdir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _demo(rows: int, replicas: int, steps: int, tokens: int, workdir: Path | None) -> int:
    started = time.perf_counter()
    spec = SynthSpec(rows=rows)
    print(
        f"engramd demo: {replicas} replicas share one copy of {gib(spec.table_bytes)} of "
        f"tables, then 1 private replica; about {estimate_s(spec, replicas, steps, tokens):.0f} s "
        f"on {cores()} cores (scaled from the 2-core development VM; most of it the replicas "
        "checking every row they gather); Ctrl-C stops it and removes what it made",
        flush=True,
    )
    made: list[Path] = []  # what the demo removes, in order (a workdir given is the caller's)
    shm: Path | None = None
    daemon: DaemonProcess | None = None
    try:
        if workdir is None:
            made.append(Path(tempfile.mkdtemp(prefix="engramd-demo-")))
        work = workdir or made[0]
        shm = Path(tempfile.mkdtemp(prefix="engramd-demo-", dir="/dev/shm"))
        sock_dir = Path(tempfile.mkdtemp(prefix="ed", dir="/tmp"))
        made.append(sock_dir)
        _say(
            f"synthesizing {spec.layers} Engram layers x {rows:,} rows "
            f"({gib(spec.table_bytes)} of fp8 tables + e8m0 scales) ...",
            started,
        )
        checkpoint = synthesize(work / "checkpoint", spec)
        daemon = DaemonProcess(
            sock_dir / "engramd.sock",
            shm,
            ["--checkpoint", str(checkpoint), "--drop-on-exit"],
            work / "engramd.log",
        )
        start = time.perf_counter()
        daemon.start()
        [table_set] = daemon.status().sets
        _say(
            f"engramd loaded the set in {table_set.load_seconds:.2f} s "
            f"(ready {time.perf_counter() - start:.2f} s after start)",
            started,
        )
        _say(
            f"starting {replicas} replicas side by side (each imports torch, then attaches)",
            started,
        )
        shared = _start_replicas(
            checkpoint, daemon.socket, "auto", replicas, steps, tokens, started
        )
        _say("starting 1 private replica (it loads its own copy of the tables)", started)
        [private] = _start_replicas(checkpoint, daemon.socket, "off", 1, steps, tokens, started)
        _say(
            f"{turns(replicas)} turns of {steps} checked lookup steps, one replica at a time: "
            "a shared replica's and the private one's, in alternating order",
            started,
        )
        shared_runs, private_runs = _turns(shared, private, steps, started)
        # Measured once every replica ran its lookups (their buffers held, the tables touched).
        shared_mem = [r.memory() for r in shared]
        private_mem = private.memory()
        daemon_uss = psutil.Process(daemon.pid).memory_full_info().uss
        status = daemon.status()
        # engramd's sets in the shm folder (or the huge-page tmpfs over its sets root).
        shm_used = status.shm.used_bytes
        leases = len(status.sets[0].leases)
        for r in (*shared, private):
            r.close()

        return _report(
            spec,
            replicas,
            tokens,
            table_set.bytes,
            shm_used,
            leases,
            daemon_uss,
            shared,
            shared_runs,
            shared_mem,
            private,
            private_runs,
            private_mem,
        )
    except (KeyboardInterrupt, Stopped) as e:
        what = f"stopped by {e}" if isinstance(e, Stopped) else "interrupted"
        # A closed terminal (SIGHUP) takes stdout with it: the cleanup goes on regardless.
        with contextlib.suppress(OSError):
            print(f"{what}; stopping the replicas and the daemon, removing what the demo made")
        return 128 + e.sig if isinstance(e, Stopped) else 130
    finally:
        # Nothing stops the cleanup half-way: a second signal (systemd repeats
        # none, a person may) waits until the demo exits.
        for sig in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        # Every replica, also one whose Popen a Ctrl-C interrupted half-way:
        # they hold nothing that needs a goodbye, their leases end with them.
        for child in psutil.Process().children():
            if daemon is None or daemon.proc is None or child.pid != daemon.pid:
                child.kill()
                child.wait()
        if daemon is not None and daemon.proc is not None:
            daemon.stop()
        if shm is not None:
            remove_shm_folder(shm)
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def _report(
    spec: SynthSpec,
    n: int,
    tokens: int,
    table_bytes: int,
    shm_used: int,
    leases: int,
    daemon_uss: int,
    shared: list[Replica],
    runs: list[dict[str, Any]],
    mems: list[dict[str, int]],
    private: Replica,
    private_runs: list[dict[str, Any]],
    private_mem: dict[str, int],
) -> int:
    shared_host = shm_used + daemon_uss + sum(m["uss"] for m in mems)
    private_host = n * private_mem["uss"]
    attach_s = statistics.median(r.hello["attach_s"] for r in shared)
    load_s = private.hello["attach_s"]
    shared_rate = statistics.median(rate(r) for r in runs)
    private_rate = statistics.median(rate(r) for r in private_runs)
    # Each turn's shared run against its private one: the machine's load falls on both.
    ratio = statistics.median(rate(s) / rate(p) for s, p in zip(runs, private_runs, strict=True))
    rows = [
        ("table bytes", gib(table_bytes), "", ""),
        ("shm used (one copy)", gib(shm_used), "", f"{shm_used / table_bytes:.3f}x table"),
    ]
    for r, m in zip(shared, mems, strict=True):
        rows.append(
            (
                f"replica {r.rank} RSS / PSS / USS",
                f"{gib(m['rss'])} / {gib(m['pss'])} / {gib(m['uss'])}",
                "",
                "",
            )
        )
    rows += [
        (
            "private replica RSS / PSS / USS",
            "",
            f"{gib(private_mem['rss'])} / {gib(private_mem['pss'])} / {gib(private_mem['uss'])}",
            "",
        ),
        (
            f"host memory, {n} replicas",
            gib(shared_host),
            gib(private_host),
            f"saved {gib(private_host - shared_host)} ({private_host / shared_host:.2f}x)",
        ),
        (
            "attach (median) vs private load",
            f"{attach_s * 1e3:.1f} ms",
            f"{load_s * 1e3:.0f} ms",
            f"{load_s / attach_s:.0f}x faster",
        ),
        (
            f"lookups/s (median of {len(runs)} turns)",
            f"{shared_rate / 1e6:.2f} M",
            f"{private_rate / 1e6:.2f} M",
            f"{ratio:.2f}x",
        ),
    ]
    print()
    print(
        f"engramd demo: {n} replicas, {spec.layers} Engram layers x {spec.rows:,} rows; "
        f"each lookup step gathers 24 heads x {tokens} tokens per layer"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'shared (engramd)':>24}  {'private':>24}  ratio")
    for label, a, b, compared in rows:
        print(f"{label:{width}}  {a:>24}  {b:>24}  {compared}")
    print(
        f"(host memory: shm + daemon USS + each replica's USS, against {n} x the private "
        "replica's USS)"
    )

    failures = []
    modes = [r.hello["mode"] for r in shared]
    if modes != ["shared"] * n:
        failures.append(
            f"replicas fell back to private tables: {[r.hello['reason'] for r in shared]}"
        )
    if leases != n:
        failures.append(f"the daemon counted {leases} leases for {n} replicas")
    checked = sum(r["checked"] for r in (*runs, *private_runs))
    bad = sum(r["bad"] for r in (*runs, *private_runs))
    if bad:
        failures.append(f"{bad} of {checked:,} gathered rows differ from the checkpoint")
    for f in failures:
        print(f"FAILED: {f}")
    if not failures:
        print(
            f"all checks passed: {checked:,} gathered rows matched the checkpoint, "
            f"{n} leases, every replica shared"
        )
    return 1 if failures else 0
