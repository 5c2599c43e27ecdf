"""Fixtures the tests, the benchmark and the demo build on: not the daemon.

synth.py writes checkpoints whose every byte can be recomputed (also `engramd
synth`); daemon_process.py runs `engramd serve` in a child process; child.py
drives children over JSON lines; engram_hash.py is the Engram lookup the
replicas run; pagecache.py takes files out of the page cache for the bench
and tools. The fleet's network lab and simulator, which only tests and the
bench use, are in tests/support.
"""
