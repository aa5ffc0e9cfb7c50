"""``kvtier demo --rag``: questions over shuffled subsets of real documents, answered three ways side by side.

The documents are texts Debian ships (the licences in ``/usr/share/common-licenses``, then package READMEs under
``/usr/share/doc``), each cut to ``--max-document-tokens``. Every prompt is the chat template's head (system
prompt, the user turn's start), ``--per-question`` documents in a shuffled order, and a question. Each document is
ingested once first, as a RAG server would (``[head][document]``, stored for both caches below). Then every
question is answered by:

- **cold**: a full prefill, no cache;
- **prefix-only**: ``HFConnector.prefill`` (reuses the prompt's leading chunks: the head and the first document);
- **blended**: ``connectors.hf_rag.RAG.query`` (every document's KV reused wherever it stands, re-rotated, and
  ``--fraction`` of its tokens recomputed; ``kvtier.blend``). Its answers are expected to differ from cold ones
  now and then: the demo measures by how much (first tokens, teacher-forced top-1).

One cache holds both: prefix chunks and segment chunks never share a key.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from pathlib import Path

from kvtier.demo.run import _warm_up, cache_place, cleared_cache, read_document
from kvtier.errors import KVTierError

LICENSES = Path("/usr/share/common-licenses")
DOCS = Path("/usr/share/doc")
RAG_SYSTEM = "You are a helpful assistant. Answer the question using only the documents the user gives, briefly."
RAG_QUESTIONS = (
    "Which of these documents is a software licence, and what is it called?",
    "What do these documents say about warranty?",
    "Summarize the first document in one sentence.",
    "May I sell copies of software under these terms?",
    "What must I keep when I redistribute the work?",
    "Who wrote or published the last document?",
)
MARK = "\x00"  # where the user's content goes in the rendered chat template


def document_paths(count: int, seed: int, roots=(LICENSES, DOCS)) -> list[Path]:
    """``count`` readable text files: the licences (no symbolic links), then ``README`` files of packages' docs,
    in a seeded shuffle of each group. Raises KVTierError when fewer exist."""
    licences = sorted(p for p in roots[0].glob("*") if p.is_file() and not p.is_symlink()) if roots[0].is_dir() else []
    readmes = sorted(p for p in roots[1].glob("*/README*") if p.is_file() and not p.is_symlink()
                     and not p.name.endswith((".gz", ".html"))) if len(roots) > 1 and roots[1].is_dir() else []
    rng = random.Random(seed)
    rng.shuffle(licences)
    rng.shuffle(readmes)
    found = (licences + readmes)[:count]
    if len(found) < count:
        raise KVTierError(f"--documents {count}: only {len(found)} text files found under "
                          f"{', '.join(map(str, roots))}; ask for fewer")
    return found


def template_parts(tokenizer) -> tuple[list[int], str]:
    """The chat template's head (system prompt, the user turn's start) as token ids, and the text after the user's
    content (the end of the turn, the assistant's start)."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": RAG_SYSTEM}, {"role": "user", "content": MARK}],
                                         add_generation_prompt=True, tokenize=False)
    head, _, tail = text.partition(MARK)
    return tokenizer(head, add_special_tokens=False).input_ids, tail


def build_workload(tokenizer, paths, max_document_tokens: int, num_questions: int, per_question: int, seed: int):
    """``(head, docs, prompts)``: ``docs`` token-id lists (each document tokenized alone, ending in a blank line,
    so its tokens are the same wherever it stands); each prompt a dict: ``question`` (text), ``order`` (document
    indexes), ``question_ids`` (the question and the template's tail), ``num_tokens``."""
    head, tail = template_parts(tokenizer)
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    docs = [enc(read_document(tokenizer, p, max_document_tokens) + "\n\n") for p in paths]
    rng = random.Random(seed)
    prompts = []
    for i in range(num_questions):
        order = rng.sample(range(len(docs)), min(per_question, len(docs)))
        question = RAG_QUESTIONS[i % len(RAG_QUESTIONS)]
        parts = [head, *(docs[d] for d in order), enc(f"Question: {question}{tail}")]
        prompts.append({"question": question, "order": order, "question_ids": parts[-1],
                        "num_tokens": sum(map(len, parts))})
    return head, docs, prompts


def _answer(connector, tokenizer, logits, past, num_prompt: int, max_new_tokens: int) -> tuple[list[int], str]:
    ids = connector.decode(logits, past, num_prompt, max_new_tokens, tokenizer.eos_token_id)
    return ids, tokenizer.decode(ids, skip_special_tokens=True).strip()


def _teacher_forced(model, logits, past, num_prompt: int, reference: list[int]) -> int:
    """Answer positions whose top token is ``reference``'s when ``reference`` is fed after the prompt's KV ``past``
    (grown in place)."""
    import torch

    tops = [int(logits.argmax(-1))]
    if len(reference) > 1:
        with torch.inference_mode():
            out = model(torch.tensor([reference[:-1]]), past_key_values=past, use_cache=True,
                        attention_mask=torch.ones((1, num_prompt + len(reference) - 1), dtype=torch.long))
        tops += out.logits[0].argmax(-1).tolist()
    return sum(a == b for a, b in zip(tops, reference))


def ask(rag, tokenizer, head: list[int], docs: list[list[int]], prompt: dict, max_new_tokens: int) -> dict:
    """Answer one prompt cold, prefix-only and blended (``rag``: a ``connectors.hf_rag.RAG``); returns one row of the
    demo's table, with the blended answer's fidelity to the cold one (first token, teacher-forced tokens)."""
    import torch

    connector = rag.connector
    chosen = [docs[d] for d in prompt["order"]]
    ids, _ = rag.prompt(head, chosen, prompt["question_ids"])
    n = ids.shape[1]
    row = {"question": prompt["question"], "order": prompt["order"], "num_prompt_tokens": n}
    with torch.inference_mode():
        started = time.perf_counter()
        out = connector.model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
        row["cold_ttft_seconds"] = time.perf_counter() - started
    cold_ids, row["cold_answer"] = _answer(connector, tokenizer, out.logits[:, -1], out.past_key_values, n, max_new_tokens)
    logits, past, stats = connector.prefill(ids)
    row["prefix_ttft_seconds"], row["prefix_hit_tokens"] = stats["ttft_seconds"], stats["num_hit_tokens"]
    prefix_ids, row["prefix_answer"] = _answer(connector, tokenizer, logits, past, n, max_new_tokens)
    got = rag.query(head, chosen, prompt["question_ids"])
    row.update(blend_ttft_seconds=got.stats["ttft_seconds"], blend_hit_tokens=got.stats["num_hit_tokens"],
               blend_recomputed_tokens=got.stats["num_recomputed_tokens"], blended=got.stats["blended"])
    blend_ids, row["blend_answer"] = _answer(connector, tokenizer, got.logits, got.past, n, max_new_tokens)
    if got.past.get_seq_length() > n:  # back to the prompt's KV (decode grew it), to feed the cold answer after it
        got.past.crop(n - got.past.get_seq_length())
    row["blend_forced_matches"] = _teacher_forced(connector.model, got.logits, got.past, n, cold_ids)
    row["num_answer_tokens"] = len(cold_ids)
    row["blend_first_token_same"] = blend_ids[0] == cold_ids[0]
    row["prefix_identical"], row["blend_identical"] = prefix_ids == cold_ids, blend_ids == cold_ids
    return row


def run_rag_demo(opts: dict, log=lambda msg: None) -> dict:
    """The ``--rag`` flow; returns the rows, the documents and the summary (the ``--json`` fields).

    Args:
        opts: ``documents`` (how many), ``questions``, ``per_question``, ``fraction``, ``seed``,
            ``max_document_tokens``, ``max_new_tokens``, ``chunk_size``, ``l1_size_gb``, ``disk_path``,
            ``server`` (as ``run_demo``), ``threads``, ``progress``.

    Mutates: clears the cache first (with a running server: all of its cache).
    """
    paths = document_paths(opts["documents"], opts["seed"])  # before the slow imports: too few files fail fast
    from kvtier.connectors.hf import HFConnector
    from kvtier.connectors.hf_kv import chunk_size_of
    from kvtier.connectors.hf_rag import RAG
    from kvtier.demo.models import load_smollm2

    with contextlib.ExitStack() as stack:
        server_url, admin_token, disk_path = stack.enter_context(cache_place(opts, log))
        model, tokenizer = load_smollm2(progress=opts.get("progress", True))
        _warm_up(model, opts.get("threads"))
        head, docs, prompts = build_workload(tokenizer, paths, opts["max_document_tokens"], opts["questions"],
                                             opts["per_question"], opts["seed"])
        cache = stack.enter_context(cleared_cache(model, opts, server_url, admin_token, disk_path))
        connector = HFConnector(model, cache)
        rag = RAG(connector, tokenizer, fraction=opts["fraction"])
        chunk = chunk_size_of(cache) or 1
        short = [p.name for p, d in zip(paths, docs) if len(d) < chunk]
        if short:
            raise KVTierError(f"documents {', '.join(short)} are shorter than one chunk ({chunk} tokens); "
                              "raise --max-document-tokens or lower --chunk-size")
        log(f"ingesting {len(docs)} documents ({min(map(len, docs))}-{max(map(len, docs))} tokens each)")
        rag.ingest(docs, head)  # for blending: each document's KV after the head, under its segment key
        for doc in docs:
            connector.prefill(head + doc)  # for prefix-only reuse: [head][document] under prefix keys
        rows = []
        for i, prompt in enumerate(prompts):
            log(f"question {i + 1}/{len(prompts)} over documents {prompt['order']}: {prompt['question']}")
            rows.append(ask(rag, tokenizer, head, docs, prompt, opts["max_new_tokens"]))
    return {"rows": rows, "documents": [str(p) for p in paths], "mode": opts["server"] or "auto",
            "summary": rag_summary(rows, opts)}


def rag_summary(rows: list[dict], opts: dict) -> dict:
    """The ``--json`` fields: median TTFTs, the hit rates, identical answers, the blended answers' fidelity to the
    cold ones (first tokens the same, of ``num_questions``; teacher-forced top-1: the share of the cold answers'
    tokens blending's KV predicts when fed the cold answer), the fraction."""
    total = sum(r["num_prompt_tokens"] for r in rows)
    return {
        "num_documents": opts["documents"], "num_questions": len(rows), "fraction": opts["fraction"],
        "cold_ttft_seconds": statistics.median(r["cold_ttft_seconds"] for r in rows),
        "prefix_ttft_seconds": statistics.median(r["prefix_ttft_seconds"] for r in rows),
        "blend_ttft_seconds": statistics.median(r["blend_ttft_seconds"] for r in rows),
        "prefix_hit_rate": sum(r["prefix_hit_tokens"] for r in rows) / total,
        "blend_hit_rate": sum(r["blend_hit_tokens"] for r in rows) / total,
        "blend_recomputed_share": sum(r["blend_recomputed_tokens"] for r in rows) / total,
        "prefix_answers_identical": sum(r["prefix_identical"] for r in rows),
        "blend_answers_identical": sum(r["blend_identical"] for r in rows),
        "blend_first_tokens_same": sum(r["blend_first_token_same"] for r in rows),
        "blend_forced_top1": sum(r["blend_forced_matches"] for r in rows) / sum(r["num_answer_tokens"] for r in rows),
        "blended": all(r["blended"] for r in rows),
    }
