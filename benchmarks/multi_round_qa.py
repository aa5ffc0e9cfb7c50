"""Multi-user, multi-round QA on vLLM's OpenAI server: vLLM alone vs vLLM + LMCache vs vLLM + kvtier.

N users talk to one vLLM server at the same time, R rounds each. A user's prompt is a short system prompt shared by
everybody, then that user's own context (real text nobody else has: benchmarks/corpus.py draws it from the licences
and package documentation Debian ships, no paragraph twice), then every earlier question and answer. Requests are
streamed (``ignore_eos``, greedy); TTFT is the time to the first streamed token.

The working set (every user's last prompt plus answer, the system prompt once; SmolLM2 tokenizer) sizes vLLM's KV
cache (``--kv-cache-memory-bytes``; the capacity reported is the one vLLM logs) in two regimes, run in turn:
  fits      capacity = working set / --fits-ratio (default 0.5): all fits in vLLM's cache, an offload tier only costs
  overflow  capacity = working set / --overflow-ratio (default 3, allowed 2-4): vLLM evicts a user's context before
            the user's next round, the case an offload tier exists for
In each regime the same prompts go, in the same order, to:
  vllm      vLLM alone, prefix caching on
  lmcache   vLLM (prefix caching on) + LMCache MP server, engine_driven with its shared-memory pool (its best CPU
            mode, shared reference engines-and-services.md §6), run from LMCache's own .venv-lmc
            (scripts/setup-lmcache.sh); without it the row is absent and the script says so
  kvtier    vLLM (prefix caching on) + kvtier server + KVTierConnector
  kvtier_lazy  the same with ``kvtier.store_after_seen`` 2 (a chunk is stored at its second sighting); not run
            unless asked for in --systems

kvtier and LMCache get the same chunk size and L1 size; every vLLM the same VLLM_CPU_NUM_OF_RESERVED_CPU. Where
prompt tokens came from is vLLM's ``vllm:prompt_tokens_by_source_total`` (local_cache_hit, external_kv_transfer,
local_compute; ``counters_agree``: the per-request cached_tokens summed to the first two); next to it the cache
servers' lookup counters (kvtier ``kvtier_lookup_[hit_]tokens_total``, LMCache ``lmcache_mp_lookup_*_tokens_total``),
which count what the connector asked.

    .venv/bin/python benchmarks/multi_round_qa.py [--quick] [--repeat N] [--regimes fits,overflow]
        [--systems vllm,lmcache,kvtier[,kvtier_lazy]] [--users 8 --rounds 3 --context-tokens 2048 --max-tokens 32] [--plan]

Writes benchmarks/results/multi_round_qa.csv (one row per regime and system) and docs/img/multi_round_qa.png (--quick:
files under /tmp) and prints kvtier / vLLM alone and kvtier / LMCache per regime. Exit status: 0, 1 when a system
failed or is absent, 2 when the configuration cannot be run as asked (not enough distinct text, a ratio out of its
range, a working set larger than the cache servers' L1).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import httpx

from charts import multi_round_qa_chart
from corpus import Corpus, CorpusExhausted, candidate_files
from kvtier_harness.metrics import total
from kvtier_harness.vllm import REPO, ServerProcessForVLLM, LMCacheServer, lmcache_missing, model_dir
from report import RESULTS_DIR, Refused, commit_line, finish, mean, nearest_rank, positive
from vllm_procs import VLLM_BLOCK_TOKENS, VLLMServer, kv_bytes_per_token, log_problems, lookup_counters, send


SYSTEMS = ("vllm", "lmcache", "kvtier", "kvtier_lazy")
DEFAULT_SYSTEMS = "vllm,lmcache,kvtier"
KVTIER_EXTRA = {"kvtier": {}, "kvtier_lazy": {"kvtier.store_after_seen": 2}}
REGIMES = ("fits", "overflow")
OVERFLOW_RANGE = (2.0, 4.0)
QUESTIONS = ["What is this text about? Answer in one sentence.", "Which names, programs or versions does it mention?",
             "Summarise the most important change or rule it describes.", "What would a user of this software need "
             "to know from it?", "Is anything in it about licences or copying? Answer briefly.",
             "List three facts from the text."]
VLLM_SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")


@dataclass
class Workload:
    """The users' first prompts and the token counts the regimes are sized from (SmolLM2 tokenizer)."""

    system_prompt: str
    contexts: list[str]
    rounds: int
    max_tokens: int
    system_tokens: int
    working_set_tokens: int  # system prompt once + per user: context + every question + every answer
    longest_tokens: int  # the longest user's last prompt + its answer

    def first_prompt(self, user: int) -> str:
        return f"{self.system_prompt}\n\n### Document\n{self.contexts[user]}\n"

    @staticmethod
    def question(user: int, round_: int) -> str:
        return f"\n### Question: {QUESTIONS[(user + round_) % len(QUESTIONS)]}\n### Answer:"


def build_workload(args, tokenizer) -> Workload:
    """Draw the system prompt and one distinct context per user; raises CorpusExhausted."""
    files = candidate_files(Path(args.corpus)) if args.corpus else None
    corpus = Corpus(tokenizer, seed=args.seed, files=files)
    system = "You answer questions about the document below, briefly and exactly.\n" + corpus.draw(args.system_tokens)
    contexts = [corpus.draw(args.context_tokens) for _ in range(args.users)]
    n = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    sys_tokens = n(system)
    wl = Workload(system, contexts, args.rounds, args.max_tokens, sys_tokens, 0, 0)
    per_user = [n(wl.first_prompt(u)) - sys_tokens + sum(n(wl.question(u, r)) + args.max_tokens for r in range(args.rounds))
                for u in range(args.users)]
    wl.working_set_tokens = sys_tokens + sum(per_user)
    wl.longest_tokens = sys_tokens + max(per_user)
    return wl


async def user_session(client: httpx.AsyncClient, base: str, wl: Workload, user: int, out: list) -> None:
    prompt = wl.first_prompt(user)
    for r in range(wl.rounds):
        prompt += wl.question(user, r)
        got = await send(client, base, prompt, wl.max_tokens, None)
        out.append({"user": user, "round": r, **{k: v for k, v in got.items() if k != "text"},
                    "prompt_sha": hashlib.sha256(prompt.encode()).hexdigest()})
        prompt += got["text"]


async def run_load(srv: VLLMServer, cache, wl: Workload) -> tuple[list[dict], float, dict, dict]:
    """Warm vLLM up, read the counters, run every user at once. Returns records, wall seconds, counters before."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(900)) as client:
        # the first request of a fresh vLLM pays one-off costs; shorter than a block, so nothing gets cached
        warm = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
        (await client.post(srv.base + "/v1/completions", json=warm)).raise_for_status()
        before, cache_before = srv.settled_metrics(1), lookup_counters(cache)
        out: list[dict] = []
        started = time.perf_counter()
        await asyncio.gather(*(user_session(client, srv.base, wl, u, out) for u in range(len(wl.contexts))))
        return out, time.perf_counter() - started, before, cache_before


def system_config(system: str, kv_blocks: int, args) -> str:
    """How ``system`` is configured in this run, in one line (printed, and the CSV's ``config`` column)."""
    vllm = (f"vLLM {kv_blocks * VLLM_BLOCK_TOKENS} KV tokens, prefix caching on, chunked prefill, "
            f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpu}")
    if system == "lmcache":
        return (f"{vllm}; LMCacheMPConnector (async lookup and load, blocks held until saved) + lmcache server "
                f"engine_driven, shared-memory L1 {args.l1_size_gb} GB allocated up front (--no-l1-use-lazy), LRU, "
                f"chunk {args.chunk_size}, no L2")
    if system in KVTIER_EXTRA:
        extra = {"kvtier.store_after_seen": 1, **KVTIER_EXTRA[system]}
        return (f"{vllm}; KVTierConnector (synchronous lookup and load, blocks freed at once; "
                f"{', '.join(f'{k} {v}' for k, v in extra.items())}) + kvtier server, shared-memory L1 "
                f"{args.l1_size_gb} GB, LRU, chunk {args.chunk_size}, no L2")
    return vllm


def run_system(system: str, regime: str, kv_blocks: int, args, wl: Workload, work: Path, bytes_per_token: int,
               tag: str) -> dict:
    """Start the cache server (if any) and vLLM, run the load, stop both. Returns one measurement (see ``summarise``)."""
    cache = None
    if system in KVTIER_EXTRA:
        cache = ServerProcessForVLLM(work, chunk_size=args.chunk_size, l1=f"{args.l1_size_gb}GB")
    elif system == "lmcache":
        cache = LMCacheServer(work, chunk_size=args.chunk_size, mode="engine_driven", shm=True, l1_gb=args.l1_size_gb)
    try:
        load_1m = os.getloadavg()[0]
        srv = VLLMServer(work, tag, kv_cache_bytes=kv_blocks * VLLM_BLOCK_TOKENS * bytes_per_token,
                         max_model_len=args.max_model_len, reserved_cpu=args.reserved_cpu, cache=cache,
                         kvtier_extra=KVTIER_EXTRA.get(system))
        try:
            records, wall, before, cache_before = asyncio.run(run_load(srv, cache, wl))
            after = srv.settled_metrics(total(before, "vllm:request_success_total") + len(records))
            cache_after = lookup_counters(cache)
        finally:
            srv.stop()
    finally:
        if cache is not None:
            cache.stop()
    (work / f"{tag}-requests.json").write_text(json.dumps(records, indent=1))
    problems = log_problems([cache.log_path] if cache else [])
    for line in problems:
        print(f"  {system} server log: {line}", flush=True)
    delta = lambda name, **labels: total(after, name, **labels) - total(before, name, **labels)  # noqa: E731
    return {"records": records, "wall": wall, "load_1m": load_1m, "problems": len(problems),
            "config": system_config(system, kv_blocks, args),
            "by_source": {s: delta("vllm:prompt_tokens_by_source_total", source=s) for s in VLLM_SOURCES},
            "preemptions": delta("vllm:num_preemptions_total"), "kv_capacity_tokens": srv.kv_capacity_tokens,
            "core_ids": srv.core_ids, "cache": {k: cache_after[k] - cache_before[k] for k in cache_after}}


def summarise(regime: str, system: str, runs: list[dict], args, wl: Workload) -> dict:
    """The CSV row of one regime and system: the requests of every repeat pooled, vLLM's counters summed."""
    records = [r for run in runs for r in run["records"]]
    wall = sum(run["wall"] for run in runs)
    src = {s: sum(run["by_source"][s] for run in runs) for s in VLLM_SOURCES}
    prompt = sum(src.values())
    ttfts = sorted(r["ttft_seconds"] for r in records)
    last = [r for r in runs[0]["records"] if r["round"] == wl.rounds - 1]
    ws = wl.system_tokens + sum(r["prompt_tokens"] + r["completion_tokens"] - wl.system_tokens for r in last)
    capacity = runs[0]["kv_capacity_tokens"]
    return {
        "regime": regime, "system": system, "config": runs[0]["config"], "users": len(wl.contexts), "rounds": wl.rounds,
        "context_tokens": args.context_tokens, "max_tokens": wl.max_tokens, "chunk_size": args.chunk_size,
        "repeats": len(runs), "working_set_tokens": ws, "kv_capacity_tokens": capacity,
        "working_set_ratio": round(ws / capacity, 3), "requests": len(records),
        "mean_ttft_seconds": mean(ttfts),
        "p90_ttft_seconds": nearest_rank(ttfts, 0.9),
        "mean_ttft_round1_seconds": mean([r["ttft_seconds"] for r in records if r["round"] == 0]),
        "mean_ttft_later_rounds_seconds": mean([r["ttft_seconds"] for r in records if r["round"] > 0]),
        "requests_per_second": round(len(records) / wall, 4),
        "output_tokens_per_second": round(sum(r["completion_tokens"] for r in records) / wall, 3),
        "wall_seconds": round(wall, 2),
        "prompt_tokens": int(prompt),
        "share_vllm_cache": round(src["local_cache_hit"] / prompt, 4),
        "share_offload": round(src["external_kv_transfer"] / prompt, 4),
        "share_recomputed": round(src["local_compute"] / prompt, 4),
        # the per-request usage must tell the same story as the counters; False flags a row to distrust
        "counters_agree": sum(r["prompt_tokens"] for r in records) == prompt
        and sum(r["cached_tokens"] for r in records) == src["local_cache_hit"] + src["external_kv_transfer"],
        "preemptions": int(sum(run["preemptions"] for run in runs)),
        **{f"cache_lookup_{k}_tokens": int(sum(run["cache"][k] for run in runs)) for k in runs[0]["cache"]},
        "prompts_sha": hashlib.sha256("".join(sorted(r["prompt_sha"] for r in records)).encode()).hexdigest()[:12],
        "server_log_problems": sum(run["problems"] for run in runs),
        "reserved_cpu": args.reserved_cpu, "vllm_core_ids": " ".join(sorted({run["core_ids"] for run in runs})),
        "load_1m": " ".join(f"{run['load_1m']:.2f}" for run in runs),
    }



def kv_blocks_for(regime: str, args, wl: Workload) -> int:
    """vLLM KV cache blocks that give ``regime``'s working-set ratio; raises Refused when none can."""
    ratio = args.fits_ratio if regime == "fits" else args.overflow_ratio
    blocks = round(wl.working_set_tokens / ratio / VLLM_BLOCK_TOKENS)
    need = math.ceil(args.max_model_len / VLLM_BLOCK_TOKENS) + 1  # vLLM keeps one block back (its null block)
    if blocks < need:
        raise Refused(f"regime {regime}: a working set of {wl.working_set_tokens} tokens at ratio {ratio} leaves vLLM "
                      f"{blocks * VLLM_BLOCK_TOKENS} tokens of KV cache, less than its longest request needs "
                      f"({args.max_model_len}); raise --users or lower --context-tokens")
    got = wl.working_set_tokens / (blocks * VLLM_BLOCK_TOKENS)
    if regime == "overflow" and not OVERFLOW_RANGE[0] <= got <= OVERFLOW_RANGE[1]:
        raise Refused(f"regime overflow: working set / vLLM capacity would be {got:.2f}, outside "
                      f"{OVERFLOW_RANGE[0]:g}-{OVERFLOW_RANGE[1]:g}; choose --overflow-ratio in that range")
    if regime == "fits" and got > 1:
        raise Refused(f"regime fits: working set / vLLM capacity would be {got:.2f} > 1; choose --fits-ratio <= 1")
    return blocks


def print_ratios(rows: list[dict]) -> None:
    """kvtier against vLLM alone and against LMCache, per regime, with issue 12's targets."""
    if len({r["vllm_core_ids"] for r in rows}) > 1:
        print(f"WARNING: vLLM bound different cores in different runs: {sorted({r['vllm_core_ids'] for r in rows})}")
    targets = {("overflow", "vllm"): "<= 0.6", ("overflow", "lmcache"): "<= 0.85", ("fits", "vllm"): "<= 1.03"}
    for regime in REGIMES:
        by = {r["system"]: r for r in rows if r["regime"] == regime}
        if by:
            same = len({r["prompts_sha"] for r in by.values()}) == 1
            print(f"{regime}: the same prompts went to every system: {'yes' if same else 'NO (answers differed)'}")
        for kv, base in ((kv, base) for kv in KVTIER_EXTRA for base in ("vllm", "lmcache")):
            k, b = by.get(kv), by.get(base)
            if k and b:
                print(f"{regime}: {kv} / {base}: mean TTFT {k['mean_ttft_seconds'] / b['mean_ttft_seconds']:.3f} "
                      f"(issue 12 target {targets.get((regime, base), 'none')}), p90 TTFT "
                      f"{k['p90_ttft_seconds'] / b['p90_ttft_seconds']:.3f}, output tokens/s "
                      f"{k['output_tokens_per_second'] / b['output_tokens_per_second']:.3f}")


FULL = {"users": 8, "rounds": 3, "context_tokens": 2048, "system_tokens": 256, "max_tokens": 32}
QUICK = {"users": 5, "rounds": 2, "context_tokens": 512, "system_tokens": 64, "max_tokens": 8}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"a short smoke run: {QUICK}, files under /tmp")
    for key, value in FULL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=positive, default=None,
                        help=f"default {value} ({QUICK[key]} with --quick)")
    ap.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated, of {','.join(REGIMES)}")
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--fits-ratio", type=float, default=0.5, help="working set / vLLM KV capacity in regime fits")
    ap.add_argument("--overflow-ratio", type=float, default=3.0, help="working set / vLLM KV capacity in regime overflow (2-4)")
    ap.add_argument("--chunk-size", type=positive, default=256, help="tokens per chunk, kvtier and LMCache alike")
    ap.add_argument("--l1-size-gb", type=positive, default=2, help="L1 of the kvtier and LMCache servers (GB)")
    ap.add_argument("--seed", type=int, default=0, help="picks the documents the contexts come from")
    ap.add_argument("--corpus", default=None, help="draw the texts from every file under this folder instead of "
                    "Debian's licences and package documentation")
    ap.add_argument("--reserved-cpu", default="0", help="VLLM_CPU_NUM_OF_RESERVED_CPU for every vLLM")
    ap.add_argument("--csv", default=None, help="default benchmarks/results/multi_round_qa.csv (--quick: under /tmp)")
    ap.add_argument("--chart", default=None, help="default docs/img/multi_round_qa.png (--quick: under /tmp)")
    ap.add_argument("--work", default=None, help="keep the vLLM and cache server logs in this folder")
    ap.add_argument("--repeat", type=positive, default=1, help="measure every regime and system this many times "
                    "(interleaved); the CSV pools their requests")
    ap.add_argument("--plan", action="store_true", help="print the working set and vLLM's KV sizes, run nothing")
    args = ap.parse_args()
    for key, value in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    out = Path(tempfile.gettempdir()) / "multi_round_qa-quick" if args.quick else None
    args.csv = Path(args.csv or (out / "multi_round_qa.csv" if out else RESULTS_DIR / "multi_round_qa.csv"))
    args.chart = Path(args.chart or (out / "multi_round_qa.png" if out else REPO / "docs" / "img" / "multi_round_qa.png"))
    if args.fits_ratio <= 0 or args.overflow_ratio <= 0:
        ap.error("--fits-ratio and --overflow-ratio must be positive")
    if args.corpus and not Path(args.corpus).is_dir():
        ap.error(f"--corpus {args.corpus} is not a folder")
    args.regimes, args.systems = args.regimes.split(","), args.systems.split(",")
    for given, known, what in ((args.regimes, REGIMES, "regime"), (args.systems, SYSTEMS, "system")):
        if set(given) - set(known):
            ap.error(f"unknown {what}(s) {sorted(set(given) - set(known))}; choose from {','.join(known)}")
    return args


def measure_all(args, wl: Workload, blocks: dict[str, int], bytes_per_token: int) -> tuple[dict, dict]:
    """Every (regime, system) ``args.repeat`` times. Returns their measurements and {what: why} of those that failed."""
    runs: dict[tuple[str, str], list[dict]] = {}
    absent: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="mrqa-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for rep in range(args.repeat):  # repeats interleave, so a slow spell of the machine hits every system
            for regime in args.regimes:
                for system in args.systems:
                    reason = lmcache_missing() if system == "lmcache" else None
                    if reason:
                        absent[f"{regime}/{system}"] = reason
                        continue
                    try:
                        m = run_system(system, regime, blocks[regime], args, wl, work, bytes_per_token,
                                       tag=f"{regime}-{system}-{rep}")
                    except Exception as exc:  # one failed system must not lose the others' figures; reported below
                        traceback.print_exc()
                        absent[f"{regime}/{system}/{rep}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        continue
                    runs.setdefault((regime, system), []).append(m)
                    r = summarise(regime, system, [m], args, wl)
                    print(f"{regime:8s} {system:8s} #{rep} KV capacity {r['kv_capacity_tokens']} (working set "
                          f"x{r['working_set_ratio']:.2f}) TTFT mean {r['mean_ttft_seconds']:.3f} s p90 "
                          f"{r['p90_ttft_seconds']:.3f} s (round 1 {r['mean_ttft_round1_seconds']:.3f} s, later "
                          f"{r['mean_ttft_later_rounds_seconds'] or 0:.3f} s), {r['requests_per_second']:.3f} req/s, "
                          f"{r['output_tokens_per_second']:.2f} out tok/s; prompt tokens {r['prompt_tokens']}: vLLM cache "
                          f"{r['share_vllm_cache']:.1%}, offload {r['share_offload']:.1%}, recomputed "
                          f"{r['share_recomputed']:.1%}; preemptions {r['preemptions']}; counters agree "
                          f"{r['counters_agree']}; cores {r['vllm_core_ids']}", flush=True)
    return runs, absent


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    from transformers import AutoTokenizer

    folder = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    bytes_per_token = kv_bytes_per_token(folder)
    try:
        wl = build_workload(args, tokenizer)
        # vLLM rejects a request longer than --max-model-len: the longest one plus a margin for re-tokenised answers
        args.max_model_len = math.ceil((wl.longest_tokens + 64) / VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
        if wl.working_set_tokens * bytes_per_token > 0.8 * args.l1_size_gb * 1e9:
            raise Refused(f"the working set ({wl.working_set_tokens * bytes_per_token / 1e9:.2f} GB of KV) would not "
                          f"fit in 80 % of the cache servers' L1 ({args.l1_size_gb} GB); raise --l1-size-gb")
        blocks = {regime: kv_blocks_for(regime, args, wl) for regime in args.regimes}
    except (CorpusExhausted, Refused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.users} users x {args.rounds} rounds, {args.context_tokens}-token contexts, {args.system_tokens}-token "
          f"shared system prompt, {args.max_tokens}-token answers; {commit_line()}; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpu}; load average {os.getloadavg()}", flush=True)
    print(f"working set {wl.working_set_tokens} tokens ({wl.working_set_tokens * bytes_per_token / 1e9:.2f} GB of KV, "
          f"{bytes_per_token} bytes per token); --max-model-len {args.max_model_len}", flush=True)
    for regime, n in blocks.items():
        print(f"  regime {regime}: vLLM KV cache {n} blocks = {n * VLLM_BLOCK_TOKENS} tokens, working set / capacity "
              f"{wl.working_set_tokens / (n * VLLM_BLOCK_TOKENS):.2f}", flush=True)
        for system in args.systems:
            print(f"    {system}: {system_config(system, n, args)}", flush=True)
    if args.plan:
        return 0
    runs, absent = measure_all(args, wl, blocks, bytes_per_token)
    rows = [summarise(regime, system, got, args, wl) for (regime, system), got in runs.items()]
    return finish(rows, absent, args.csv, args.chart, multi_round_qa_chart, print_ratios, started)


if __name__ == "__main__":
    sys.exit(main())
