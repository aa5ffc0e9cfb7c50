"""RAG with non-prefix reuse (issue 18): TTFT and quality of blended reuse vs full prefill and prefix-only caching.

Workload: 8 documents of 512-1,024 tokens of real text (``benchmarks/corpus.py``: the licences and package docs
Debian ships), a short shared system prefix, and prompts of 3-4 documents in random order followed by a
question; SmolLM2-135M-Instruct fp32 on CPU (``--model gemma3``: Gemma-3-270M, a base model with sliding-window
layers, prompts as plain text after its BOS). For the same prompts, in one run, interleaved prompt by prompt:

  full      a full prefill (``model(ids)``): the baseline every ratio is against
  prefix    prefix-only caching, ``HFConnector.prefill`` over its own KVCache, warmed with ``[prefix][doc]`` for
            every document (its hit rate: reused tokens / prompt tokens)
  blend@f   ``HFConnector.prefill_segments`` with recompute fraction ``f`` over its own KVCache, every document
            stored once first, computed after the system prefix (as a RAG server would); ``f`` = the default
            (``hf_blend.DEFAULT_FRACTION``), 0 (reuse without recompute) and every ``--sweep`` fraction (1: a full
            prefill, which must give identical answers)

TTFT is call to logits of the last prompt token. Quality against the full prefill of the same prompt: the greedy
first 32 answer tokens identical (% of prompts) and the mean KL divergence KL(full || blended) of the first
answer token's distribution (nats).

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/rag_blend.py [--prompts 40] [--sweep 0,0.05,0.1,0.15,0.2,0.3,1]
        [--chart docs/img/rag_blend.png] [--seed 0] [--head-tokens N] [--refine-layers N] [--widen X]
        [--model smollm2|gemma3]

Besides TTFT, each blended row splits it into assembly (looking the documents up, copying and re-rotating their
KV) and recompute (``blend.recompute``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from corpus import Corpus
from kvtier.blend import segments_from_lengths
from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_kv import model_identity_of
from kvtier.connectors.hf_blend import DEFAULT_FRACTION, DEFAULT_HEAD_TOKENS, DEFAULT_REFINE_LAYERS, DEFAULT_WIDEN
from kvtier.demo.models import load_gemma3, load_smollm2
from kvtier.layout import KVLayout

NUM_DOCS = 8
DOC_TOKENS = (512, 1024)
ANSWER_TOKENS = 32
CHUNK_SIZE = 256
# per model: (loader, title, system prefix, question template); "{bos}" is the tokenizer's BOS (Gemma needs it)
MODELS = {
    "smollm2": (load_smollm2, "SmolLM2-135M fp32 CPU",
                "<|im_start|>system\nYou are a helpful assistant. Answer the question using the documents below."
                "<|im_end|>\n<|im_start|>user\n", "Question: {}<|im_end|>\n<|im_start|>assistant\n"),
    "gemma3": (load_gemma3, "Gemma-3-270M fp32 CPU",
               "{bos}You are a helpful assistant. Answer the question using the documents below.\n\n",
               "Question: {}\nAnswer:"),
}
QUESTIONS = ("Which software licence do these documents talk about?", "Summarize the first document in one sentence.",
             "Who are the authors named in these documents?", "What changed in the most recent release?",
             "Which document mentions warranty, and what does it say?", "What is the main topic of the last document?")


def build_workload(tokenizer, num_prompts: int, seed: int, model: str = "smollm2"):
    """``(prefix_ids, docs, prompts)``: docs are token-id lists; each prompt is ``(ids, lengths, kinds)``."""
    _, _, system, ask = MODELS[model]
    rng = random.Random(seed)
    corpus = Corpus(tokenizer, seed)
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    prefix = enc(system.format(bos=tokenizer.bos_token or ""))
    # each document ends in a blank line, so the next one (or the question) starts a paragraph
    docs = [enc(corpus.draw(rng.randint(*DOC_TOKENS)) + "\n\n") for _ in range(NUM_DOCS)]
    prompts = []
    for _ in range(num_prompts):
        chosen = rng.sample(range(NUM_DOCS), rng.choice((3, 4)))
        question = enc(ask.format(rng.choice(QUESTIONS)))
        parts = [prefix] + [docs[d] for d in chosen] + [question]
        ids = [t for part in parts for t in part]
        prompts.append((ids, [len(p) for p in parts], ["prefix"] + ["doc"] * len(chosen) + ["text"]))
    return prefix, docs, prompts


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats of the softmax distributions of two ``[1, vocab]`` logits."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


@torch.inference_mode()
def full_prefill(model, ids: torch.Tensor):
    started = time.perf_counter()
    out = model(ids, past_key_values=DynamicCache(), attention_mask=torch.ones_like(ids), use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1, :], out.past_key_values, time.perf_counter() - started


def run(args) -> dict:
    model, tokenizer = MODELS[args.model][0](progress=False)
    model_id, layout = model_identity_of(model), KVLayout.from_model(model)
    open_cache = lambda size: KVCache(build_config({"chunk_size": CHUNK_SIZE, "l1_size_gb": size}),  # noqa: E731
                                      model_id, layout)
    prefix_conn = HFConnector(model, open_cache("3GiB"), model_id=model_id)
    blend_conn = HFConnector(model, open_cache("1GiB"), model_id=model_id)
    prefix, docs, prompts = build_workload(tokenizer, args.prompts, args.seed, args.model)
    fractions = list(dict.fromkeys([DEFAULT_FRACTION, 0.0, *args.sweep]))
    print(f"{len(prompts)} prompts, {NUM_DOCS} documents of {min(map(len, docs))}-{max(map(len, docs))} tokens, "
          f"prompts of {min(len(p[0]) for p in prompts)}-{max(len(p[0]) for p in prompts)} tokens, "
          f"chunk {CHUNK_SIZE}, fractions {fractions}", flush=True)

    # warm-up (not measured): the model once, then every document stored as a RAG server would
    full_prefill(model, torch.tensor([prompts[0][0]]))
    knobs = {"head_tokens": args.head_tokens, "refine_layers": args.refine_layers, "widen": args.widen}
    for doc in docs:
        blend_conn.prefill_segments(torch.tensor([prefix + doc]),
                                    segments_from_lengths([len(prefix), len(doc)], ["prefix", "doc"]), **knobs)
        prefix_conn.prefill(torch.tensor([prefix + doc]))

    rows = {"full": [], "prefix": [], **{f: [] for f in fractions}}
    hit_tokens = prompt_tokens = 0
    for n, (ids_list, lengths, kinds) in enumerate(prompts):
        ids = torch.tensor([ids_list])
        segs = segments_from_lengths(lengths, kinds)
        ref_logits, ref_past, ref_ttft = full_prefill(model, ids)
        ref_answer = blend_conn.decode(ref_logits, ref_past, ids.shape[1], ANSWER_TOKENS)
        rows["full"].append(ref_ttft)
        _, _, stats = prefix_conn.prefill(ids)
        rows["prefix"].append(stats["ttft_seconds"])
        hit_tokens += stats["num_hit_tokens"]
        prompt_tokens += stats["num_prompt_tokens"]
        line = [f"prompt {n + 1:>3}: {ids.shape[1]} tokens, full {ref_ttft:.3f} s, prefix {stats['ttft_seconds']:.3f} s "
                f"(hit {stats['num_hit_tokens']})"]
        for f in fractions:
            logits, past, stats = blend_conn.prefill_segments(ids, segs, fraction=f, **knobs)
            assert f == 1 or (stats["blended"] and stats["num_segment_stored"] == 0), stats  # documents were warmed
            answer = blend_conn.decode(logits, past, ids.shape[1], ANSWER_TOKENS)
            rows[f].append({"ttft": stats["ttft_seconds"], "same": answer == ref_answer, "kl": kl(ref_logits, logits),
                            "recomputed": stats["num_recomputed_tokens"] / ids.shape[1],
                            "assembly": stats.get("retrieve_seconds", 0.0), "recompute": stats.get("prefill_seconds",
                                                                                                   stats["ttft_seconds"])})
            line.append(f"blend@{f:g} {stats['ttft_seconds']:.3f} s {'=' if answer == ref_answer else 'x'}")
        print(", ".join(line), flush=True)
    return {"rows": rows, "fractions": fractions, "hit_rate": hit_tokens / prompt_tokens, "knobs": knobs,
            "title": MODELS[args.model][1]}


def report(result: dict) -> list[dict]:
    rows, fractions = result["rows"], result["fractions"]
    full = statistics.mean(rows["full"])
    prefix = statistics.mean(rows["prefix"])
    print(f"\nfull prefill (baseline)  mean TTFT {full:.3f} s (median {statistics.median(rows['full']):.3f})")
    print(f"prefix-only caching      mean TTFT {prefix:.3f} s = {prefix / full:.3f}x full; hit rate "
          f"{result['hit_rate'] * 100:.1f}% of prompt tokens")
    print(f"blending knobs: {result['knobs']}")
    table = []
    for f in fractions:
        r = rows[f]
        ttft = statistics.mean(x["ttft"] for x in r)
        same = 100 * sum(x["same"] for x in r) / len(r)
        entry = {"fraction": f, "ttft_seconds": ttft, "ttft_vs_full": ttft / full, "ttft_vs_prefix": ttft / prefix,
                 "identical_percent": same, "mean_kl": statistics.mean(x["kl"] for x in r),
                 "recomputed_share": statistics.mean(x["recomputed"] for x in r),
                 "assembly_seconds": statistics.mean(x["assembly"] for x in r),
                 "recompute_seconds": statistics.mean(x["recompute"] for x in r)}
        table.append(entry)
        label = " (default)" if f == DEFAULT_FRACTION else " (reuse without recompute)" if f == 0 else ""
        print(f"blended @ {f:<5g}{label:<27} mean TTFT {ttft:.3f} s = {entry['ttft_vs_full']:.3f}x full, "
              f"{entry['ttft_vs_prefix']:.3f}x prefix-only; first {ANSWER_TOKENS} tokens identical {same:.1f}%, "
              f"mean KL {entry['mean_kl']:.4f}, recomputed {entry['recomputed_share'] * 100:.1f}% of tokens "
              f"(assembly {entry['assembly_seconds']:.3f} s + recompute {entry['recompute_seconds']:.3f} s)")
    print("issue 18 targets: blended TTFT <= 0.35x full and <= 0.5x prefix-only; identical >= 90% at the default")
    return table


def chart(table: list[dict], path: Path, num_prompts: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = sorted(table, key=lambda e: e["fraction"])
    xs = [100 * e["fraction"] for e in table]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [e["ttft_vs_full"] for e in table], marker="o", color="#4477aa", label="TTFT / full prefill")
    ax.set_xlabel("recompute fraction (% of reused document tokens)")
    ax.set_ylabel("TTFT / full prefill", color="#4477aa")
    ax.set_ylim(0, max(1.0, max(e["ttft_vs_full"] for e in table) * 1.1))
    right = ax.twinx()
    right.plot(xs, [e["identical_percent"] for e in table], marker="s", color="#cc3311",
               label=f"first {ANSWER_TOKENS} tokens identical")
    right.set_ylabel(f"% prompts, first {ANSWER_TOKENS} answer tokens identical", color="#cc3311")
    right.set_ylim(0, 105)
    ax.set_title(f"Blended reuse, {title}, {num_prompts} RAG prompts of 3-4 documents")
    fig.legend(loc="lower right", bbox_to_anchor=(0.88, 0.15), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40, help="number of prompts (default 40)")
    ap.add_argument("--sweep", default="0,0.05,0.1,0.15,0.2,0.3,1",
                    help="comma-separated recompute fractions in [0, 1] (the default and 0 always run)")
    ap.add_argument("--chart", type=Path, default=None, help="draw the sweep (TTFT ratio, identical %%) here")
    ap.add_argument("--seed", type=int, default=0, help="picks documents, subsets, order and questions")
    ap.add_argument("--head-tokens", type=int, default=DEFAULT_HEAD_TOKENS,
                    help="first tokens of each later document always recomputed")
    ap.add_argument("--refine-layers", type=int, default=DEFAULT_REFINE_LAYERS,
                    help="gradual filtering: layers narrowing the selection after the check layer (0: none)")
    ap.add_argument("--widen", type=float, default=DEFAULT_WIDEN,
                    help="with --refine-layers: how much larger the check layer's selection is")
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="the model (default smollm2)")
    args = ap.parse_args()
    try:
        args.sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sweep takes comma-separated numbers, got {args.sweep!r}")
    if any(not 0 <= f <= 1 for f in args.sweep) or args.prompts < 1:
        ap.error("--sweep fractions must lie in [0, 1] and --prompts must be >= 1")
    torch.manual_seed(args.seed)
    result = run(args)
    table = report(result)
    if args.chart:
        chart(table, args.chart, args.prompts, result["title"])


if __name__ == "__main__":
    main()
