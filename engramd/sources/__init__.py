"""Where a set's bytes come from besides the checkpoint's files: a peer daemon, an object store.

Both go through NIXL straight into the staged set's memory (regions.py maps
it), and both are checked against the checkpoint the node names before the
loader publishes: the set id (headers and samples) first, then every
tensor's bytes (chain.py tries them in order, falling back to the files).
"""
