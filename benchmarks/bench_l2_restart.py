"""Reading a 2,048-token prefix (8 chunks of 256 tokens, SmolLM2 fp32 KV (30, 2, 256, 3, 64) = 11.25 MiB per
chunk) from each L2 into L1 after a restart, against cold prefill of the same 2,048 tokens on SmolLM2-135M.

Per L2 kind (local_disk buffered and O_DIRECT, s3 on moto_server and SeaweedFS, azure_blob on Azurite,
redis-server, a 3-node Redis Cluster, Valkey; servers started on 127.0.0.1 by kvtier_harness/services.py): the prompt's
KV is stored through one KVCache, which is closed (queued writes finished); a fresh KVCache (empty L1) over
the same L2 then times ``retrieve`` of the 2,048 tokens, median of ``--runs`` runs, clearing L1 between runs.
The first run is checked byte for byte against the stored KV.

Baseline, measured in the same run: cold prefill, ``model(input_ids, past_key_values=DynamicCache(config=...),
use_cache=True, logits_to_keep=1)`` on the 2,048 tokens (median of ``--prefill-runs``). The estimated TTFT
after a restart is retrieve + the one prompt token a KV hit still computes (the first output token needs the
last prompt token's logits; see kvtier.connectors.hf): rebuilding a DynamicCache of 2,047 retrieved tokens and
running the last token, timed once per run of this script. That step's next token is checked against the cold
prefill's.

Notes: local_disk reads after a restart come from the OS page cache (the same machine just wrote them); the
``local_disk_direct_io`` row bypasses it. Every server runs on this machine, so network rows measure the
protocol and the server, not a network.

With ``--codecs none,zstd,fp8_e4m3+zstd`` (issue 20) each L2 is measured once per codec (the adapter's
``codec`` key; lossy codecs allowed for the model): the record bytes written (= bytes a restore moves) and
the retrieve time; a lossless codec's restore is checked byte for byte, a lossy one's against a tolerance.

    .venv/bin/python benchmarks/bench_l2_restart.py [--skip-model] [--runs 3] [--prefill-runs 3] [--only redis,s3_moto]
        [--codecs none,zstd,fp8_e4m3+zstd]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time

import torch

from kvtier_harness import services
from bench_l2_remote import adapter_spec

from kvtier.cache import KVCache
from kvtier.codecs import get_codec
from kvtier.config import KVTierConfig
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M, fp32: 11.25 MiB per 256 tokens
CHUNK = 256
NUM_TOKENS = 2048
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
KINDS = ["local_disk", "local_disk_direct_io", "s3_moto", "s3_seaweedfs", "azure", "redis", "redis_cluster", "valkey"]
STARTERS = {"s3_moto": services.moto_server, "s3_seaweedfs": services.seaweedfs, "azure": services.azurite,
            "redis": services.redis_server, "valkey": services.valkey_server, "redis_cluster": services.redis_cluster}


def config_for(spec: dict) -> KVTierConfig:
    # L1 holds the whole prefix; the write queue holds all 8 chunks (none dropped); a lossy codec is allowed here
    codec = get_codec(spec.get("codec", "none"))
    allowed = {} if codec.lossless else {MODEL_ID: [codec.name]}
    return KVTierConfig(chunk_size=CHUNK, l1_size_gb="256MB", l2_adapters=[spec], l2_write_queue_size=16,
                        lossy_codecs_allowed=allowed)


def bench_adapter(spec: dict, tokens: list[int], kv: torch.Tensor, runs: int) -> dict:
    """Store through one KVCache, reopen over the same L2 with an empty L1, time ``retrieve``."""
    with KVCache(config_for(spec), MODEL_ID, LAYOUT) as writer:
        started = time.perf_counter()
        assert writer.store(tokens, kv) == NUM_TOKENS // CHUNK
        if not writer.flush(300):
            raise RuntimeError(f"{spec['type']}: L2 writes not finished after 300 s")
        write_seconds = time.perf_counter() - started
        if writer.stats().get("kvtier_l2_write_dropped_total"):
            raise RuntimeError(f"{spec['type']}: some L2 writes were dropped: {writer.stats()}")
        record_bytes = sum(row["bytes_written"] for row in writer.l2.written_bytes())
    lossless = get_codec(spec.get("codec", "none")).lossless
    times = []
    with KVCache(config_for(spec), MODEL_ID, LAYOUT) as reader:  # a restart: new L1, same L2
        for run in range(runs):
            reader.clear("CPU")
            assert reader.l1.num_chunks == 0
            started = time.perf_counter()
            out, n = reader.retrieve(tokens)
            times.append(time.perf_counter() - started)
            same = torch.equal(out, kv) if lossless else torch.allclose(out, kv, rtol=0.15, atol=0.05)
            if n != NUM_TOKENS or (run == 0 and not same):
                raise RuntimeError(f"{spec['type']}: retrieve returned {n} tokens or different bytes")
    return {"write_seconds": write_seconds, "retrieve_seconds": statistics.median(times), "all_seconds": times,
            "record_bytes": record_bytes}


def model_baseline(prefill_runs: int):
    """(prompt tokens, KV of the prompt, cold prefill seconds, next-token step seconds, tokens agree)."""
    from transformers import DynamicCache

    from kvtier.connectors.hf_kv import dynamic_cache_to_kv, kv_to_dynamic_cache
    from kvtier.demo.models import load_smollm2

    model, _ = load_smollm2(progress=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, NUM_TOKENS), generator=g)
    times = []
    with torch.inference_mode():
        for _ in range(prefill_runs):
            cache = DynamicCache(config=model.config)
            started = time.perf_counter()
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - started)
        cold_next = int(out.logits[0, -1].argmax())
        kv = dynamic_cache_to_kv(out.past_key_values, NUM_TOKENS)
        # what a full hit still computes: the last prompt token over the 2,047 retrieved ones
        started = time.perf_counter()
        cache = kv_to_dynamic_cache(kv[:, :, : NUM_TOKENS - 1], model.config)
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1,
                     attention_mask=torch.ones(1, NUM_TOKENS, dtype=torch.long))
        step_seconds = time.perf_counter() - started
    same = int(step.logits[0, -1].argmax()) == cold_next
    return ids[0].tolist(), kv.contiguous(), statistics.median(times), step_seconds, same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-model", action="store_true", help="random KV, L2 timings only (no SmolLM2)")
    ap.add_argument("--runs", type=int, default=3, help="retrieve runs per adapter (median)")
    ap.add_argument("--prefill-runs", type=int, default=3, help="cold prefill runs (median)")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(KINDS))
    ap.add_argument("--codecs", default="none", help="comma-separated codec specs to write each L2 with")
    args = ap.parse_args()
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    logging.basicConfig(level=logging.WARNING)
    kinds = [k for k in KINDS if not args.only or k in args.only.split(",")]

    prefill_seconds = step_seconds = None
    if args.skip_model:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 49152, (NUM_TOKENS,), generator=g).tolist()
        kv = torch.randn(LAYOUT.chunk_shape(NUM_TOKENS), generator=g, dtype=torch.float32)
    else:
        tokens, kv, prefill_seconds, step_seconds, same = model_baseline(args.prefill_runs)
        print(f"cold prefill of {NUM_TOKENS} tokens on SmolLM2-135M fp32 ({torch.get_num_threads()} threads): "
              f"{prefill_seconds:.3f} s (median of {args.prefill_runs}); last-token step over 2,047 retrieved tokens: "
              f"{step_seconds * 1e3:.1f} ms, next token {'equals' if same else 'DIFFERS FROM'} cold prefill's")
    nbytes = kv.numel() * kv.element_size()
    print(f"prefix: {NUM_TOKENS} tokens = {NUM_TOKENS // CHUNK} chunks of {CHUNK}, {nbytes / 2**20:.1f} MiB; "
          f"retrieve = median of {args.runs} runs into an empty L1; MiB/s = 2^20 bytes per second")
    header = f"{'L2':22s} {'codec':14s} {'MiB moved':>9s} {'write s':>8s} {'retrieve s':>10s} {'MiB/s':>7s}"
    if prefill_seconds is not None:
        header += f" {'retrieve/prefill':>16s} {'est. TTFT s':>11s} {'prefill/TTFT':>12s}"
    print(header)
    with tempfile.TemporaryDirectory(prefix="bench-l2-restart-") as tmp:
        for kind in kinds:
            with contextlib.ExitStack() as stack:
                if not kind.startswith("local_disk"):
                    handle = stack.enter_context(STARTERS[kind](tmp))
                for codec in codecs:  # one store per codec: each its own folder / prefix
                    tag = codec.replace("+", "-").replace(":", "-").replace("=", "-").replace(",", "-")
                    if kind.startswith("local_disk"):
                        spec = {"type": "local_disk", "path": f"{tmp}/{kind}-{tag}",
                                "direct_io": kind.endswith("direct_io")}
                    else:
                        spec = adapter_spec(kind, handle, 8, f"restart-{tag}/")
                    m = bench_adapter({**spec, "codec": codec}, tokens, kv, args.runs)
                    line = (f"{kind:22s} {codec:14s} {m['record_bytes'] / 2**20:9.2f} {m['write_seconds']:8.3f} "
                            f"{m['retrieve_seconds']:10.3f} {nbytes / 2**20 / m['retrieve_seconds']:7.0f}")
                    if prefill_seconds is not None:
                        ttft = m["retrieve_seconds"] + step_seconds
                        line += (f" {m['retrieve_seconds'] / prefill_seconds:16.3f} {ttft:11.3f} "
                                 f"{prefill_seconds / ttft:11.1f}x")
                    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
