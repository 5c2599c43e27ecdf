"""Fixtures the tests, the benchmark and the demo build on: not the daemon.

synth.py writes checkpoints whose every byte can be recomputed (also `engramd
synth`); daemon_process.py runs `engramd serve` in a child process; child.py
drives children over JSON lines; engram_hash.py is the Engram lookup the
replicas run; fleet_lab.py joins two network namespaces and an S3-compatible
server into a fleet on one machine.
"""
