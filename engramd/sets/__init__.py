"""Table sets: the store (sets, admission, leases), loading, proofs, the load policy.

Runs on the event loop and reaches memory only through a backing
(engramd.backings) and the host facilities (engramd.host).
"""
