"""RAG with non-prefix reuse (issues 18, 43): TTFT, fidelity and task accuracy of blended reuse vs a full prefill and
prefix-only caching.

Workload: 8 documents of 512-1,024 tokens (``--docs debian``: texts Debian ships; ``--docs pydoc``: the Python
standard library's reference; ``benchmarks/rag_questions.py``), a short system prefix, and prompts of 3-4 documents
in random order followed by a question: two prompts in three an extraction question with a gold answer found in
exactly one document (one of the prompt's: "Continue this text from the documents.", the answer started
with the eight words before the gold), the rest an open question. SmolLM2-135M-Instruct fp32 on CPU
(``--model gemma3``: Gemma-3-270M, a base model, prompts as plain text after its BOS). The same prompts, in one run,
interleaved prompt by prompt:

  full      a full prefill (``model(ids)``): the baseline every ratio is against, and the reference answer
  prefix    prefix-only caching, ``HFConnector.prefill`` over its own KVCache, warmed with ``[prefix][doc]`` for
            every document
  blend@f   ``connectors.hf_rag.RAG.query`` at recompute fraction ``f`` over its own KVCache, every document
            ingested first (``RAG.ingest``, after the system prefix); ``f`` = the default
            (``kvtier.blend.DEFAULT_FRACTION``), 0 and every ``--sweep`` fraction

TTFT is call to logits of the last prompt token. Fidelity against the full prefill of the same prompt (its greedy
answer of ``--answer-tokens`` tokens is the reference): first-token top-1 (% of prompts whose first answer token
is the full prefill's), teacher-forced top-1 (the reference answer fed after each method's prompt KV: % of answer
positions whose top token is the reference's; one early flip does not change the rest), identical answers (%) and
the first token's KL(full || method) (nats). Task accuracy: % of extraction prompts whose greedy answer's first
word is the gold. Issue 43's bar at the default fraction: TTFT <= 0.35x full, first-token top-1 >= 95 %, teacher-forced
top-1 >= 90 %, task accuracy within 10 points of the full prefill's.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/rag_blend.py [--docs debian|pydoc] [--model smollm2|gemma3]
        [--prompts 24] [--sweep 0,0.5] [--answer-tokens 32] [--seed 0] [--head-tokens N] [--refine-layers N]
        [--widen X] [--no-prefix-only] [--json out.json] [--chart out.png]
    .venv/bin/python benchmarks/rag_blend.py --chart out.png --chart-from run.json [run2.json ...]

``--chart``: teacher-forced top-1 against TTFT / full (``charts.rag_curves_chart``), one panel per run; the run of
issue 43's quality guard (``benchmarks/results/rag_guard_smollm2_pydoc.json``) adds the guard's curve.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvtier.blend import DEFAULT_FRACTION, DEFAULT_HEAD_TOKENS, DEFAULT_REFINE_LAYERS, DEFAULT_WIDEN
from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_kv import model_identity_of
from kvtier.connectors.hf_rag import RAG
from kvtier.demo.models import load_gemma3, load_smollm2
from kvtier.layout import KVLayout
from rag_questions import OPEN, answered, document_texts, extraction_questions

NUM_DOCS = 8
DOC_TOKENS = (512, 1024)
CHUNK_SIZE = 256
# per model: (loader, title, system prefix, question template); "{bos}" is the tokenizer's BOS (Gemma needs it)
MODELS = {
    "smollm2": (load_smollm2, "SmolLM2-135M fp32 CPU",
                "<|im_start|>system\nYou are a helpful assistant. Answer the question using the documents below."
                "<|im_end|>\n<|im_start|>user\n", "Question: {}<|im_end|>\n<|im_start|>assistant\n"),
    "gemma3": (load_gemma3, "Gemma-3-270M fp32 CPU",
               "{bos}You are a helpful assistant. Answer the question using the documents below.\n\n",
               "Question: {}\nAnswer:\n"),
}
OPEN_QUESTIONS = ("Summarize the first document in one sentence.", "What is the main topic of the last document?",
                  "Which document is the most technical, and why?", "What do these documents have in common?")
BAR = {"ttft_vs_full": 0.35, "first_top1_percent": 95.0, "forced_top1_percent": 90.0, "task_gap_points": 10.0}


def build_workload(tokenizer, num_prompts: int, seed: int, model: str, docset: str):
    """``(prefix_ids, docs, prompts)``: docs are token-id lists; each prompt a dict: ``docs`` (indexes in order),
    ``question`` (ids), ``gold`` (the extraction answer, or None for an open question)."""
    _, _, system, ask = MODELS[model]
    rng = random.Random(seed)
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    prefix = enc(system.format(bos=tokenizer.bos_token or ""))
    texts = document_texts(tokenizer, docset, [rng.randint(*DOC_TOKENS) for _ in range(NUM_DOCS)], seed)
    questions = extraction_questions(texts)
    # each document ends in a blank line, so the next one (or the question) starts a paragraph
    docs = [enc(text + "\n\n") for text in texts]
    prompts = []
    for n in range(num_prompts):
        chosen = rng.sample(range(NUM_DOCS), rng.choice((3, 4)))
        gold = None
        if n % 3 != 2 and any(questions[d] for d in chosen):
            target = rng.choice([d for d in chosen if questions[d]])
            lead, gold = rng.choice(questions[target])
            text = ask.format(OPEN) + lead  # the answer starts with the lead-in: its next word is the gold
        else:
            text = ask.format(rng.choice(OPEN_QUESTIONS))
        prompts.append({"docs": chosen, "question": enc(text), "gold": gold})
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


@torch.inference_mode()
def teacher_forced(model, logits, past, num_prompt: int, reference: list[int]) -> list[int]:
    """Each answer position's top token when ``reference`` is fed after the prompt's KV ``past`` (grown in place)."""
    tops = [int(logits.argmax(-1))]
    if len(reference) > 1:
        feed = torch.tensor([reference[:-1]])
        out = model(feed, past_key_values=past, attention_mask=torch.ones((1, num_prompt + feed.shape[1]),
                                                                          dtype=torch.long), use_cache=True)
        tops += out.logits[0].argmax(-1).tolist()
    return tops


def measure(conn, tokenizer, logits, past, n: int, ref: dict, gold, answer_tokens: int, ttft: float) -> dict:
    """One method's row for one prompt against the full prefill's ``ref`` (logits, answer ids)."""
    answer = conn.decode(logits, past, n, answer_tokens)
    if past.get_seq_length() > n:  # back to the prompt's KV (decode grew it)
        past.crop(n - past.get_seq_length())
    tops = teacher_forced(conn.model, logits, past, n, ref["answer"])
    return {"ttft": ttft, "first": tops[0] == ref["answer"][0],
            "forced": sum(a == b for a, b in zip(tops, ref["answer"])) / len(ref["answer"]),
            "same": answer == ref["answer"], "kl": kl(ref["logits"], logits),
            "correct": None if gold is None else answered(tokenizer.decode(answer, skip_special_tokens=True), gold)}


def run(args) -> dict:
    model, tokenizer = MODELS[args.model][0](progress=False)
    model_id, layout = model_identity_of(model), KVLayout.from_model(model)
    open_cache = lambda size: KVCache(build_config({"chunk_size": CHUNK_SIZE, "l1_size_gb": size}),  # noqa: E731
                                      model_id, layout)
    prefix_conn = HFConnector(model, open_cache("3GiB"), model_id=model_id)
    blend_conn = HFConnector(model, open_cache("1GiB"), model_id=model_id)
    prefix, docs, prompts = build_workload(tokenizer, args.prompts, args.seed, args.model, args.docs)
    fractions = list(dict.fromkeys([DEFAULT_FRACTION, 0.0, *args.sweep]))
    knobs = {"head_tokens": args.head_tokens, "refine_layers": args.refine_layers, "widen": args.widen}
    rags = {f: RAG(blend_conn, tokenizer, fraction=f, **knobs) for f in fractions}
    print(f"{args.docs} documents, {args.model}: {len(prompts)} prompts ({sum(p['gold'] is not None for p in prompts)} "
          f"with a gold answer), {NUM_DOCS} documents of {min(map(len, docs))}-{max(map(len, docs))} tokens, chunk "
          f"{CHUNK_SIZE}, fractions {fractions}", flush=True)

    # warm-up (not measured): the model once, then every document ingested as a RAG server would
    first = prompts[0]
    full_prefill(model, rags[DEFAULT_FRACTION].prompt(prefix, [docs[d] for d in first["docs"]], first["question"])[0])
    rags[DEFAULT_FRACTION].ingest(docs, prefix)
    for doc in docs if not args.no_prefix_only else ():
        prefix_conn.prefill(torch.tensor([prefix + doc]))

    rows = {"full": [], "prefix": [], **{f: [] for f in fractions}}
    hit_tokens = prompt_tokens = 0
    for i, p in enumerate(prompts):
        chosen = [docs[d] for d in p["docs"]]
        ids = rags[DEFAULT_FRACTION].prompt(prefix, chosen, p["question"])[0]
        n = ids.shape[1]
        ref_logits, ref_past, ref_ttft = full_prefill(model, ids)
        ref = {"logits": ref_logits, "answer": blend_conn.decode(ref_logits, ref_past, n, args.answer_tokens)}
        full_text = tokenizer.decode(ref["answer"], skip_special_tokens=True)
        rows["full"].append({"ttft": ref_ttft, "correct": None if p["gold"] is None else answered(full_text, p["gold"])})
        line = [f"prompt {i + 1:>3}: {n} tokens, full {ref_ttft:.3f} s"]
        if not args.no_prefix_only:
            logits, past, stats = prefix_conn.prefill(ids)
            hit_tokens += stats["num_hit_tokens"]
            prompt_tokens += n
            rows["prefix"].append(measure(prefix_conn, tokenizer, logits, past, n, ref, p["gold"], args.answer_tokens,
                                          stats["ttft_seconds"]))
            line.append(f"prefix {stats['ttft_seconds']:.3f} s")
        for f in fractions:
            out = rags[f].query(prefix, chosen, p["question"])
            assert out.stats["blended"] and out.stats["num_segment_stored"] == 0, out.stats  # documents were ingested
            row = measure(blend_conn, tokenizer, out.logits, out.past, n, ref, p["gold"], args.answer_tokens,
                          out.stats["ttft_seconds"])
            row["recomputed"] = out.stats["num_recomputed_tokens"] / n
            rows[f].append(row)
            line.append(f"blend@{f:g} {row['ttft']:.3f} s top-1 {'=' if row['first'] else 'x'} "
                        f"forced {row['forced'] * 100:.0f}%" + ("" if p["gold"] is None else
                                                                 f" {'ok' if row['correct'] else 'no'}"))
        if p["gold"] is not None:
            line.append(f"gold {p['gold']!r}: full {'ok' if rows['full'][-1]['correct'] else 'no'}")
        print(", ".join(line), flush=True)
    return {"rows": rows, "fractions": fractions, "hit_rate": hit_tokens / max(prompt_tokens, 1), "knobs": knobs,
            "title": MODELS[args.model][1], "docs": args.docs, "model": args.model, "prompts": len(prompts)}


def _accuracy(rows) -> float | None:
    graded = [r["correct"] for r in rows if r["correct"] is not None]
    return 100 * sum(graded) / len(graded) if graded else None


def report(result: dict) -> list[dict]:
    rows = result["rows"]
    full = statistics.mean(r["ttft"] for r in rows["full"])
    full_acc = _accuracy(rows["full"])
    graded = sum(r["correct"] is not None for r in rows["full"])
    print(f"\n{result['title']}, {result['docs']} documents, {result['prompts']} prompts ({graded} graded)")
    print(f"full prefill (baseline)  mean TTFT {full:.3f} s; task accuracy {full_acc:.1f}%")
    table = []
    for name in ["prefix", *result["fractions"]]:
        r = rows[name]
        if not r:  # --no-prefix-only
            continue
        ttft = statistics.mean(x["ttft"] for x in r)
        entry = {"method": "prefix-only" if name == "prefix" else f"blend@{name:g}",
                 "fraction": None if name == "prefix" else name, "ttft_seconds": ttft, "ttft_vs_full": ttft / full,
                 "first_top1_percent": 100 * sum(x["first"] for x in r) / len(r),
                 "forced_top1_percent": 100 * statistics.mean(x["forced"] for x in r),
                 "identical_percent": 100 * sum(x["same"] for x in r) / len(r),
                 "mean_kl": statistics.mean(x["kl"] for x in r), "task_accuracy_percent": _accuracy(r),
                 "full_task_accuracy_percent": full_acc}
        if name != "prefix":
            entry["recomputed_share"] = statistics.mean(x["recomputed"] for x in r)
        table.append(entry)
        label = " (default)" if name == DEFAULT_FRACTION else ""
        print(f"{entry['method']:<12}{label:<10} TTFT {ttft:.3f} s = {entry['ttft_vs_full']:.3f}x full; first-token "
              f"top-1 {entry['first_top1_percent']:.1f}%, teacher-forced top-1 {entry['forced_top1_percent']:.1f}%, "
              f"identical {entry['identical_percent']:.1f}%, KL {entry['mean_kl']:.4f}, task accuracy "
              f"{entry['task_accuracy_percent']:.1f}% (full {full_acc:.1f}%)"
              + (f", recomputed {entry['recomputed_share'] * 100:.1f}% of tokens" if name != "prefix" else ""))
    default = next(e for e in table if e["fraction"] == DEFAULT_FRACTION)
    met = {"ttft": default["ttft_vs_full"] <= BAR["ttft_vs_full"],
           "first-token top-1": default["first_top1_percent"] >= BAR["first_top1_percent"],
           "teacher-forced top-1": default["forced_top1_percent"] >= BAR["forced_top1_percent"],
           "task accuracy": abs(default["task_accuracy_percent"] - full_acc) <= BAR["task_gap_points"]}
    print("issue 43 bar at the default (TTFT <= 0.35x full, first-token top-1 >= 95%, teacher-forced top-1 >= 90%, "
          "task accuracy within 10 points of full): "
          + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", choices=("debian", "pydoc"), default="debian", help="the document set (default debian)")
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="the model (default smollm2)")
    ap.add_argument("--prompts", type=int, default=24, help="number of prompts (default 24)")
    ap.add_argument("--sweep", default="0.5", help="comma-separated recompute fractions in [0, 1] besides the "
                                                   "default and 0 (default 0.5)")
    ap.add_argument("--answer-tokens", type=int, default=32, help="greedy answer length (default 32)")
    ap.add_argument("--seed", type=int, default=0, help="picks documents, subsets, order and questions")
    ap.add_argument("--head-tokens", type=int, default=DEFAULT_HEAD_TOKENS,
                    help="first tokens of each later document always recomputed")
    ap.add_argument("--refine-layers", type=int, default=DEFAULT_REFINE_LAYERS,
                    help="gradual filtering: layers narrowing the selection after the check layer (0: none)")
    ap.add_argument("--widen", type=float, default=DEFAULT_WIDEN,
                    help="with --refine-layers: how much larger the check layer's selection is")
    ap.add_argument("--no-prefix-only", action="store_true",
                    help="skip prefix-only caching (its fidelity is exact by construction; saves ~0.7-1x a full "
                         "prefill per prompt on a slow model)")
    ap.add_argument("--json", type=Path, default=None, help="write the table here as JSON")
    ap.add_argument("--chart", type=Path, default=None,
                    help="draw fidelity vs TTFT of the fractions here (charts.rag_curves_chart; a --json file of "
                         "issue 43's guard run, 0e8dfbd, adds the guard's curve)")
    ap.add_argument("--chart-from", type=Path, nargs="*", default=(),
                    help="draw --chart from these --json files instead of running")
    args = ap.parse_args()
    try:
        args.sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sweep takes comma-separated numbers, got {args.sweep!r}")
    if any(not 0 <= f <= 1 for f in args.sweep) or args.prompts < 1 or args.answer_tokens < 1:
        ap.error("--sweep fractions must lie in [0, 1]; --prompts and --answer-tokens must be >= 1")
    if args.chart_from and not args.chart:
        ap.error("--chart-from needs --chart")
    if args.chart_from:
        runs = [json.loads(p.read_text()) for p in args.chart_from]
    else:
        torch.manual_seed(args.seed)
        result = run(args)
        runs = [{"docs": args.docs, "model": args.model, "prompts": args.prompts, "hit_rate": result["hit_rate"],
                 "table": report(result)}]
        if args.json:
            args.json.write_text(json.dumps(runs[0], indent=1))
    if args.chart:
        from charts import rag_curves_chart
        rag_curves_chart(runs, args.chart)
        print(f"wrote {args.chart}")


if __name__ == "__main__":
    main()
