"""``kvtier demo``: the click command and the table it prints (the flow is ``kvtier.demo.run``)."""

from __future__ import annotations

import json
import sys
import time

import click

from kvtier.demo.run import run_child_round, run_demo
from kvtier.errors import InputError
from kvtier.units import parse_size


def print_table(result: dict) -> None:
    """The rounds as a rich table on stdout, then the speedups."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier demo: SmolLM2-135M-Instruct over {result['document']} (cache: {result['mode']})")
    for name in ("round", "where", "prompt tokens", "hit tokens", "TTFT (s)"):
        table.add_column(name, justify="left" if name == "where" else "right", no_wrap=True)
    table.add_column("answer", overflow="fold", min_width=30)
    show_events = any(r.get("events") for r in result["rounds"])
    if show_events:
        table.add_column("events", overflow="fold")
    for r in result["rounds"]:
        text = r["answer"] if len(r["answer"]) <= 120 else r["answer"][:119] + "…"
        cells = [r["round"], r["where"], str(r["num_prompt_tokens"]), str(r["num_hit_tokens"]),
                 f"{r['ttft_seconds']:.3f}", text]
        table.add_row(*cells, *([r.get("events", "")] if show_events else []))
    console = Console(width=None if sys.stdout.isatty() else 200)  # a pipe or log gets whole answers
    console.print(table)
    s = result["summary"]
    cold, warm, cross = s["cold_ttft_seconds"], s["warm_ttft_seconds"], s["cross_process_ttft_seconds"]
    console.print(f"TTFT: cold {cold:.2f} s; warm {warm:.2f} s (median, speedup {cold / warm:.1f}x); "
                  f"second process {cross:.2f} s (speedup {cold / cross:.1f}x). "
                  f"Warm answer identical to cold: {s['outputs_identical']}")


WIDTH = 100  # columns the --rag output fits in


def print_rag_table(result: dict) -> None:
    """The ``--rag`` run on stdout in at most ``WIDTH`` columns: a table of TTFTs per question, each question with
    its three answers (marked where they differ from the cold one), the documents, the medians, and one line on
    what blending trades (its measured fidelity to the cold answers)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    s = result["summary"]
    console = Console(width=min(WIDTH, Console().width) if sys.stdout.isatty() else WIDTH)
    table = Table(title=f"kvtier demo --rag: SmolLM2-135M-Instruct, {s['num_documents']} documents, blended at "
                        f"{s['fraction']:g} recompute (cache: {result['mode']})")
    for name in ("#", "documents", "tokens", "cold TTFT (s)", "prefix-only TTFT (s) (hit)", "blended TTFT (s) (recomp.)"):
        table.add_column(name, justify="right")
    for i, r in enumerate(result["rows"]):
        table.add_row(str(i + 1), ",".join(map(str, r["order"])), str(r["num_prompt_tokens"]),
                      f"{r['cold_ttft_seconds']:.3f}", f"{r['prefix_ttft_seconds']:.3f} ({r['prefix_hit_tokens']})",
                      f"{r['blend_ttft_seconds']:.3f} ({r['blend_recomputed_tokens']})")
    console.print(table)
    for i, r in enumerate(result["rows"]):
        same = lambda key: "" if r[key] else " (differs from cold)"  # noqa: E731
        console.print(f"\nQ{i + 1} (documents {','.join(map(str, r['order']))}): {escape(r['question'])}")
        text = lambda key: escape(" ".join(r[key].split()))  # noqa: E731  one paragraph per answer
        console.print(f"  cold:        {text('cold_answer')}")
        console.print(f"  prefix-only: {text('prefix_answer')}{same('prefix_identical')}")
        console.print(f"  blended:     {text('blend_answer')}{same('blend_identical')}")
    console.print()
    for i, path in enumerate(result["documents"]):
        console.print(f"document {i}: {path}")
    cold = s["cold_ttft_seconds"]
    console.print(f"median TTFT: cold {cold:.2f} s; prefix-only {s['prefix_ttft_seconds']:.2f} s "
                  f"({s['prefix_ttft_seconds'] / cold:.2f}x, hit rate {s['prefix_hit_rate'] * 100:.0f}%); blended "
                  f"{s['blend_ttft_seconds']:.2f} s ({s['blend_ttft_seconds'] / cold:.2f}x, "
                  f"{s['blend_recomputed_share'] * 100:.0f}% of tokens recomputed). Answers identical to cold: "
                  f"prefix-only {s['prefix_answers_identical']}/{s['num_questions']}, "
                  f"blended {s['blend_answers_identical']}/{s['num_questions']}")
    console.print(f"Blending trades fidelity for TTFT: its answers are close to a full prefill's, not identical; "
                  f"here the first answer token matched cold in {s['blend_first_tokens_same']}/{s['num_questions']} "
                  f"questions and {s['blend_forced_top1'] * 100:.0f}% of the cold answers' tokens were its top token "
                  "(teacher-forced top-1).")


@click.command("demo")
@click.option("--document", type=click.Path(dir_okay=False), default=None,
              help="Text file to ask about (default: the GPL-3 text in /usr/share/common-licenses).")
@click.option("--rounds", type=click.IntRange(min=2), default=3, show_default=True,
              help="Rounds in this process: 1 cold, then warm (round 2 repeats round 1's question).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Tokens per chunk [default: 256; with a running server: the server's].")
@click.option("--l1-size-gb", default="1", show_default=True, help="L1 (host memory) budget, e.g. 1 or 512MiB.")
@click.option("--disk-path", type=click.Path(file_okay=False), default=None,
              help="Local disk tier folder (cleared at start) [default: a temporary folder removed at the end].")
@click.option("--server", default="auto", show_default=True,
              help="'auto': start a kvtier server for the demo (the second process reuses its shared L1); "
                   "'off': in-process cache (the second process reuses the local disk tier); or the URL of a "
                   "running server, e.g. tcp://127.0.0.1:5555 (its whole cache is cleared at start).")
@click.option("--json", "as_json", is_flag=True,
              help="Print only a JSON summary: cold_ttft_seconds, warm_ttft_seconds, cross_process_ttft_seconds, num_prompt_tokens, "
                   "num_hit_tokens, outputs_identical.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-document-tokens", type=click.IntRange(min=1), default=None,
              help="Cut each document to at most this many tokens (at a line end) [default: 2048; with --rag: 512].")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch CPU threads in both processes [default: torch's, one per core]. On a machine shared "
                   "with other busy processes, 1 avoids threads waiting on each other.")
@click.option("--events", is_flag=True, help="Show the KV cache events of each round (needs --server off).")
@click.option("--rag", is_flag=True,
              help="RAG instead: questions over shuffled subsets of --documents real documents, each answered cold, "
                   "with prefix-only caching and with blended reuse (documents reused wherever they stand).")
@click.option("--documents", "num_documents", type=click.IntRange(min=1), default=5, show_default=True,
              help="--rag: documents (the licences Debian ships, then package READMEs).")
@click.option("--questions", "num_questions", type=click.IntRange(min=1), default=4, show_default=True,
              help="--rag: questions, each over its own shuffled subset of the documents.")
@click.option("--per-question", type=click.IntRange(min=1), default=3, show_default=True,
              help="--rag: documents in each question's prompt.")
@click.option("--fraction", type=click.FloatRange(0, 1), default=None,
              help="--rag: share of the reused document tokens recomputed by blending [default: kvtier's, "
                   "kvtier.blend.DEFAULT_FRACTION].")
@click.option("--seed", type=int, default=0, show_default=True, help="--rag: picks the documents and the subsets.")
@click.option("--child", is_flag=True, hidden=True)
def demo(document, rounds, chunk_size, l1_size_gb, disk_path, server, as_json, max_new_tokens,
         max_document_tokens, threads, events, rag, num_documents, num_questions, per_question, fraction, seed, child):
    """Multi-round QA over a long document on SmolLM2-135M-Instruct, showing TTFT with kvtier (--rag: questions
    over shuffled documents, cold vs prefix-only vs blended)."""
    opts = {"document": document, "rounds": rounds, "chunk_size": chunk_size, "l1_size_gb": l1_size_gb,
            "disk_path": disk_path, "server": server, "max_new_tokens": max_new_tokens,
            "max_document_tokens": max_document_tokens or (512 if rag else 2048), "threads": threads,
            "events": events, "progress": not as_json}
    if child:
        if server == "auto" or (server == "off" and not disk_path):
            raise InputError("--child needs a server URL, or --server off with --disk-path (the demo starts it)")
        run_child_round(opts)
        return
    if rag and (document or events):
        raise InputError("--rag picks its own documents and has no --events; drop --document / --events")
    if events and server != "off":
        raise InputError("--events shows the in-process cache's events: add --server off "
                         "(with a server, watch them with `kvtier events`)")
    if parse_size(l1_size_gb) <= 0:  # here, not after the model has loaded
        raise InputError(f"--l1-size-gb must be positive, got {l1_size_gb!r}; e.g. 1 or 512MiB")
    started = time.perf_counter()
    log = (lambda msg: None) if as_json else (lambda msg: click.echo(msg, err=True))
    if rag:
        from kvtier.blend import DEFAULT_FRACTION
        from kvtier.demo.rag import run_rag_demo

        opts.update(documents=num_documents, questions=num_questions, per_question=per_question, seed=seed,
                    fraction=DEFAULT_FRACTION if fraction is None else fraction)
        result, show = run_rag_demo(opts, log=log), print_rag_table
    else:
        result, show = run_demo(opts, log=log), print_table
    if as_json:
        click.echo(json.dumps(result["summary"]))
    else:
        show(result)
        click.echo(f"demo finished in {time.perf_counter() - started:.1f} s", err=True)
