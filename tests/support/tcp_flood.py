"""Open many calls that try to stay open on a gRPC TCP port; print how the daemon ended them.

    python tests/support/tcp_flood.py ADDRESS fill|watch|check COUNT CONNECTIONS

fill: COUNT PeerService.Fill streams that never send a message (no token,
nothing). watch: COUNT Health/Watch streams. check: COUNT Health/Check calls
(the kubelet's probe), counted by the status they answer. Spread over CONNECTIONS
connections of their own, all opened at once. Waits for every call to end,
at most HOLD_S; prints {"codes": {status name: count}, "held": calls still
open after HOLD_S, "seconds": when the last one ended}. Run in a network
namespace of its own (ip netns exec), as the attacker.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engramd_shared.pb import peer_pb2, peer_pb2_grpc

#: How long the flood waits for the daemon to end its calls.
HOLD_S = 60.0


async def _silent(forever: asyncio.Event) -> AsyncIterator[peer_pb2.FillRequest]:
    # Headers go out, then nothing, until the flood is over.
    await forever.wait()
    return
    yield peer_pb2.FillRequest()


async def _one(channel: grpc.aio.Channel, mode: str, forever: asyncio.Event) -> str:
    call: Any
    if mode == "check":
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as e:
            return str(e.code().name)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    if mode == "fill":
        call = peer_pb2_grpc.PeerServiceStub(channel).Fill(_silent(forever))
    else:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    try:
        async for _ in call:
            pass  # a Watch that is served streams its status, and stays open
        return str((await call.code()).name)
    except grpc.aio.AioRpcError as e:
        return str(e.code().name)


async def flood(address: str, mode: str, count: int, connections: int) -> dict[str, Any]:
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(connections)
    ]
    forever = asyncio.Event()
    started = time.monotonic()
    tasks = [
        asyncio.ensure_future(_one(channels[i % connections], mode, forever)) for i in range(count)
    ]
    done, pending = await asyncio.wait(tasks, timeout=HOLD_S)
    seconds = time.monotonic() - started
    for task in pending:
        task.cancel()
    forever.set()
    codes = collections.Counter(t.result() for t in done)
    for channel in channels:
        await channel.close()
    return {"codes": dict(codes), "held": len(pending), "seconds": round(seconds, 1)}


def main() -> int:
    address, mode, count, connections = sys.argv[1:5]
    print(json.dumps(asyncio.run(flood(address, mode, int(count), int(connections)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
