"""Management API lookup latency vs the server's plain lookup (issue 19 figure: an 8,192-token prompt, ≤ 2×).

One ``kvtier server`` subprocess (chunks of 256 tokens, a local_disk L2 in a temporary folder, an admin token). A
client stores ``--tokens`` tokens (default 8,192: 32 chunks) and flushes them to L2. Then, in the same run and
interleaved call by call, the same prompt is looked up ``--iterations`` times each way:

  plain   ``kvtier.client.Client.lookup`` over ZMQ (what an engine's scheduler does: leading tokens cached)
  manage  ``POST /cache/lookup`` over the admin HTTP (one keep-alive ``http.client`` connection, the body encoded
          and the answer decoded with msgspec: JSON tokens in, per chunk hash / L1 / each L2 adapter / retention
          hint out). ``httpx`` costs about 0.5 ms more per call here than ``http.client``, and ``json.dumps`` of
          8,192 ids 0.6-1.1 ms against msgspec's 0.24 ms: that is the caller's choice, not the server's cost.

Two prompt modes (``--modes``): ``stored`` asks about the stored prompt (its chunk keys are memoised after the
first call, by both paths alike: they share the cache's memo), ``fresh`` about a new never-stored prompt of the
same length every call (hashed every time: on the server's hashing process for both paths). Wall clock around
each call, round trip and encoding included. Prints medians, p99 and the ratios manage / plain.

Run: ``.venv/bin/python benchmarks/bench_manage.py`` (defaults: 8,192 tokens, 200 iterations per mode and path).
"""

from __future__ import annotations

import argparse
import http.client
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from kvtier_harness.kvtier_server import ServerProcess
from kvtier.client import Client
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)  # lookup cost does not depend on the KV size
CHUNK = 256
MODEL = "bench-manage"
TOKEN = "bench-manage-token"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


class AdminConnection:
    """One keep-alive HTTP connection to the admin port, JSON by msgspec."""

    def __init__(self, port: int, token: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}

    def post(self, path: str, body: dict) -> dict:
        self.conn.request("POST", path, msgspec.json.encode(body), self.headers)
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{path} answered {response.status}: {data[:300]!r}")
        return msgspec.json.decode(data)

    def close(self) -> None:
        self.conn.close()


def measure(client: Client, admin: AdminConnection, prompt_for, expected: int, iterations: int) -> dict:
    """Seconds per call of each path, interleaved; ``prompt_for(i, path)`` is the prompt of call ``i`` and every
    answer must be ``expected`` leading tokens."""
    times = {"plain": [], "manage": []}
    for i in range(iterations):
        for path in ("plain", "manage") if i % 2 == 0 else ("manage", "plain"):  # neither always goes first
            tokens = prompt_for(i, path)
            started = time.perf_counter()
            if path == "plain":
                got = client.lookup(tokens)
            else:
                got = admin.post("/cache/lookup", {"model": MODEL, "tokens": tokens})["num_tokens"]
            times[path].append(time.perf_counter() - started)
            assert got == expected, (path, got, expected)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (a multiple of 256)")
    parser.add_argument("--iterations", type=int, default=200, help="calls per path and mode")
    parser.add_argument("--modes", default="stored,fresh", help="comma separated: stored, fresh")
    args = parser.parse_args()
    rng = np.random.default_rng(19)
    stored = rng.integers(0, 50_000, args.tokens).tolist()
    with tempfile.TemporaryDirectory() as work:
        l2 = {"type": "local_disk", "path": f"{work}/l2"}
        server = ServerProcess(Path(work), CHUNK, "1GB", l2=l2, token=TOKEN, extra=("--log-level", "ERROR"),
                               startup_timeout_seconds=120)
        try:
            admin = AdminConnection(server.admin_port, TOKEN)
            with Client(server.url, model=MODEL, layout=LAYOUT) as client:
                kv = np.zeros(LAYOUT.chunk_shape(len(stored)), dtype=LAYOUT.numpy_dtype())
                client.store(stored, kv)
                assert client.flush(60)
                assert client.lookup(stored) == len(stored)
                check = admin.post("/cache/lookup", {"model": MODEL, "tokens": stored})
                assert all(c["l1"] and c["l2"] == ["local_disk"] for c in check["chunks"]), check
                print(f"prompt: {args.tokens} tokens = {args.tokens // CHUNK} chunks of {CHUNK}, in L1 and a local_disk L2;"
                      f" {args.iterations} calls per path, interleaved; seconds per call (round trip)")
                print(f"{'mode':8} {'path':7} {'median ms':>10} {'p99 ms':>9}")
                for mode in args.modes.split(","):
                    if mode == "stored":
                        times = measure(client, admin, lambda i, path: stored, len(stored), args.iterations)
                    else:  # each call its own new prompt, never asked about before
                        fresh = {(i, p): rng.integers(50_000, 100_000, args.tokens).tolist()
                                 for i in range(args.iterations) for p in ("plain", "manage")}
                        times = measure(client, admin, lambda i, path: fresh[i, path], 0, args.iterations)
                    for path in ("plain", "manage"):
                        print(f"{mode:8} {path:7} {1e3 * percentile(times[path], 50):10.3f} "
                              f"{1e3 * percentile(times[path], 99):9.3f}")
                    ratio = percentile(times["manage"], 50) / percentile(times["plain"], 50)
                    ratio99 = percentile(times["manage"], 99) / percentile(times["plain"], 99)
                    print(f"{mode:8} manage / plain: median {ratio:.2f}x, p99 {ratio99:.2f}x (target: median <= 2x)")
            admin.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
