"""What the daemon and its workers must agree on, without torch: the layout and
manifest, the checkpoint reader and set ids, the wire stubs, process identity,
NUMA topology, the CUDA driver lookup, the reasons and errors, the socket.

Both engramd (the daemon) and engramd_client (the worker) import this package;
it imports neither.
"""
