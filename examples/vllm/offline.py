"""Run prompts (token ids) through vLLM's offline ``LLM`` API, with or without the kvtier connector.

Used by the vLLM integration tests and benchmarks; run it with the vLLM environment's python::

    .venv-vllm/bin/python examples/vllm/offline.py --model DIR --prompts prompts.json --out result.json \\
        [--kvtier '{"kvtier.server_url": "tcp://127.0.0.1:5555"}'] [--role kv_both] [--no-prefix-caching]

``prompts.json`` is a JSON list of token-id lists. Each prompt is sent ``--repeat`` times, one request at a
time; ``result.json`` gets, per request: the generated token ids, the top ``--logprobs`` log-probabilities
of every generated token, the wall time of the request in seconds and vLLM's ``num_cached_tokens``.

``--one-process`` runs vLLM's engine core and its one worker inside this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the connector's scheduler and worker sides are still two connector
objects with their own kvtier clients, but share one OS process. It starts in about half the time (no two
spawned interpreters importing torch); without it the topology is ``vllm serve``'s (engine core and worker
processes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
    os.environ.setdefault(key, value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--kvtier", default=None, help="kv_connector_extra_config JSON; omit to run vLLM alone")
    ap.add_argument("--role", default="kv_both", choices=["kv_both", "kv_producer", "kv_consumer"])
    ap.add_argument("--no-prefix-caching", action="store_true", help="turn vLLM's own prefix cache off")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--logprobs", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--kv-transfer-params", default=None,
                    help="JSON object sent with every request as its kv_transfer_params (e.g. kvtier retention hints)")
    ap.add_argument("--kv-events", default=None, help="publish vLLM's KV cache events (and kvtier's) on this ZMQ endpoint")
    ap.add_argument("--warmup", action="store_true", help="send one short unrelated prompt first (not reported)")
    ap.add_argument("--one-process", action="store_true",
                    help="engine core and worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): starts faster")
    args = ap.parse_args(argv)
    if args.one_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by vLLM when the engine is built

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"model": args.model, "dtype": args.dtype, "max_model_len": 4096, "enforce_eager": True, "seed": 0,
          "enable_prefix_caching": not args.no_prefix_caching}
    if args.kvtier is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connectors.vllm",
            kv_role=args.role, kv_load_failure_policy="recompute",  # a failed kvtier load is recomputed
            kv_connector_extra_config=json.loads(args.kvtier))
    if args.kv_events:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=args.kv_events)
    started = time.perf_counter()
    llm = LLM(**kw)
    engine_seconds = time.perf_counter() - started
    with open(args.prompts) as f:
        prompts = json.load(f)
    extra = {"kv_transfer_params": json.loads(args.kv_transfer_params)} if args.kv_transfer_params else None
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs or None, extra_args=extra)
    if args.warmup:
        llm.generate([TokensPrompt(prompt_token_ids=list(range(1000, 1100)))], SamplingParams(max_tokens=1),
                     use_tqdm=False)
    results = []
    for i, ids in enumerate(prompts):
        for rep in range(args.repeat):
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            seconds = time.perf_counter() - t
            comp = out.outputs[0]
            logprobs = [{str(k): v.logprob for k, v in step.items()} for step in (comp.logprobs or [])]
            results.append({"prompt": i, "repeat": rep, "num_prompt_tokens": len(ids), "seconds": seconds,
                            "num_cached_tokens": out.num_cached_tokens, "token_ids": list(comp.token_ids),
                            "logprobs": logprobs})
            print(f"prompt {i} rep {rep}: {len(ids)} tokens, {seconds:.3f} s, cached {out.num_cached_tokens}",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump({"engine_seconds": engine_seconds, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
