"""The demo, and what the benchmark shares with it: not the daemon.

`engramd demo` (run.py) synthesizes a checkpoint (synth.py, also `engramd
synth`), starts a daemon (daemon_process.py) and drives replica processes
(replica.py, over child.py's JSON lines) that run the Engram lookup
(engram_hash.py). The tests build their harness (tests/harness/) on these.
"""
