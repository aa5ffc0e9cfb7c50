"""Server CPU per request of vLLM's request pattern: a prompt hashed once, not once per length asked about.

vLLM's connector asks about one request at several lengths: a lookup of the whole prompt, a store after each
chunked-prefill step (2k, 4k, ... tokens), then, when the prompt comes again, a lookup, a prefetch and a load.
This drives ``--prompts`` new prompts of ``--prompt-tokens`` tokens (chunk 256, block 16: GPU vLLM's block) that
way, against a ``kvtier server`` of this tree and, with ``--src DIR`` (e.g. a ``git archive`` of an older
commit's ``src``), one of another tree, side by side, the requests to each in turn. Printed per server: CPU per
request kind (every thread of the server and of its hashing child, /proc schedstat), the tokens it
hashed per prompt token (``kvtier_hashed_tokens_total``, where the server counts it), and this tree / the other.

Run: ``.venv/bin/python benchmarks/bench_hash_once.py [--prompts 8] [--prompt-tokens 32768] [--src DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from harness.kvtier_server import ServerProcess
from harness.metrics import metric_value
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
def server(src: str | None):
    old = os.environ.get("PYTHONPATH")
    if src:
        os.environ["PYTHONPATH"] = src
    try:
        srv = ServerProcess(Path(tempfile.mkdtemp()), CHUNK, l1="2GB", block_size=BLOCK)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--src", default=None, help="also a kvtier server running this PYTHONPATH (another tree's src/)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    kv = torch.randn(LAYOUT.chunk_shape(args.prompt_tokens))
    with contextlib.ExitStack() as stack:
        systems = {"this tree": stack.enter_context(server(None))}
        if args.src:
            systems["--src"] = stack.enter_context(server(args.src))
        cpu = {name: dict.fromkeys(KINDS, 0.0) for name in systems}
        count = dict.fromkeys(KINDS, 0)
        for _ in range(args.prompts):
            prompt = [int(t) for t in rng.integers(0, 50_000, args.prompt_tokens)]
            lives = {name: list(requests(client, prompt, kv)) for name, (_, client) in systems.items()}
            for step in range(len(lives["this tree"])):
                for name, (srv, _) in systems.items():
                    kind, call = lives[name][step]
                    before = process_cpu_seconds(srv.proc.pid)
                    call()
                    cpu[name][kind] += process_cpu_seconds(srv.proc.pid) - before
                count[lives["this tree"][step][0]] += 1
        hashed = {name: metric_value(srv.metrics_text(), "kvtier_hashed_tokens_total") for name, (srv, _) in
                  systems.items()}
    total_tokens = args.prompts * args.prompt_tokens
    for name in systems:
        per = ", ".join(f"{k} {cpu[name][k] / count[k] * 1e3:.2f}" for k in KINDS)
        told = "not counted" if hashed[name] is None else f"{hashed[name] / total_tokens:.2f}"
        print(f"{name}: server CPU ms per request: {per}; tokens hashed per prompt token: {told}")
    if args.src:
        for k in KINDS:
            print(f"this tree / --src, {k}: {cpu['this tree'][k] / max(cpu['--src'][k], 1e-9):.2f}x")
        whole = sum(cpu["this tree"].values()) / sum(cpu["--src"].values())
        print(f"this tree / --src, every request of a prompt's life: {whole:.2f}x")
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens; load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
