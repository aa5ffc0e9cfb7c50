"""Server CPU per request of vLLM's request pattern: a prompt hashed once, not once per length asked about.

vLLM's connector asks about one request at several lengths: a lookup of the whole prompt, a store after each
chunked-prefill step (2k, 4k, ... tokens), then, when the prompt comes again, a lookup, a prefetch and a load.
This drives ``--prompts`` new prompts of ``--prompt-tokens`` tokens (chunk 256, block 16: GPU vLLM's block) that
way, against a ``kvtier server`` of this tree and, with ``--src DIR`` (e.g. a ``git archive`` of an older
commit's ``src``), one of another tree: each in a child process running that tree's client and server (the
protocol may differ between trees), ``--rounds`` times in turn. Printed per tree: server CPU per request kind
(every thread of the server and of its hashing child, /proc schedstat), the tokens it hashed per prompt token
(``kvtier_hashed_tokens_total``, where the server counts it), and this tree / the other.

Run: ``.venv/bin/python benchmarks/bench_hash_once.py [--prompts 8] [--prompt-tokens 32768] [--src DIR] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvtier_harness.kvtier_server import ServerProcess
from kvtier_harness.metrics import metric_value
from kvtier.client import Client
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16)  # 128 B per token: the bytes are not the point
CHUNK, BLOCK, STEP = 256, 16, 2048
KINDS = ("lookup (new)", "store (chunked prefill)", "lookup (again)", "prefetch", "load")


def process_cpu_seconds(pid: int, children: bool = True) -> float:
    """CPU seconds run by ``pid``'s threads and its living children's (the hashing process), from
    ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds: ``stat``'s clock ticks are 10 ms, longer than a request)."""
    total = 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0]) / 1e9
            if children:
                for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                    total += process_cpu_seconds(int(child), children=False)
    return total


@contextlib.contextmanager
def server():
    srv = ServerProcess(Path(tempfile.mkdtemp()), CHUNK, l1="2GB", block_size=BLOCK)
    with srv, Client(srv.url, model="bench-hash-once", layout=LAYOUT, timeout_seconds=60) as client:
        yield srv, client


def requests(client: Client, prompt: list[int], kv: torch.Tensor):
    """(kind, call) of one request's life, in order."""
    yield KINDS[0], lambda: client.lookup(prompt)
    for end in range(STEP, len(prompt) + 1, STEP):
        yield KINDS[1], lambda end=end: client.store(prompt[:end], kv[:, :, :end])
    yield KINDS[2], lambda: client.lookup(prompt)
    yield KINDS[3], lambda: client.prefetch(prompt, wait=True)
    yield KINDS[4], lambda: client.retrieve(prompt[:len(prompt) // 2])


def keys_path_seconds(args) -> float:
    """CPU seconds the server's key path takes for the chunked-prefill stores alone, in process (no sockets, no
    copies): per store, what the server does to a prompt (``unhashed_tokens`` to decide on the hashing worker, or
    ``memoised`` in trees before it, then ``chunk_refs`` twice: the worker's and the handler's)."""
    from kvtier.cache.memo import LookupMemo
    from kvtier.cache.prompt_keys import PromptKeys
    from kvtier.config import KVTierConfig

    keys = PromptKeys(KVTierConfig(chunk_size=CHUNK, block_size=BLOCK), "m", "layout", "", LookupMemo(64 << 20))
    decide = getattr(keys, "unhashed_tokens", None) or keys.memoised
    rng = np.random.default_rng(1)
    started = time.process_time()
    for _ in range(args.prompts):
        prompt = rng.integers(0, 50_000, args.prompt_tokens).astype(np.int64)
        for end in range(STEP, args.prompt_tokens + 1, STEP):
            decide(prompt[:end])
            keys.chunk_refs(prompt[:end])
            keys.chunk_refs(prompt[:end])
    return time.process_time() - started


def measure(args) -> dict:
    """In the child: CPU seconds per request kind, the requests of each kind, and the hashed tokens."""
    rng = np.random.default_rng(0)
    kv = torch.randn(LAYOUT.chunk_shape(args.prompt_tokens))
    cpu, count = dict.fromkeys(KINDS, 0.0), dict.fromkeys(KINDS, 0)
    with server() as (srv, client):
        for _ in range(args.prompts):
            prompt = [int(t) for t in rng.integers(0, 50_000, args.prompt_tokens)]
            for kind, call in requests(client, prompt, kv):
                before = process_cpu_seconds(srv.proc.pid)
                call()
                cpu[kind] += process_cpu_seconds(srv.proc.pid) - before
                count[kind] += 1
        hashed = metric_value(srv.metrics_text(), "kvtier_hashed_tokens_total")
    return {"cpu": cpu, "count": count, "hashed": hashed, "keys": keys_path_seconds(args)}


def run_child(args, src: str | None) -> dict:
    """``measure`` in a child process whose kvtier is ``src`` (None: this tree)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([*([src] if src else []), str(Path(root) / "src"), root])
    argv = [sys.executable, __file__, "--child", "--prompts", str(args.prompts), "--prompt-tokens",
            str(args.prompt_tokens)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--src", default=None, help="also a kvtier of this PYTHONPATH (another tree's src/)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree, in turn")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    trees = {"this tree": None, **({"--src": args.src} if args.src else {})}
    cpu = {name: dict.fromkeys(KINDS, 0.0) for name in trees}
    count, hashed, keys = dict.fromkeys(KINDS, 0), {}, dict.fromkeys(trees, 0.0)
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            got = run_child(args, trees[name])
            for kind in KINDS:
                cpu[name][kind] += got["cpu"][kind]
                if name == "this tree":
                    count[kind] += got["count"][kind]
            hashed[name] = got["hashed"]
            keys[name] += got["keys"]
    total_tokens = args.prompts * args.prompt_tokens
    for name in trees:
        per = ", ".join(f"{k} {cpu[name][k] / count[k] * 1e3:.2f}" for k in KINDS)
        told = "not counted" if hashed[name] is None else f"{hashed[name] / total_tokens:.2f}"
        print(f"{name}: server CPU ms per request: {per}; tokens hashed per prompt token: {told}; key path of a "
              f"store in process: {keys[name] / count[KINDS[1]] * 1e3:.2f} ms")
    if args.src:
        for k in KINDS:
            print(f"this tree / --src, {k}: {cpu['this tree'][k] / max(cpu['--src'][k], 1e-9):.2f}x")
        print(f"this tree / --src, a store's key path in process: {keys['this tree'] / keys['--src']:.2f}x")
        whole = sum(cpu["this tree"].values()) / sum(cpu["--src"].values())
        print(f"this tree / --src, every request of a prompt's life: {whole:.2f}x")
    print(f"{args.rounds} rounds of {args.prompts} prompts of {args.prompt_tokens} tokens; load average at the end: "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
