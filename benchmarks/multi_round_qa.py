"""Multi-round QA over the vLLM OpenAI server (in the spirit of LMCache's multi-round QA benchmark).

N users talk to one vLLM server at the same time for R rounds each. Every user's prompt is a shared system
prompt (the start of a real document, the GPL-3 Debian ships) plus that user's own growing history: a
user-specific passage of the document, then every earlier question and answer. Questions are sent with
``stream=true``; TTFT is the time to the first streamed token. Reports mean and p90 TTFT and generated
tokens per second, per system:

  apc_on      vLLM alone, its prefix cache on (the default)
  apc_off     vLLM alone, prefix cache off
  kvtier_256  vLLM (prefix cache on) + kvtier server, chunk 256
  kvtier_128  vLLM (prefix cache on) + kvtier server, chunk 128
  lmcache_shm_256  vLLM (prefix cache on, like the kvtier systems) + LMCache MP server, engine_driven with its
              shared-memory pool, chunk 256 (LMCache's best CPU mode, shared reference engines-and-services.md §6),
              run from LMCache's own environment (.venv-lmc, scripts/setup-lmcache.sh); without it the LMCache row
              is absent and the benchmark says so

    .venv/bin/python benchmarks/multi_round_qa.py [--users 4 --rounds 3 --max-tokens 16] [--systems ...]

Writes benchmarks/multi_round_qa.csv and .png. ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is pinned to the same value for
every system (default 0, as in §6's primary table).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "integration"))

from test_vllm_support import (  # noqa: E402 (after the sys.path line above)
    DOC_FILE,
    LMCACHE_PYTHON,
    REPO,
    KVTierServer,
    LMCacheServer,
    free_port,
    lmcache_missing,
    model_dir,
    require_vllm,
    stop_process,
)

# name: (vLLM prefix cache on, cache server: None, ("kvtier", chunk) or ("lmcache", chunk))
SYSTEMS = {"apc_on": (True, None), "apc_off": (False, None), "kvtier_256": (True, ("kvtier", 256)),
           "lmcache_shm_256": (True, ("lmcache", 256)), "kvtier_128": (True, ("kvtier", 128))}
QUESTIONS = ["What does this passage say about copying?", "Summarise the obligations it imposes.",
             "Who is responsible for warranty?", "What happens if the terms are violated?",
             "Does it mention patents? Answer briefly."]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free 127.0.0.1 port; stopped by pid."""

    def __init__(self, work: Path, name: str, prefix_caching: bool, kvtier_url: str | None,
                 lmcache: LMCacheServer | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        python = str(LMCACHE_PYTHON) if lmcache else require_vllm()
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir()),
                "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port), "--dtype",
                "float32", "--enforce-eager", "--max-model-len", "4096", "--seed", "0",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if kvtier_url:
            argv += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvtier.server_url": kvtier_url}})]
        if lmcache:  # flags of shared reference engines-and-services.md §6
            argv += ["--disable-hybrid-kv-cache-manager", "--kv-transfer-config", json.dumps({
                "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": lmcache.extra_config()})]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", **(lmcache.worker_env() if lmcache else {})}
        self.log_path = work / f"{name}-vllm.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.base + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("vLLM not ready after 600 s")

    def stop(self) -> None:
        stop_process(self.proc, 60)


async def user_session(client: httpx.AsyncClient, base: str, system: str, passage: str, rounds: int,
                       max_tokens: int, user: int, out: list) -> None:
    history = f"{system}\n\nDocument excerpt for user {user}:\n{passage}\n"
    for r in range(rounds):
        history += f"\nQuestion: {QUESTIONS[(user + r) % len(QUESTIONS)]}\nAnswer:"
        body = {"model": "smollm2", "prompt": history, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True}
        started = time.perf_counter()
        ttft, text, n = None, "", 0
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                piece = json.loads(line[6:])["choices"][0]["text"]
                if ttft is None:
                    ttft = time.perf_counter() - started
                text += piece
                n += 1
        out.append({"user": user, "round": r, "ttft_s": ttft, "seconds": time.perf_counter() - started, "tokens": n})
        history += text


async def run_load(base: str, system: str, passages: list[str], rounds: int, max_tokens: int) -> tuple[list, float]:
    out: list = []
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(user_session(client, base, system, p, rounds, max_tokens, u, out)
                               for u, p in enumerate(passages)))
        return out, time.perf_counter() - started


def plot(rows: list[dict], path: Path, users: int, rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r["system"] for r in rows]
    a.bar([i - 0.2 for i in range(len(rows))], [float(r["mean_ttft_s"]) for r in rows], 0.4, label="mean")
    a.bar([i + 0.2 for i in range(len(rows))], [float(r["p90_ttft_s"]) for r in rows], 0.4, label="p90")
    a.set_xticks(range(len(rows)), names, rotation=20, ha="right")
    a.set_ylabel("TTFT (s)")
    a.legend()
    b.bar(range(len(rows)), [float(r["tokens_per_s"]) for r in rows])
    b.set_xticks(range(len(rows)), names, rotation=20, ha="right")
    b.set_ylabel("generated tokens / s")
    r = rows[0].get("reserved_cpu", "?")
    fig.suptitle(f"multi-round QA: {users} users x {rounds} rounds, vLLM CPU, SmolLM2-135M fp32, "
                 f"VLLM_CPU_NUM_OF_RESERVED_CPU={r}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-chars", type=int, default=4000, help="shared system prompt length in characters")
    ap.add_argument("--passage-chars", type=int, default=2000, help="per-user passage length in characters")
    ap.add_argument("--reserved-cpu", default="0", help="VLLM_CPU_NUM_OF_RESERVED_CPU for every system")
    ap.add_argument("--out", default=str(HERE / "multi_round_qa"))
    args = ap.parse_args()
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpu
    doc = Path(DOC_FILE).read_text()
    system = "You answer questions about a software license.\n" + doc[:args.system_chars]
    passages = [doc[args.system_chars + u * args.passage_chars: args.system_chars + (u + 1) * args.passage_chars]
                for u in range(args.users)]
    names = args.systems.split(",")
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    absent = {}
    reason = lmcache_missing()
    if reason:
        absent = {n: reason for n in names if (SYSTEMS[n][1] or ("",))[0] == "lmcache"}
        print(f"LMCache rows will be ABSENT ({', '.join(absent) or 'none requested'}): {reason}", flush=True)
    print(f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpu}; load average {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mrqa-") as tmp:
        work = Path(tmp)
        for name in [n for n in names if n not in absent]:
            prefix_caching, cache = SYSTEMS[name]
            if cache is None:
                kv = None
            elif cache[0] == "kvtier":
                kv = KVTierServer(work, chunk_size=cache[1])
            else:
                kv = LMCacheServer(work, chunk_size=cache[1], mode="engine_driven", shm=True)
            try:
                srv = VLLMServer(work, name, prefix_caching, kv.url if isinstance(kv, KVTierServer) else None,
                                 lmcache=kv if isinstance(kv, LMCacheServer) else None)
                try:
                    records, wall = asyncio.run(run_load(srv.base, system, passages, args.rounds, args.max_tokens))
                finally:
                    srv.stop()
            finally:
                if kv:
                    kv.stop()
            ttfts = sorted(r["ttft_s"] for r in records)
            p90 = ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))]
            rows.append({"system": name, "users": args.users, "rounds": args.rounds,
                         "mean_ttft_s": round(statistics.mean(ttfts), 4), "p90_ttft_s": round(p90, 4),
                         "tokens_per_s": round(sum(r["tokens"] for r in records) / wall, 3), "wall_s": round(wall, 2),
                         "reserved_cpu": args.reserved_cpu})
            print(rows[-1], flush=True)
    if not rows:
        print("no system measured")
        return 1
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, Path(args.out + ".png"), args.users, args.rounds)
    base = next((r for r in rows if r["system"] == "apc_on"), None)
    for r in rows:
        if base and r is not base:
            print(f"{r['system']}: mean TTFT / apc_on = {r['mean_ttft_s'] / base['mean_ttft_s']:.3f}")
    lmc = next((r for r in rows if r["system"] == "lmcache_shm_256"), None)
    for r in rows:
        if lmc and r["system"].startswith("kvtier_"):
            print(f"{r['system']}: mean TTFT / lmcache_shm_256 = {r['mean_ttft_s'] / lmc['mean_ttft_s']:.3f}; "
                  f"p90 = {r['p90_ttft_s'] / lmc['p90_ttft_s']:.3f}; "
                  f"throughput = {r['tokens_per_s'] / lmc['tokens_per_s']:.3f}")
    for name, why in absent.items():
        print(f"ABSENT: {name}: {why}")
    print(f"load average at the end {os.getloadavg()}; wrote {args.out}.csv and {args.out}.png")
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
