"""The demo and what it shares with the benchmark and the tests: not the daemon.

`engramd demo` (run.py) synthesizes a checkpoint (synth.py), starts a
daemon (daemon_process.py) and drives replica processes (replica.py, over
child.py's JSON lines) that run the Engram lookup (engram_hash.py).
"""
