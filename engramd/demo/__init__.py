"""`engramd demo`: N replicas share one copy of the tables, one private replica beside them.

run.py drives the replicas (replica.py) on top of the fixtures in
engramd.testing: the synthetic checkpoint, the daemon in a child process,
the Engram lookup and the JSON-lines children.
"""
