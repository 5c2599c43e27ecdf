"""The daemon's faces: the gRPC services and their server, the fd channel, metrics.

Requests are validated and refused here, and the store's state becomes
engramd.v1 messages here (wire.py); engramd/errors.py maps exceptions to gRPC
status codes. Nothing below this room imports it.
"""
