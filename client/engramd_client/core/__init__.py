"""What the daemon and its workers must agree on, without torch: the layout and
manifest, the checkpoint reader and set ids, the wire stubs, process identity,
NUMA topology, the CUDA driver lookup, the causes of failure, the socket.

The daemon imports this room of the client package and no other.
"""
