"""Table sets, their whole life: planned, loaded, proven, published, leased, dropped.

SetKeeper (keeper.py) holds the verbs every caller uses; the store (sets,
admission, leases), loading, proofs, plans and the load policy sit behind
it. Takes and gives plain values (intents.py), never a wire message; runs
on the event loop and reaches memory only through a backing
(engramd.backings) and the host facilities (engramd.host).
"""
