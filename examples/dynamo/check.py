"""Check a running Dynamo deployment (examples/dynamo/agg.sh or disagg.sh) end to end, and time it.

Sends one long prompt (token ids of a real text) through the frontend's OpenAI API, streamed, greedy:

1. ``cold``: nobody holds the prompt; a worker computes it and the kvtier connector stores its chunks;
2. ``warm``: the same prompt again (vLLM's own prefix cache);
3. ``reload``: after every worker's prefix cache was reset through Dynamo's ``clear_kv_blocks`` endpoint
   (vLLM's ``reset_prefix_cache``; kvtier keeps its data), the same prompt again: vLLM loads it from kvtier.

Prints one JSON object: per step the TTFT (seconds), the prompt tokens vLLM reported as cached, the worker(s)
that served it and the output text; ``same_output`` compares every step with ``cold``. With ``--metrics``
(the ``$LOG_DIR/metrics-urls`` file the launch scripts write) each step also gets every worker's own TTFT from
vLLM's ``vllm:time_to_first_token_seconds`` histogram (in disaggregated serving: the decode worker's TTFT
without the prefill worker's time). Run it with the
Dynamo environment's python (it joins Dynamo's file discovery to reach ``clear_kv_blocks``)::

    DYN_FILE_KV=$LOG_DIR/discovery .venv-dynamo/bin/python examples/dynamo/check.py --http-port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp

DOC_FILE = "/usr/share/common-licenses/GPL-3"


def prompt_tokens(model_dir: str, num_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok(Path(DOC_FILE).read_text()).input_ids
    if len(ids) < num_tokens:
        raise SystemExit(f"{DOC_FILE} has only {len(ids)} tokens; ask for fewer with --num-tokens")
    return ids[:num_tokens]


async def complete(session: aiohttp.ClientSession, url: str, model: str, tokens: list[int], max_tokens: int) -> dict:
    """One streamed, greedy completion. Returns ttft_seconds, cached_tokens, worker, text."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            "nvext": {"extra_fields": ["worker_id"]}}
    started = time.perf_counter()
    ttft, text, usage, worker = None, [], None, None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"the frontend answered {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - started
                text.append(choice.get("text") or "")
            usage = chunk.get("usage") or usage
            worker = (chunk.get("nvext") or {}).get("worker_id") or worker
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft_seconds": round(ttft or float("nan"), 4), "cached_tokens": details.get("cached_tokens"),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "worker": worker, "text": "".join(text)}


async def worker_ttft_totals(session: aiohttp.ClientSession, metrics: dict[str, str]) -> dict[str, tuple]:
    """Per worker: (sum of seconds, count) of vLLM's ``vllm:time_to_first_token_seconds`` histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for name, url in metrics.items():
        async with session.get(url) as resp:
            text = await resp.text()
        total = count = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:time_to_first_token_seconds_sum":
                    total += sample.value
                elif sample.name == "vllm:time_to_first_token_seconds_count":
                    count += sample.value
        out[name] = (total, count)
    return out


async def timed_step(session, url, args, tokens, metrics: dict[str, str]) -> dict:
    """One ``complete``; with ``metrics``, adds each worker's vLLM TTFT of this request (``worker_ttft_seconds``)."""
    before = await worker_ttft_totals(session, metrics) if metrics else {}
    result = await complete(session, url, args.model_name, tokens, args.max_tokens)
    if metrics:
        after = await worker_ttft_totals(session, metrics)
        result["worker_ttft_seconds"] = {name: round((after[name][0] - before[name][0]) /
                                                     (after[name][1] - before[name][1]), 4)
                                         for name in metrics if after[name][1] > before[name][1]}
    return result


async def reset_prefix_caches(namespace: str, components: list[str]) -> int:
    """Call ``clear_kv_blocks`` on every worker instance of ``components``; returns how many answered success."""
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    done = 0
    try:
        for component in components:
            client = await runtime.endpoint(f"{namespace}.{component}.clear_kv_blocks").client()
            for instance in await client.wait_for_instances():
                async for reply in await client.direct({}, instance):
                    data = reply.data() if callable(getattr(reply, "data", None)) else reply
                    if (data or {}).get("status") != "success":
                        raise SystemExit(f"clear_kv_blocks on {component}/{instance}: {data}")
                    done += 1
    finally:
        runtime.shutdown()
    return done


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--model-name", default="smollm2")
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/kvtier/models/smollm2-135m-instruct"))
    ap.add_argument("--num-tokens", type=int, default=1500, help="prompt length in tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--namespace", default="dynamo")
    ap.add_argument("--components", default="backend", help="comma-separated worker components to reset")
    ap.add_argument("--metrics", default=None, help="file of NAME=URL lines: the workers' /metrics (optional)")
    args = ap.parse_args()
    tokens = prompt_tokens(args.model_dir, args.num_tokens)
    url = f"http://127.0.0.1:{args.http_port}"
    metrics = {}
    if args.metrics:
        metrics = dict(line.split("=", 1) for line in Path(args.metrics).read_text().split())
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        out["cold"] = await timed_step(session, url, args, tokens, metrics)
        out["warm"] = await timed_step(session, url, args, tokens, metrics)
        out["workers_reset"] = await reset_prefix_caches(args.namespace, args.components.split(","))
        out["reload"] = await timed_step(session, url, args, tokens, metrics)
    for step in ("warm", "reload"):
        out[f"same_output_{step}"] = out[step]["text"] == out["cold"]["text"]
    out["reload_over_cold_ttft"] = round(out["reload"]["ttft_seconds"] / out["cold"]["ttft_seconds"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
