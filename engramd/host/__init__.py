"""What the daemon asks of the machine: NUMA, pinning, memory limits, huge pages,
the shm folder, systemd's notify protocol and fd store, blocking threads.

They import no other room of the daemon: only its config, errors and units,
and engramd_shared.
"""
