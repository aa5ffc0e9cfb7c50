"""Two nodes behind NVIDIA Dynamo's frontend: KV-aware routing that sees kvtier's tiers vs round-robin.

The deployment is ``examples/dynamo/two_nodes.sh`` (kvtier_harness/dynamo_deploy.py): two kvtier servers, each with
its own ``dynamo.vllm`` worker (KVTierConnector; the worker announces what its server holds in its own KV event
stream), one ``dynamo.frontend``. It runs twice in the same invocation, once per router mode (``--router-mode kv``
and ``round-robin``), with the same prompts in the same order.

Workload: N users, R rounds. A user's first prompt is that user's own context (real text nobody else has,
benchmarks/corpus.py) and a question; each later round appends the previous answer and a new question, so
every round after the first repeats the user's whole earlier prompt. Requests are sent one at a time, streamed
(greedy); TTFT is the time to the first streamed token. Each vLLM's KV cache (``--engine-kv-tokens``) is
smaller than the part of the working set that lands on its node, so vLLM's prefix cache evicts a context before
its user's next round: a later round is fast only if it reaches the node whose kvtier holds its context.

Where the prompt tokens of rounds after the first came from: vLLM's ``vllm:prompt_tokens_by_source_total`` on
both workers (``local_cache_hit``: vLLM's prefix cache; ``external_kv_transfer``: loaded by the kvtier connector;
``local_compute``: recomputed), the loaded part split into kvtier L2 (chunks the servers promoted from L2,
``kvtier_l2_promoted_chunks_total`` x chunk size) and kvtier L1 (the rest).

    .venv/bin/python benchmarks/dynamo_routing.py [--users 7 --rounds 3 --context-tokens 1024 --max-tokens 16]
        [--engine-kv-tokens 3072] [--shared-l2] [--quick]

``--shared-l2`` puts one Redis L2 under both servers: a fresh ``redis-server`` (no persistence) on a free
127.0.0.1 port for each router mode, so neither run finds the other's chunks.

Writes benchmarks/results/dynamo_routing.csv (one row per router mode) and docs/img/dynamo_routing.png (``--shared-l2``:
dynamo_routing_shared_l2.csv / .png; --quick: under /tmp), and prints kv / round-robin mean TTFT of rounds after
the first. Needs scripts/setup-vllm.sh and
scripts/setup-dynamo.sh. Exit status 0, or 1 when a run failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from corpus import Corpus
from kvtier_harness.dynamo_deploy import REPO, TwoNodes
from kvtier_harness.metrics import scrape
from kvtier_harness.vllm import model_dir
from report import RESULTS_DIR


SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")
QUESTIONS = ["What is this text about? Answer in one sentence.", "Which names or programs does it mention?",
             "Summarise the most important rule it describes.", "What would a user need to know from it?"]
CHUNK_TOKENS = 256  # two_nodes.sh's chunk size


def stream(client: httpx.Client, dep: TwoNodes, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: TTFT (seconds), text, the node that served it, prompt and cached tokens."""
    started = time.perf_counter()
    ttft, text, usage, answer = None, [], {}, {}
    with client.stream("POST", f"{dep.url}/v1/completions",
                       json=dep.body(prompt, max_tokens=max_tokens, stream=True)) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"completion failed: {reply.status_code} {reply.read().decode()}")
        for line in reply.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - started
                text.append(choice.get("text") or "")
            usage = chunk.get("usage") or usage
            if chunk.get("nvext"):
                answer["nvext"] = chunk["nvext"]
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_seconds": ttft if ttft is not None else time.perf_counter() - started, "text": "".join(text),
            "node": dep.node_of(answer), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens")}


def counters(dep: TwoNodes) -> dict[str, float]:
    """Prompt tokens by source summed over both workers, and the servers' L2 promotions (tokens)."""
    out = dict.fromkeys(SOURCES, 0.0)
    for node in ("a", "b"):
        samples = scrape(dep.metrics_url[node])
        for (name, labels), value in samples.items():
            if name == "vllm:prompt_tokens_by_source_total":
                source = dict(labels).get("source")
                if source in out:
                    out[source] += value
    out["l2_tokens"] = sum(dep.kvtier_metric(n, "kvtier_l2_promoted_chunks_total") for n in ("a", "b")) * CHUNK_TOKENS
    return out


@contextlib.contextmanager
def fresh_redis(work: Path):
    """A private ``redis-server`` on a free 127.0.0.1 port, no persistence; yields its URL; stopped by pid."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/install-services.sh)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(work / "redis.log", "w") as log:
        proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                 "--appendonly", "no", "--dir", str(work)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(work / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(30)


def run_mode(mode: str, args, contexts: list[str], work: Path) -> dict:
    """Start the deployment with ``--router-mode mode``, run the workload, stop it. Returns the summary row."""
    with contextlib.ExitStack() as stack:
        l2 = stack.enter_context(fresh_redis(work)) if args.shared_l2 else None
        return _run_mode(mode, args, contexts, work, l2)


def _run_mode(mode: str, args, contexts: list[str], work: Path, l2: str | None) -> dict:
    dep = TwoNodes(work, shared_l2=l2, router_mode=mode, engine_kv_tokens=args.engine_kv_tokens,
                   max_model_len=args.max_model_len, l1_size_gb=args.l1_size_gb)
    records: list[dict] = []
    try:
        history = [f"### Document\n{c}\n" for c in contexts]
        with httpx.Client(timeout=600) as client:
            before = None
            for round_ in range(args.rounds):
                if round_ == 1:
                    before = counters(dep)
                for user in range(args.users):
                    history[user] += f"\n### Question: {QUESTIONS[(user + round_) % len(QUESTIONS)]}\n### Answer:"
                    got = stream(client, dep, history[user], args.max_tokens)
                    history[user] += got["text"]
                    records.append({"mode": mode, "round": round_, "user": user, **got})
            after = counters(dep)
    finally:
        dep.stop()
    later = [r for r in records if r["round"] > 0]
    ttfts = sorted(r["ttft_seconds"] for r in later)
    delta = {k: after[k] - before[k] for k in after} if before is not None else dict.fromkeys(after, 0.0)
    prompt_total = sum(delta[s] for s in SOURCES) or 1.0
    l2 = min(delta["l2_tokens"], delta["external_kv_transfer"])
    row = {"router_mode": mode, "users": args.users, "rounds": args.rounds, "context_tokens": args.context_tokens,
           "engine_kv_tokens": args.engine_kv_tokens, "shared_l2": bool(args.shared_l2),
           "first_round_mean_ttft_seconds": round(statistics.mean(r["ttft_seconds"] for r in records
                                                                  if r["round"] == 0), 4),
           "later_mean_ttft_seconds": round(statistics.mean(ttfts), 4),
           "later_p90_ttft_seconds": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 4),
           "later_prompt_tokens": int(prompt_total),
           "share_vllm_cache": round(delta["local_cache_hit"] / prompt_total, 4),
           "share_kvtier_l1": round((delta["external_kv_transfer"] - l2) / prompt_total, 4),
           "share_kvtier_l2": round(l2 / prompt_total, 4),
           "share_recomputed": round(delta["local_compute"] / prompt_total, 4),
           "later_same_node_as_first": round(sum(r["node"] == records[r["user"]]["node"] for r in later)
                                             / len(later), 4)}
    row["share_from_a_cache"] = round(1 - row["share_recomputed"], 4)
    print(json.dumps(row), flush=True)
    (work / "requests.json").write_text(json.dumps(records, indent=1))
    return row


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    modes = [r["router_mode"] for r in rows]
    left.bar([m + "\nmean" for m in modes], [r["later_mean_ttft_seconds"] for r in rows], color="#4477aa")
    left.bar([m + "\np90" for m in modes], [r["later_p90_ttft_seconds"] for r in rows], color="#88aacc")
    left.set_ylabel("TTFT of rounds after the first (s)")
    parts = [("share_vllm_cache", "vLLM cache", "#228833"), ("share_kvtier_l1", "kvtier L1", "#4477aa"),
             ("share_kvtier_l2", "kvtier L2", "#66ccee"), ("share_recomputed", "recomputed", "#cc3311")]
    bottom = [0.0] * len(rows)
    for key, label, color in parts:
        values = [r[key] for r in rows]
        right.bar(modes, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_ylabel("share of prompt tokens (rounds > 1)")
    right.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Two nodes behind Dynamo: {rows[0]['users']} users x {rows[0]['rounds']} rounds, "
                 f"{rows[0]['context_tokens']}-token contexts, vLLM KV {rows[0]['engine_kv_tokens']} tokens/node"
                 + (", shared Redis L2" if rows[0]["shared_l2"] else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=7, help="an odd number makes round-robin alternate a user's node")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--engine-kv-tokens", type=int, default=3072, help="each vLLM's KV cache, in tokens")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--l1-size-gb", type=float, default=1.0)
    ap.add_argument("--shared-l2", action="store_true", help="one fresh Redis L2 under both kvtier servers")
    ap.add_argument("--modes", default="kv,round-robin")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 users, 2 rounds, 512-token contexts; files under /tmp")
    args = ap.parse_args()
    if args.quick:
        args.users, args.rounds, args.context_tokens = 3, 2, 512
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()), local_files_only=True)
    corpus = Corpus(tokenizer, seed=args.seed)
    contexts = [corpus.draw(args.context_tokens) for _ in range(args.users)]
    out_dir = Path(tempfile.mkdtemp(prefix="dynamo-routing-")) if args.quick else None
    name = "dynamo_routing_shared_l2" if args.shared_l2 else "dynamo_routing"
    csv_path = (out_dir or RESULTS_DIR) / f"{name}.csv"
    png_path = (out_dir or REPO / "docs" / "img") / f"{name}.png"
    rows, failed = [], False
    for mode in args.modes.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"dynamo-routing-{mode}-"))
        try:
            rows.append(run_mode(mode, args, contexts, work))
        except Exception as exc:  # noqa: BLE001 - report, go on with the other mode
            failed = True
            print(f"{mode}: failed: {exc} (logs in {work})", file=sys.stderr)
    if rows:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        chart(rows, png_path)
        print(f"wrote {csv_path} and {png_path}")
    by = {r["router_mode"]: r for r in rows}
    if "kv" in by and "round-robin" in by:
        ratio = by["kv"]["later_mean_ttft_seconds"] / by["round-robin"]["later_mean_ttft_seconds"]
        print(f"kv / round-robin mean TTFT of rounds after the first: {ratio:.3f}x "
              f"(p90 {by['kv']['later_p90_ttft_seconds'] / by['round-robin']['later_p90_ttft_seconds']:.3f}x); "
              f"prompt tokens from a cache: kv {by['kv']['share_from_a_cache']:.1%}, "
              f"round-robin {by['round-robin']['share_from_a_cache']:.1%}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
