"""What a user sees of a shm folder: its entries' names, and whether it may read a file.

    python tests/support/shm_peek.py FOLDER FILE

Prints {"names": [...], "read": bool}. Run as another user (tests/support/run_as.py).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    folder, file = sys.argv[1:3]
    print(json.dumps({"names": sorted(os.listdir(folder)), "read": os.access(file, os.R_OK)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
