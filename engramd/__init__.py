"""engramd: one copy of a model's Engram tables per node, in shared memory.

The daemon side. Workers import `engramd_client`, never this package.
"""

__version__ = "0.1.0"
