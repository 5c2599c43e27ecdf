"""attach(device="cuda:0") on a machine without a GPU, over the simulated driver and runtime.

    python tests/support/route_probe.py CHECKPOINT SOCKET SHARE(auto|on)

Prints {"mode", "gpu_route", "registered": [flags...], "aliases": bool,
"digests"} once attached, or {"error": class, "message"} where attach
raised; then, on the command "write", writes one byte through its first
table's mapping and prints {"wrote": ...}; holds the tables until stdin
closes. Runs with tests/support/fake_cuda first on PYTHONPATH; FAKE_CUDA_FAULTS
says what the device answers.
"""

from __future__ import annotations

import hashlib
import logging
import sys

import torch
from cuda.bindings import runtime

from engramd.testing.child import say
from engramd_client import EngramdError, attach, cuda, cumem

# CPU torch has no CUDA device (it cannot exist here): torch is told one exists, and a
# "CUDA view" is a CPU tensor over the same address, which is all the route decides.
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
_cpu = torch.device("cpu")
_tensor_at = cumem.tensor_at


def _on_cpu(
    pointer: int, length: int, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    return _tensor_at(pointer, length, dtype, shape, _cpu)


cuda.tensor_at = cumem.tensor_at = _on_cpu


def main() -> int:
    logging.basicConfig(level=logging.WARNING)  # the client's fallback warning, on stderr
    checkpoint, socket, share = sys.argv[1:4]
    try:
        tables = attach(
            checkpoint, socket=socket, share={"on": True, "auto": None}[share], device="cuda:0"
        )
    except EngramdError as e:
        say({"error": type(e).__name__, "message": str(e)})
        return 0
    names = list(tables)
    views = {n: tables.cuda(n) for n in names}
    say(
        {
            "mode": tables.mode,
            "gpu_route": tables.gpu_route,
            "registered": sorted(flags for _, flags in runtime.registered.values()),
            "aliases": all(views[n].data_ptr() == tables[n].data_ptr() for n in names),
            "digests": {
                n: hashlib.sha256(views[n].contiguous().view(torch.uint8).numpy().data).hexdigest()
                for n in names
            },
        }
    )
    for line in sys.stdin:
        if line.strip() == "write":
            first = tables[names[0]].view(torch.uint8).view(-1)
            first[0] = first[0] ^ 0xFF
            say({"wrote": names[0]})
    tables.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
