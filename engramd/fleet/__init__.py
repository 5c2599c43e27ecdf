"""The fleet: sets filled from peer daemons and object stores, and served to peers.

A part of its own above the core (engramd/sets and below) and below the
lifecycle, which builds it (node.py) only when a fleet flag is set. The
core offers it the seams of sets/seams.py and never imports it. Both kinds
of source go through NIXL straight into the staged set's memory
(backings/regions.py maps it), and both are checked against what the node
trusts before the loader publishes: the set id (headers and samples) first,
then every tensor's bytes (chain.py tries them in order, falling back to the
files).
"""
