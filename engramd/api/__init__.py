"""The daemon's faces: the gRPC services, the fd channel, probes, peers, metrics.

They translate and decide nothing: requests become the sets' plain values
in requests.py (refused there when malformed), each call one verb of
engramd.sets (keeper.py, LeaseBook.redeem), and the answers engramd.v1
messages in wire.py; engramd/errors.py maps exceptions to gRPC status codes.
Nothing below this room imports it.
"""
