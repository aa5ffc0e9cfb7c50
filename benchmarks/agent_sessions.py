"""Agent sessions on vLLM's OpenAI server: vLLM alone vs vLLM + kvtier (plain LRU) vs vLLM + kvtier with retention hints.

Issue 19 §4. Sessions of an agent (16 by default, 4 turns each) share one ~1,500-token system / tool prompt; every
turn after the first adds the model's answer (its tool call) and the tool's output (real text: benchmarks/corpus.py,
no paragraph twice), so a session's history grows. After each turn the session's tool runs for a pause drawn from
a uniform distribution. Sessions start staggered, so a few are in their pauses at any time. Meanwhile one-shot
requests (a long document nobody sends again, no hint) arrive at a steady rate: the traffic that shares an engine
and its cache with agents in production, and that fills an LRU while the agents wait for their tools. The schedule
(benchmarks/agent_plan.py) is fixed by a seed; every system gets the same prompts in the same order, one request at
a time, each sent at its planned time or as soon as the one before it has finished (the answers are the model's
own, greedy, and the script checks they came out the same). TTFT is measured from the send, so it is the engine's
and the cache's time, not a queue's.

  vllm          vLLM alone, prefix caching on
  kvtier_lru    + kvtier server (KVTierConnector), its L1 plain LRU: no request carries a hint
  kvtier_hints  the same server and sizes; the system prompt is sent first with ``kvtier.priority`` 3 (no TTL), each
                turn with ``kvtier.session_id``, ``kvtier.priority`` 1 and ``kvtier.ttl_seconds`` covering the
                longest pause; one-shot documents carry none

Sizes are chosen so the comparison means something, and the script refuses (exit 2) a configuration where it
would not: vLLM's own KV cache holds little more than the longest request, so it keeps nothing across a pause;
kvtier's L1 is too small for all sessions together, large enough for the chunks the hints protect at their peak
within ``l1_retention_max_share``, and small enough that the one-shot documents alone push all of it out within the
shortest pause (the LRU's memory horizon is shorter than every pause).

No L2. With an L2 large enough for everything, a session evicted from L1 would come back from L2 in both kvtier
systems, and the difference measured would be the L2's read time against L1's (small on a local disk here, large
with remote object storage), not the eviction order; with an L2 too small, the same question would repeat one tier
down (L2 capacity eviction honours the same hints: tests/contract). One L1 isolates what hints change: which
chunks are still there when a session comes back.

    .venv/bin/python benchmarks/agent_sessions.py [--quick] [--plan] [--systems vllm,kvtier_lru,kvtier_hints]
        [--sessions 16 --turns 4 ...] [--time-scale 1.0] [--l1-size-gb G]

Reported per system, over the turns after the first: mean, p50 and p90 TTFT, and the prompt tokens of a turn by
where vLLM got them (``vllm:prompt_tokens_by_source_total``, read after every request: vLLM's cache, the connector,
recomputed). Writes benchmarks/results/agent_sessions.csv and docs/img/agent_sessions.png (--quick: under /tmp) and prints
kvtier_hints / kvtier_lru and kvtier_hints / vllm. Exit status: 0; 1 when a system failed; 2 for a configuration
refused as above.
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
from pathlib import Path

import httpx

from agent_plan import AgentShape, Schedule, all_sessions_chunks, flood_horizon_seconds, hint_for, lru_horizon_seconds, \
    plan, prefill_tokens, protected_peak_chunks
from charts import agent_sessions_chart
from corpus import Corpus, CorpusExhausted
from kvtier_harness.metrics import scrape, total
from kvtier_harness.vllm import REPO, ServerProcessForVLLM, model_dir
from report import RESULTS_DIR, Refused, commit_line, finish, mean, nearest_rank
from vllm_procs import VLLM_BLOCK_TOKENS, VLLMServer, kv_bytes_per_token, log_problems, send

SYSTEMS = ("vllm", "kvtier_lru", "kvtier_hints")
SOURCES = {"local_cache_hit": "vllm_cache", "external_kv_transfer": "kvtier", "local_compute": "recomputed"}
KVTIER_COUNTERS = ("kvtier_retention_refused_chunks_total", "kvtier_evicted_chunks_total", "kvtier_store_chunks_total")
FULL = {"sessions": 16, "turns": 4, "live_sessions": 5.0, "pause_min_seconds": 24.0, "pause_max_seconds": 32.0,
        "doc_interval_seconds": 4.5, "system_tokens": 1500, "task_tokens": 160, "tool_tokens": 224,
        "answer_tokens": 24, "doc_tokens": 2048}
QUICK = {"sessions": 8, "turns": 3, "live_sessions": 2.0, "pause_min_seconds": 8.0, "pause_max_seconds": 10.0,
         "doc_interval_seconds": 1.6, "system_tokens": 512, "task_tokens": 128, "tool_tokens": 256,
         "answer_tokens": 8, "doc_tokens": 1024}



class Texts:
    """The real texts of the run: system prompt, one task per session, one tool output per later turn, documents."""

    def __init__(self, args, tokenizer, num_docs: int):
        corpus = Corpus(tokenizer, seed=args.seed)
        self.system = ("You are an agent. Use the tools below to finish the user's task; answer with one tool call per "
                       "turn.\n### Tools and reference\n" + corpus.draw(args.system_tokens))
        self.tasks = [corpus.draw(args.task_tokens) for _ in range(args.sessions)]
        self.tools = [[corpus.draw(args.tool_tokens) for _ in range(1, args.turns)] for _ in range(args.sessions)]
        self.docs = [corpus.draw(args.doc_tokens) for _ in range(num_docs)]
        self.system_tokens = len(tokenizer(self.system, add_special_tokens=False).input_ids)

    def first_prompt(self, session: int) -> str:
        return f"{self.system}\n\n### Task\n{self.tasks[session]}\n### Assistant:"

    def tool_output(self, session: int, turn: int) -> str:
        return f"\n### Tool output\n{self.tools[session][turn - 1]}\n### Assistant:"

    def doc_prompt(self, doc: int) -> str:
        return f"### Document\n{self.docs[doc]}\n### Question: Summarise the document in one sentence.\n### Answer:"


async def run_plan(srv: VLLMServer, system: str, requests, texts: Texts, args) -> list[dict]:
    """Send every planned request in order, one at a time, at its planned time (scaled) or when the one before it
    is done; after each, read vLLM's counters for where its prompt tokens came from."""
    ttl = (args.pause_max_seconds + args.ttl_margin_seconds) * args.time_scale
    prompts: dict[int, str] = {}
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(900)) as client:
        warm = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
        (await client.post(srv.base + "/v1/completions", json=warm)).raise_for_status()
        before = srv.settled_metrics(1)
        done = total(before, "vllm:request_success_total")
        t0 = time.monotonic()
        for req in requests:
            wait = t0 + req.at_seconds * args.time_scale - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if req.kind == "system":
                prompt, max_tokens = texts.system, 1
            elif req.kind == "doc":
                prompt, max_tokens = texts.doc_prompt(req.doc), 4
            else:
                prompt = texts.first_prompt(req.session) if req.turn == 0 else \
                    prompts[req.session] + texts.tool_output(req.session, req.turn)
                max_tokens = args.answer_tokens
            params = hint_for(req, ttl) if system == "kvtier_hints" else None
            sent = time.monotonic() - t0
            got = await send(client, srv.base, prompt, max_tokens, params)
            if req.kind == "turn":
                prompts[req.session] = prompt + got["text"]
            done += 1
            after = srv.settled_metrics(done)
            by = {name: total(after, "vllm:prompt_tokens_by_source_total", source=s)
                  - total(before, "vllm:prompt_tokens_by_source_total", source=s) for s, name in SOURCES.items()}
            before = after
            out.append({"kind": req.kind, "session": req.session, "turn": req.turn, "doc": req.doc,
                        "planned_seconds": req.at_seconds * args.time_scale, "sent_seconds": round(sent, 3),
                        "prompt_sha": hashlib.sha256(prompt.encode()).hexdigest()[:16], "hint": params,
                        **{k: v for k, v in got.items() if k != "text"}, **by})
    return out


def run_system(system: str, requests, texts: Texts, args, work: Path) -> dict:
    """Start the kvtier server (if any) and vLLM, run the plan, stop both."""
    cache = None
    if system != "vllm":
        cache = ServerProcessForVLLM(work, chunk_size=args.chunk_size, l1=f"{args.l1_bytes}B",
                                     config={"l1_retention_max_share": args.retention_share})
    try:
        load = os.getloadavg()[0]
        srv = VLLMServer(work, system, kv_cache_bytes=args.vllm_kv_tokens * args.bytes_per_token,
                         max_model_len=args.max_model_len, reserved_cpu=args.reserved_cpu, cache=cache)
        try:
            records = asyncio.run(run_plan(srv, system, requests, texts, args))
            counters = {}
            if cache is not None:
                samples = scrape(f"{cache.admin}/metrics")
                counters = {name: total(samples, name, **({"medium": "CPU"} if "evicted" in name else {}))
                            for name in KVTIER_COUNTERS}
        finally:
            srv.stop()
    finally:
        if cache is not None:
            cache.stop()
    (work / f"{system}-requests.json").write_text(json.dumps(records, indent=1))
    problems = log_problems([cache.log_path] if cache else [])
    for line in problems:
        print(f"  {system} server log: {line}", flush=True)
    return {"records": records, "counters": counters, "load_1m": load, "problems": len(problems),
            "kv_capacity_tokens": srv.kv_capacity_tokens, "core_ids": srv.core_ids}


def summarise(system: str, m: dict, args) -> dict:
    """The CSV row of one system."""
    recs = m["records"]
    later = [r for r in recs if r["kind"] == "turn" and r["turn"] > 0]
    ttfts = sorted(r["ttft_seconds"] for r in later)
    ttl = (args.pause_max_seconds + args.ttl_margin_seconds) * args.time_scale
    prev = {(r["session"], r["turn"]): r["sent_seconds"] for r in recs if r["kind"] == "turn"}
    gaps = [r["sent_seconds"] - prev[r["session"], r["turn"] - 1] for r in later]
    return {
        "system": system, "sessions": args.sessions, "turns": args.turns, "requests": len(recs),
        "later_turns": len(later), "docs": sum(r["kind"] == "doc" for r in recs),
        "mean_ttft_seconds": mean(ttfts), "p50_ttft_seconds": nearest_rank(ttfts, 0.5), "p90_ttft_seconds": nearest_rank(ttfts, 0.9),
        **{f"mean_ttft_turn{k}_seconds": mean([r["ttft_seconds"] for r in recs if r["kind"] == "turn" and r["turn"] == k])
           for k in range(args.turns)},
        "mean_ttft_doc_seconds": mean([r["ttft_seconds"] for r in recs if r["kind"] == "doc"]),
        "mean_prompt_tokens": mean([r["prompt_tokens"] for r in later]),
        **{f"mean_{name}_tokens": mean([r[name] for r in later]) for name in SOURCES.values()},
        "counters_agree": all(r["vllm_cache"] + r["kvtier"] + r["recomputed"] == r["prompt_tokens"]
                              and r["vllm_cache"] + r["kvtier"] == r["cached_tokens"] for r in recs),
        "max_lateness_seconds": round(max(r["sent_seconds"] - r["planned_seconds"] for r in recs), 2),
        "max_pause_seconds": round(max(gaps), 2), "ttl_seconds": ttl if system == "kvtier_hints" else "",
        "turns_past_ttl": sum(g > ttl for g in gaps) if system == "kvtier_hints" else "",
        **{name.removeprefix("kvtier_").removesuffix("_total"): int(v) for name, v in m["counters"].items()},
        "prompts_sha": hashlib.sha256("".join(r["prompt_sha"] for r in recs).encode()).hexdigest()[:12],
        "l1_size_bytes": args.l1_bytes if system != "vllm" else "", "retention_share": args.retention_share,
        "vllm_kv_tokens": m["kv_capacity_tokens"], "chunk_size": args.chunk_size, "time_scale": args.time_scale,
        "server_log_problems": m["problems"], "reserved_cpu": args.reserved_cpu, "vllm_core_ids": m["core_ids"],
        "load_1m": round(m["load_1m"], 2),
    }


def print_ratios(rows: list[dict]) -> None:
    by = {r["system"]: r for r in rows}
    print(f"the same prompts went to every system: {'yes' if len({r['prompts_sha'] for r in rows}) == 1 else 'NO'}")
    for base, target in (("kvtier_lru", 0.8), ("vllm", 0.5)):
        h, b = by.get("kvtier_hints"), by.get(base)
        if h and b:
            ratio = h["mean_ttft_seconds"] / b["mean_ttft_seconds"]
            print(f"kvtier_hints / {base}: mean TTFT of later turns {ratio:.3f} (target <= {target}: "
                  f"{'met' if ratio <= target else 'NOT met'}), p50 {h['p50_ttft_seconds'] / b['p50_ttft_seconds']:.3f}, "
                  f"p90 {h['p90_ttft_seconds'] / b['p90_ttft_seconds']:.3f}; recomputed tokens per later turn "
                  f"{h['mean_recomputed_tokens']:.0f} vs {b['mean_recomputed_tokens']:.0f}")
            # the one-shot documents are the same work in every system: how fast the machine was in each run
            doc = b["mean_ttft_doc_seconds"] / h["mean_ttft_doc_seconds"]
            print(f"  machine-speed control: documents' mean TTFT {base} / kvtier_hints {doc:.3f}; the mean TTFT "
                  f"ratio at equal document speed {ratio * doc:.3f}")


def sizes(args, requests, bytes_per_token: int) -> list[str]:
    """Fill in the L1 and vLLM sizes, check them (raises Refused) and return the lines describing the plan."""
    shape = AgentShape(args.system_tokens, args.task_tokens, args.tool_tokens, args.answer_tokens, args.doc_tokens,
                       args.chunk_size)
    sched = args.schedule
    ttl_planned = args.pause_max_seconds + args.ttl_margin_seconds
    peak = protected_peak_chunks(requests, shape, ttl_planned)
    chunk_bytes = args.chunk_size * bytes_per_token
    l1_chunks = math.ceil(peak / args.retention_share) + shape.doc_chunks if args.l1_size_gb is None \
        else int(args.l1_size_gb * 1e9 // chunk_bytes)
    args.l1_bytes = l1_chunks * chunk_bytes
    longest = max(shape.prompt_tokens(args.turns - 1), args.doc_tokens + 32) + args.answer_tokens + 64
    args.max_model_len = math.ceil(longest / VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
    args.vllm_kv_tokens = args.max_model_len + 2 * VLLM_BLOCK_TOKENS
    everyone, horizon = all_sessions_chunks(shape, sched), lru_horizon_seconds(l1_chunks, requests, shape)
    if l1_chunks >= everyone:
        raise Refused(f"kvtier's L1 ({l1_chunks} chunks) holds all {args.sessions} sessions ({everyone} chunks): "
                      f"add sessions or lower --l1-size-gb")
    if peak > args.retention_share * l1_chunks:
        raise Refused(f"the hints protect up to {peak} chunks at once, more than l1_retention_max_share "
                      f"{args.retention_share} of L1's {l1_chunks}: raise --l1-size-gb or lower --live-sessions")
    if horizon >= args.pause_min_seconds:
        raise Refused(f"an LRU L1 of {l1_chunks} chunks keeps a chunk {horizon:.1f} planned s, not less than the "
                      f"shortest pause ({args.pause_min_seconds} s): lower --doc-interval-seconds")
    docs = sum(r.kind == "doc" for r in requests)
    return [f"{args.sessions} sessions x {args.turns} turns, {len(requests)} requests ({docs} one-shot documents of "
            f"{args.doc_tokens} tokens) over {requests[-1].at_seconds * args.time_scale:.0f} s; sessions start "
            f"{sched.arrival_seconds * args.time_scale:.1f} s apart, pauses U[{args.pause_min_seconds * args.time_scale:g}, "
            f"{args.pause_max_seconds * args.time_scale:g}] s, a document every {args.doc_interval_seconds * args.time_scale:g} s",
            f"session prompt tokens per turn (nominal): {[shape.prompt_tokens(k) for k in range(args.turns)]}; "
            f"answers {args.answer_tokens} tokens; system prompt {args.system_tokens} ({shape.system_chunks} whole chunks)",
            f"kvtier L1 {l1_chunks} chunks of {args.chunk_size} tokens ({args.l1_bytes / 1e9:.3f} GB; {bytes_per_token} "
            f"bytes per token): all sessions need {everyone} chunks; the hints protect at most {peak} "
            f"(l1_retention_max_share {args.retention_share}: {args.retention_share * l1_chunks:.0f}); TTL "
            f"{ttl_planned * args.time_scale:g} s",
            f"LRU memory horizon: {horizon * args.time_scale:.1f} s (documents alone "
            f"{flood_horizon_seconds(l1_chunks, shape, sched) * args.time_scale:.1f} s) < shortest pause "
            f"{args.pause_min_seconds * args.time_scale:g} s; vLLM KV cache {args.vllm_kv_tokens} tokens "
            f"(--max-model-len {args.max_model_len}), documents alone push it out in "
            f"{flood_horizon_seconds(args.vllm_kv_tokens / args.chunk_size, shape, sched) * args.time_scale:.1f} s",
            f"prefill without any reuse: {prefill_tokens(requests, shape)} tokens, "
            f"{prefill_tokens(requests, shape) / (requests[-1].at_seconds * args.time_scale):.0f} tokens/s to keep to "
            f"the schedule (vLLM alone); raise --time-scale on a machine that prefills less"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"a short smoke run: {QUICK}, files under /tmp")
    for key, value in FULL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                        help=f"default {value} ({QUICK[key]} with --quick)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiplies every planned time (pauses, "
                    "arrivals, document interval, TTL): above 1 on a slower machine")
    ap.add_argument("--ttl-margin-seconds", type=float, default=10.0, help="TTL = longest pause + this (planned s)")
    ap.add_argument("--l1-size-gb", type=float, default=None, help="kvtier's L1 (default: the hints' peak / the "
                    "share + one document)")
    ap.add_argument("--retention-share", type=float, default=0.8, help="l1_retention_max_share of both kvtier servers")
    ap.add_argument("--chunk-size", type=int, default=256, help="kvtier's chunk size in tokens")
    ap.add_argument("--seed", type=int, default=0, help="picks the texts and the pauses")
    ap.add_argument("--reserved-cpu", default="0", help="VLLM_CPU_NUM_OF_RESERVED_CPU for every vLLM")
    ap.add_argument("--csv", default=None, help="default benchmarks/results/agent_sessions.csv (--quick: under /tmp)")
    ap.add_argument("--chart", default=None, help="default docs/img/agent_sessions.png (--quick: under /tmp)")
    ap.add_argument("--work", default=None, help="keep the logs and per-request JSON in this folder")
    ap.add_argument("--plan", action="store_true", help="print the schedule and sizes, run nothing")
    args = ap.parse_args()
    for key, value in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    out = Path(tempfile.gettempdir()) / "agent_sessions-quick" if args.quick else None
    args.csv = Path(args.csv or (out / "agent_sessions.csv" if out else RESULTS_DIR / "agent_sessions.csv"))
    args.chart = Path(args.chart or (out / "agent_sessions.png" if out else REPO / "docs" / "img" / "agent_sessions.png"))
    args.systems = args.systems.split(",")
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"unknown system(s) {sorted(set(args.systems) - set(SYSTEMS))}; choose from {','.join(SYSTEMS)}")
    if not 0 < args.retention_share <= 1 or args.time_scale <= 0:
        ap.error("--retention-share must be in (0, 1] and --time-scale > 0")
    try:
        args.schedule = Schedule(args.sessions, args.turns, args.live_sessions, args.pause_min_seconds,
                                 args.pause_max_seconds, args.doc_interval_seconds, args.seed)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    from transformers import AutoTokenizer

    folder = model_dir()
    args.bytes_per_token = kv_bytes_per_token(folder)
    requests = plan(args.schedule)
    try:
        lines = sizes(args, requests, args.bytes_per_token)
        texts = Texts(args, AutoTokenizer.from_pretrained(folder, local_files_only=True),
                      sum(r.kind == "doc" for r in requests))
    except (Refused, CorpusExhausted) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{commit_line()}; load average {os.getloadavg()}; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpu}; system prompt {texts.system_tokens} tokens (measured)")
    for line in lines:
        print(line, flush=True)
    if args.plan:
        return 0
    rows, absent = [], {}
    with tempfile.TemporaryDirectory(prefix="agent-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for system in args.systems:
            try:
                row = summarise(system, run_system(system, requests, texts, args, work), args)
            except Exception as exc:  # one failed system must not lose the others' figures; reported below
                traceback.print_exc()
                absent[system] = f"{type(exc).__name__}: {str(exc)[:300]}"
                continue
            rows.append(row)
            print(f"{system:13s} later turns: TTFT mean {row['mean_ttft_seconds']:.3f} s, p50 {row['p50_ttft_seconds']:.3f}, "
                  f"p90 {row['p90_ttft_seconds']:.3f}; per turn {row['mean_prompt_tokens']:.0f} prompt tokens: vLLM cache "
                  f"{row['mean_vllm_cache_tokens']:.0f}, kvtier {row['mean_kvtier_tokens']:.0f}, recomputed "
                  f"{row['mean_recomputed_tokens']:.0f}; first turns {row['mean_ttft_turn0_seconds']:.3f} s, "
                  f"documents {row['mean_ttft_doc_seconds']:.3f} s; late by <= {row['max_lateness_seconds']} s; "
                  f"counters agree {row['counters_agree']}; " + ", ".join(
                      f"{k} {row[k]}" for k in ("retention_refused_chunks", "evicted_chunks", "turns_past_ttl")
                      if row.get(k, "") != ""), flush=True)
    return finish(rows, absent, args.csv, args.chart, agent_sessions_chart, print_ratios, started)


if __name__ == "__main__":
    sys.exit(main())
