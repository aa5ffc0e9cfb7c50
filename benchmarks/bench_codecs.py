"""KV codecs on real KV: compression ratio, encode / decode speed per core, and what lossy KV does to the model.

KV: SmolLM2-135M-Instruct and Gemma-3-270M (fp32 weights, transformers on CPU) prefill the first
``--chunk-tokens`` tokens of ``--prompts`` real texts (``corpus.py``: Debian's licences and package docs); each
prefix's KV is one kvtier chunk ``(num_layers, 2, chunk_tokens, num_kv_heads, head_dim)``. The bf16 KV is the
fp32 KV rounded to bfloat16 (what a bf16 model's cache holds, to rounding).

Speed (``torch.set_num_threads(1)``: per core): every codec encodes and decodes the first ``--ratio-chunks``
chunks, best of ``--repeat`` passes; GB/s = raw chunk bytes (10**9) per second, against a memcpy of the same
chunks into a buffer (``np.copyto``) in the same run. Ratio = raw bytes / encoded bytes over those chunks, and
against the bf16 size.

Quality: for each lossy codec, the prefix KV (``--prefix-chunks`` chunks, each encoded on its own as kvtier stores
them; 2 chunks = the 512 tokens ``vllm_codec_quality.py`` restores) goes through encode + decode and is loaded back
into the model (``DynamicCache``); the model then reads the next ``--tail-tokens`` tokens of the text (as kvtier's connector
prefills what follows a hit) and answers greedily for ``--new-tokens`` tokens. Reported against the same steps on
the raw KV: answers identical (share of prompts), top-1 agreement and mean KL(raw || codec) of the next-token
distributions at the tail's positions.

    .venv/bin/python benchmarks/bench_codecs.py [--models smollm2,gemma3] [--prompts 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from transformers import DynamicCache

from corpus import Corpus
from kvtier.codecs import get_codec
from kvtier.connectors.hf_kv import dynamic_cache_to_kv
from kvtier.errors import KVTierError
from kvtier.demo.models import load_gemma3, load_smollm2
from kvtier.layout import KVLayout

LOADERS = {"smollm2": load_smollm2, "gemma3": load_gemma3}
SPEED_CODECS = ["none", "zstd", "zstd:shuffle=none", "zstd:level=3", "zstd:level=-1", "lz4", "lz4:shuffle=none",
                "blosc_zstd", "blosc_lz4", "fp8_e4m3+blosc_zstd", "fp8_e4m3", "fp8_e4m3:scale=kivi", "fp8_e4m3+zstd", "fp8_e4m3+lz4",
                "int8:scale=token", "int8",
                "int8+zstd", "bf16", "bf16+zstd", "bf16+lz4"]
QUALITY_CODECS = ["bf16", "fp8_e4m3:scale=token", "fp8_e4m3:scale=channel", "fp8_e4m3:scale=kivi", "int8:scale=token",
                  "int8:scale=kivi"]


def best_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def chunk_bytes(kv: torch.Tensor) -> np.ndarray:
    return kv.contiguous().reshape(-1).view(torch.uint8).numpy()


def speed_rows(chunks: list[torch.Tensor], layout, repeat: int) -> list[dict]:
    """One row per codec that accepts ``layout``, plus the memcpy baseline."""
    raws = [chunk_bytes(c) for c in chunks]
    tokens = chunks[0].shape[2]
    total = sum(r.nbytes for r in raws)
    bf16_total = total * 2 // layout.element_size
    outs = [np.empty_like(r) for r in raws]
    memcpy = total / best_seconds(lambda: [np.copyto(o, r) for o, r in zip(outs, raws)], repeat) / 1e9
    rows = [{"codec": "memcpy", "encode_gbps": memcpy, "decode_gbps": memcpy}]
    for spec in SPEED_CODECS:
        codec = get_codec(spec)
        try:
            encoded = [codec.encode(r, layout, tokens) for r in raws]
        except KVTierError as exc:  # e.g. bf16 of bf16 KV
            print(f"  skip {spec} on {layout.dtype}: {exc}", file=sys.stderr)
            continue
        size = sum(e.nbytes for e in encoded)
        enc = best_seconds(lambda: [codec.encode(r, layout, tokens) for r in raws], repeat)
        dec = best_seconds(lambda: [codec.decode(e.data, e.params, layout, tokens, out=o)
                                    for e, o in zip(encoded, outs)], repeat)
        # the path before decoding went straight into the L1 slot: a new array, then a copy into the slot
        copied = best_seconds(lambda: [np.copyto(o, codec.decode(e.data, e.params, layout, tokens))
                                       for e, o in zip(encoded, outs)], repeat)
        if codec.lossless:
            assert all(np.array_equal(o, r) for o, r in zip(outs, raws)), spec
        rows.append({"codec": codec.spec, "lossless": codec.lossless, "ratio": total / size,
                     "ratio_vs_bf16": bf16_total / size, "encode_gbps": total / enc / 1e9,
                     "decode_gbps": total / dec / 1e9, "decode_vs_memcpy": total / dec / 1e9 / memcpy,
                     "decode_then_copy_gbps": total / copied / 1e9})
    return rows


def run_tails(model, kvs: list[torch.Tensor], tail: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Load each of ``kvs`` (versions of one prefix's KV) as one row of a batched cache, read ``tail`` in every row,
    answer greedily. Returns (log-probs at the tail's positions [rows, tail, vocab], answers [rows, new_tokens]).

    One batch instead of one run per codec: the rows are independent (same lengths, no padding) and the raw KV is
    a row of the same batch, so every comparison is between the same computations."""
    rows = len(kvs)
    stacked = torch.stack(kvs)  # (rows, L, 2, T, H, D)
    layers = [(stacked[:, i, 0].transpose(1, 2), stacked[:, i, 1].transpose(1, 2)) for i in range(stacked.shape[1])]
    cache = DynamicCache(ddp_cache_data=layers, config=model.config)  # per layer [rows, H, T, D]
    length = stacked.shape[3] + tail.shape[0]
    out = model(tail[None].expand(rows, -1), past_key_values=cache,
                attention_mask=torch.ones((rows, length), dtype=torch.long), use_cache=True)
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)
    answers = [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        length += 1
        out = model(answers[-1][:, None], past_key_values=out.past_key_values,
                    attention_mask=torch.ones((rows, length), dtype=torch.long), use_cache=True)
        answers.append(out.logits[:, -1].argmax(-1))
    return logprobs, torch.stack(answers, dim=1)


def lossy_round_trip(spec: str, kv: torch.Tensor, layout, chunk_tokens: int) -> torch.Tensor:
    """``kv`` (a prefix of whole chunks) after encode + decode, chunk by chunk."""
    codec = get_codec(spec)
    parts = []
    for start in range(0, kv.shape[2], chunk_tokens):
        chunk = kv[:, :, start:start + chunk_tokens].contiguous()
        encoded = codec.encode(chunk_bytes(chunk), layout, chunk.shape[2])
        decoded = codec.decode(encoded.data, encoded.params, layout, chunk.shape[2])
        parts.append(torch.from_numpy(decoded.copy()).view(kv.dtype).view(chunk.shape))
    return torch.cat(parts, dim=2)


def bench_model(name: str, args) -> dict:
    try:
        model, tokenizer = LOADERS[name](progress=False)
    except KVTierError as exc:
        print(f"{name}: skipped ({exc})")
        return {"model": name, "skipped": str(exc)}
    corpus = Corpus(tokenizer, seed=args.seed)
    prefix_tokens = args.chunk_tokens * args.prefix_chunks
    need = prefix_tokens + args.tail_tokens
    layout32 = KVLayout.from_model(model, torch.float32)
    layout16 = KVLayout.from_model(model, torch.bfloat16)
    chunks, quality = [], {spec: {"identical": 0, "top1": 0, "positions": 0, "kl_sum": 0.0} for spec in QUALITY_CODECS}
    started = time.perf_counter()
    for i in range(args.prompts if args.only != "speed" else args.ratio_chunks):
        # drawn a little longer: the text re-tokenizes to about, not exactly, the tokens drawn
        ids = torch.tensor(tokenizer(corpus.draw(need + 16), add_special_tokens=False).input_ids[:need])
        if ids.shape[0] < need:
            raise SystemExit(f"{name}: a drawn text holds {ids.shape[0]} tokens, fewer than {need}")
        prefix, tail = ids[:prefix_tokens], ids[prefix_tokens:]
        with torch.inference_mode():
            out = model(prefix[None], use_cache=True)
            kv = dynamic_cache_to_kv(out.past_key_values, prefix_tokens)
            if len(chunks) < args.ratio_chunks:
                chunks.append(kv[:, :, :args.chunk_tokens].contiguous())
            if args.only == "speed":
                continue
            logprobs, answers = run_tails(model, [kv] + [lossy_round_trip(spec, kv, layout32, args.chunk_tokens)
                                                         for spec in QUALITY_CODECS], tail, args.new_tokens)
            for row, spec in enumerate(QUALITY_CODECS, start=1):
                q = quality[spec]
                q["identical"] += bool(torch.equal(answers[row], answers[0]))
                q["top1"] += int((logprobs[row].argmax(-1) == logprobs[0].argmax(-1)).sum())
                q["positions"] += logprobs.shape[1]
                q["kl_sum"] += float((logprobs[0].exp() * (logprobs[0] - logprobs[row])).sum())
        print(f"  {name}: prompt {i + 1}/{args.prompts} ({time.perf_counter() - started:.0f} s): " + ", ".join(
            f"{spec} {q['identical']}" for spec, q in quality.items()), file=sys.stderr)
    result = {"model": name, "layout": layout32.to_dict(), "chunk_tokens": args.chunk_tokens, "prompts": args.prompts,
              "prefix_chunks": args.prefix_chunks, "seed": args.seed}
    if args.only != "speed":
        result["quality"] = [{"codec": get_codec(spec).spec, "identical_answers": q["identical"] / args.prompts,
                              "top1_agreement": q["top1"] / q["positions"], "mean_kl_nats": q["kl_sum"] / q["positions"]}
                             for spec, q in quality.items()]
    if args.only != "quality":
        result["speed_fp32"] = speed_rows(chunks, layout32, args.repeat)
        result["speed_bf16"] = speed_rows([c.to(torch.bfloat16) for c in chunks], layout16, args.repeat)
    return result


def print_result(result: dict) -> None:
    if "skipped" in result:
        return
    print(f"\n## {result['model']}: chunks of {result['chunk_tokens']} tokens, layout {result['layout']}")
    for key in ("speed_fp32", "speed_bf16"):
        rows = result.get(key)
        if not rows:
            continue
        print(f"\n{key[6:]} KV | ratio | vs bf16 | encode GB/s | decode into slot GB/s | decode / memcpy | "
              "decode, then copy GB/s | into slot / then copy")
        for r in rows:
            if r["codec"] == "memcpy":
                print(f"memcpy | 1.000 | | {r['encode_gbps']:.2f} | {r['decode_gbps']:.2f} | 1.00 | |")
                continue
            print(f"{r['codec']} | {r['ratio']:.3f} | {r['ratio_vs_bf16']:.3f} | {r['encode_gbps']:.2f} | "
                  f"{r['decode_gbps']:.2f} | {r['decode_vs_memcpy']:.2f} | {r['decode_then_copy_gbps']:.2f} | "
                  f"{r['decode_gbps'] / r['decode_then_copy_gbps']:.2f}")
    if "quality" not in result:
        return
    print(f"\nquality ({result['prompts']} prompts, seed {result['seed']}, {result['prefix_chunks']} lossy chunks of "
          f"{result['chunk_tokens']} tokens each) | identical answers | top-1 agreement | mean KL (nats)")
    for r in result["quality"]:
        print(f"{r['codec']} | {100 * r['identical_answers']:.0f} % | {100 * r['top1_agreement']:.2f} % | "
              f"{r['mean_kl_nats']:.2e}")


def chart(results: list[dict], path: str) -> None:
    """Ratio vs bf16 of every codec on each model's bf16 KV (and fp32-only codecs on fp32 KV), one bar each."""
    from charts import bars

    data = {}
    for result in results:
        for key in ("speed_bf16", "speed_fp32"):
            for row in result.get(key) or []:
                label = f"{result['model']} {key[6:]}: {row['codec']}"
                if row["codec"] != "memcpy" and (key == "speed_bf16" or row["codec"].startswith("bf16")):
                    data[label] = round(row["ratio_vs_bf16"], 2)
    if data:
        bars(data, "KV codecs: compression ratio against the bf16 KV", "bf16 bytes / encoded bytes", path, line=1.3)
    quality = {f"{r['model']}: {_short(row['codec'])}": round(100 * row["identical_answers"])
               for r in results for row in r.get("quality") or []}
    if quality:  # a quality run: its own chart beside the ratio one
        target = str(path).removesuffix(".png") + "_quality.png" if data else path
        bars(quality, "Lossy KV: 32-token answers identical to raw KV's", "% of prompts", target, line=95)


def _short(spec: str) -> str:
    """``spec`` without the options that are its codec's defaults (``int8:center=1,group=16,...`` -> ``int8``)."""
    from kvtier.codecs import get_codec

    name, _, options = spec.partition(":")
    if not options or "+" in spec:
        return spec
    defaults = dict(o.split("=") for o in get_codec(name).spec.partition(":")[2].split(",") if o)
    kept = [o for o in options.split(",") if defaults.get(o.split("=")[0]) != o.split("=")[1]]
    return f"{name}:{','.join(kept)}" if kept else name


def from_saved(saved: list[dict]) -> list[dict]:
    """Results as this script's ``--json`` writes them; a ``vllm_codec_quality.py --json`` file (one row per codec)
    becomes one result of model ``vLLM smollm2``, whose rows the quality chart draws beside these."""
    if saved and "tokens_from_l2" in saved[0]:
        return [{"model": "vLLM smollm2", "quality": [{**row, "codec": row.get("spec", row["codec"])} for row in saved]}]
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3", help="comma-separated: smollm2, gemma3")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--prefix-chunks", type=int, default=1, help="quality: chunks of the prefix, each encoded "
                        "alone (2: the 512 tokens vllm_codec_quality.py restores)")
    parser.add_argument("--tail-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ratio-chunks", type=int, default=8, help="chunks timed for the speed table")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality-codecs", help=f"semicolon-separated specs for the quality half (default {QUALITY_CODECS})")
    parser.add_argument("--only", choices=("speed", "quality"), help="one half of the benchmark")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--chart", help="also draw the ratios (speed runs) or the identical answers (quality runs) "
                        "into this PNG (from this run, or --from-json)")
    parser.add_argument("--from-json", help="draw --chart from saved --json files (comma-separated; "
                        "vllm_codec_quality.py's too) and exit")
    args = parser.parse_args()
    if args.from_json:
        results = []
        for path in args.from_json.split(","):
            with open(path) as f:
                results += from_saved(json.load(f))
        chart(results, args.chart or "codecs.png")
        return
    if args.prefix_chunks < 1:
        parser.error("--prefix-chunks must be at least 1")
    torch.set_num_threads(1)
    if args.quality_codecs:
        QUALITY_CODECS[:] = args.quality_codecs.split(";")
    results = []
    for name in args.models.split(","):
        if name not in LOADERS:
            raise SystemExit(f"unknown model {name!r}; use {sorted(LOADERS)}")
        results.append(bench_model(name, args))
        print_result(results[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.chart:
        chart(results, args.chart)


if __name__ == "__main__":
    main()
