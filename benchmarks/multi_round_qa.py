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

    .venv/bin/python benchmarks/multi_round_qa.py [--users 4 --rounds 3 --max-tokens 16] [--systems ...]

Writes benchmarks/multi_round_qa.csv and .png. ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is pinned for every system.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "integration"))

from test_vllm_support import (
    DOC_FILE,
    REPO,
    KVTierServer,
    free_port,
    model_dir,
    require_vllm,
)

SYSTEMS = {"apc_on": (True, None), "apc_off": (False, None), "kvtier_256": (True, 256), "kvtier_128": (True, 128)}
QUESTIONS = ["What does this passage say about copying?", "Summarise the obligations it imposes.",
             "Who is responsible for warranty?", "What happens if the terms are violated?",
             "Does it mention patents? Answer briefly."]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free 127.0.0.1 port; stopped by pid."""

    def __init__(self, work: Path, name: str, prefix_caching: bool, kvtier_url: str | None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [require_vllm(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir()),
                "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port), "--dtype",
                "float32", "--enforce-eager", "--max-model-len", "4096", "--seed", "0",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if kvtier_url:
            argv += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvtier.server_url": kvtier_url}})]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
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
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-chars", type=int, default=4000, help="shared system prompt length in characters")
    ap.add_argument("--passage-chars", type=int, default=2000, help="per-user passage length in characters")
    ap.add_argument("--reserved-cpu", default="1", help="VLLM_CPU_NUM_OF_RESERVED_CPU for every system")
    ap.add_argument("--out", default=str(HERE / "multi_round_qa"))
    args = ap.parse_args()
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpu
    doc = Path(DOC_FILE).read_text()
    system = "You answer questions about a software license.\n" + doc[:args.system_chars]
    passages = [doc[args.system_chars + u * args.passage_chars: args.system_chars + (u + 1) * args.passage_chars]
                for u in range(args.users)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mrqa-") as tmp:
        work = Path(tmp)
        for name in args.systems.split(","):
            prefix_caching, chunk = SYSTEMS[name]
            kv = KVTierServer(work, chunk_size=chunk) if chunk else None
            try:
                srv = VLLMServer(work, name, prefix_caching, kv.url if kv else None)
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
                         "tokens_per_s": round(sum(r["tokens"] for r in records) / wall, 3), "wall_s": round(wall, 2)})
            print(rows[-1], flush=True)
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["system"] for r in rows]
    a.bar([i - 0.2 for i in range(len(rows))], [r["mean_ttft_s"] for r in rows], 0.4, label="mean")
    a.bar([i + 0.2 for i in range(len(rows))], [r["p90_ttft_s"] for r in rows], 0.4, label="p90")
    a.set_xticks(range(len(rows)), names)
    a.set_ylabel("TTFT (s)")
    a.legend()
    b.bar(names, [r["tokens_per_s"] for r in rows])
    b.set_ylabel("generated tokens / s")
    fig.suptitle(f"multi-round QA: {args.users} users x {args.rounds} rounds, vLLM CPU, SmolLM2-135M fp32")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    base = next((r for r in rows if r["system"] == "apc_on"), None)
    for r in rows:
        if base and r is not base:
            print(f"{r['system']}: mean TTFT / apc_on = {r['mean_ttft_s'] / base['mean_ttft_s']:.3f}")
    print(f"wrote {args.out}.csv and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
