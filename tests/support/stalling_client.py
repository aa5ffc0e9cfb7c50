"""A real kvtier ``Client`` process that stops itself (SIGSTOP) inside its copy into a shared-memory slot.

Usage: ``python stalling_client.py URL LAYOUT_JSON TOKENS_JSON BYTE``. It stores ``TOKENS`` with a fill that
writes the first half of the first chunk's slot with ``BYTE``, prints ``STOPPING`` and stops itself. When
continued (SIGCONT) it writes ``BYTE`` over the whole slot, as a writer that resumed after its lease would,
prints ``STORED <n>`` (what ``store`` returned), then waits for a line on stdin before closing (so the test
decides whether it exits cleanly or is killed). Not a test.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

from kvtier.client import Client
from kvtier.layout import KVLayout


def main() -> None:
    url, layout, tokens, byte = sys.argv[1], KVLayout.from_dict(json.loads(sys.argv[2])), json.loads(sys.argv[3]), \
        int(sys.argv[4])
    client = Client(url, model="m", layout=layout, timeout_seconds=60)
    assert client.uses_shared_memory, "the stalling client needs the server's shared memory"
    stopped = []

    def fill(start: int, dst: np.ndarray) -> None:
        raw = dst.reshape(-1).view(np.uint8)
        if not stopped:
            raw[: raw.size // 2] = byte
            stopped.append(True)
            print("STOPPING", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # a stall inside the copy: swap, a debugger, CPU throttling
        raw[:] = byte

    kv_shape = layout.chunk_shape(len(tokens))
    num_stored = client.store_chunks(tokens, fill) if kv_shape else 0
    print("STORED", num_stored, flush=True)
    sys.stdin.readline()
    client.close()


if __name__ == "__main__":
    main()
