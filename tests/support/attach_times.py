"""Attach a checkpoint with engramd_client again and again; print how long each took.

    python tests/support/attach_times.py SOCKET CHECKPOINT SECONDS

Attaches (share on: sharing or an error, never private tables), closes,
attaches again, for SECONDS. Prints {"seconds": [each attach's], "errors":
[class: message]}. Run as another user (tests/support/run_as.py).
"""

from __future__ import annotations

import json
import sys
import time

from engramd_client import EngramdError, attach


def main() -> int:
    socket, checkpoint, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    took, errors = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        try:
            tables = attach(checkpoint, share=True, socket=socket)
        except EngramdError as e:
            errors.append(f"{type(e).__name__}: {e}")
            continue
        took.append(time.perf_counter() - start)
        tables.close()
    print(json.dumps({"seconds": took, "errors": errors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
