"""Run inside a mount namespace whose /dev/shm is a small tmpfs (see ``test_server_startup``): two arenas and a
filler file compete for it. Prints one JSON line of what happened. Not a test.

Usage: ``python small_shm.py ARENA_BYTES FILLER_BYTES``.
"""

from __future__ import annotations

import json
import os
import sys

from kvtier.errors import ConfigError
from kvtier.l1.arena import Arena


def main() -> None:
    arena_bytes, filler_bytes = int(sys.argv[1]), int(sys.argv[2])
    out: dict = {}
    first = Arena(arena_bytes, "kvtier-small-a")
    try:
        Arena(arena_bytes, "kvtier-small-b")
        out["second"] = "started"
    except ConfigError as exc:
        out["second"] = str(exc)
    try:  # someone else fills /dev/shm after the server started
        with open("/dev/shm/filler", "wb") as f:
            f.write(b"\0" * filler_bytes)
        out["filler"] = "written"
    except OSError as exc:
        out["filler"] = exc.strerror
    print(json.dumps(out), flush=True)  # before the writes that would kill the process with SIGBUS
    first.view(0, arena_bytes)[:] = b"\x07" * arena_bytes  # every page of the arena, as stores would
    out["arena"] = "written"
    print(json.dumps(out), flush=True)
    first.close()
    first.unlink()
    os.unlink("/dev/shm/filler") if os.path.exists("/dev/shm/filler") else None


if __name__ == "__main__":
    main()
