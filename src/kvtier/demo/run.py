"""``kvtier demo``: multi-round question answering over one long document on a real model.

Round 1 prefills the whole prompt (cold). Round 2 asks the round-1 question again and later rounds ask
new questions; all reuse the document prefix from kvtier. Then a second OS process (``python -m kvtier
demo --child ...``) answers a new question over the same document, reusing the prefix through the local
disk tier (or through the server given by ``--server``). Model: SmolLM2-135M-Instruct (``kvtier.demo.models``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click

from kvtier.errors import KVTierError

DEFAULT_DOCUMENTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL")
SYSTEM_PROMPT = "You are a helpful assistant. Answer questions about the document the user gives you, briefly."
QUESTIONS = (
    "What is the main purpose of this document?",
    "What does the document say about warranty?",
    "May I sell copies of a program covered by this license?",
    "What must I do when I distribute a modified version?",
    "What happens if I violate the terms of this license?",
    "Does this license say anything about patents?",
)
CROSS_PROCESS_QUESTION = "Who may use the document's terms, and under what conditions?"


def find_document(path: str | None, defaults=DEFAULT_DOCUMENTS) -> Path:
    """The document to read: ``path``, else the first existing file among ``defaults``.

    Raises:
        KVTierError: ``path`` is not a readable file, or no default document exists.
    """
    if path:
        doc = Path(path)
        if not doc.is_file():
            raise KVTierError(f"document {path} is not a readable file; pass --document with a text file")
        return doc
    for candidate in defaults:
        if Path(candidate).is_file():
            return Path(candidate)
    raise KVTierError(f"no default document found (looked for {', '.join(map(str, defaults))}); "
                      "pass --document FILE with a long text file (2,000+ tokens)")


def read_document(tokenizer, path: Path, max_tokens: int) -> str:
    """The document's text, cut at a line end so that it tokenizes to at most ``max_tokens`` tokens."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError as exc:
        raise KVTierError(f"cannot read document {path}: {exc.strerror}; pass --document with a text file") from exc
    if not text:
        raise KVTierError(f"document {path} is empty; pass --document with a long text file")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) > max_tokens:
        cut = tokenizer.decode(ids[:max_tokens])
        text = cut[: cut.rfind("\n")].rstrip() if "\n" in cut else cut
    return text


def build_prompt(tokenizer, document: str, question: str) -> list[int]:
    """Token ids of the chat prompt: system prompt, then the document and the question as the user turn.

    The document comes before the question, so prompts over the same document share a long token prefix.
    """
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{document}\n\nQuestion: {question}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def open_cache(model, *, server: str | None, chunk_size: int | None, l1_size_gb: str, disk_path: str | None,
               events: bool = False):
    """A ``kvtier.client.Client`` for the server URL ``server``; else an in-process ``KVCache`` over L1 and
    a local disk tier at ``disk_path``. ``chunk_size`` None: 256 in process; the server's own with a server.
    Keys name the weights' identity (the converted SmolLM2 folder's, ``hf_kv.model_identity_of``)."""
    from kvtier.connectors.hf_kv import model_identity_of
    from kvtier.layout import KVLayout

    layout = KVLayout.from_model(model)
    model_id = model_identity_of(model)
    if server:
        from kvtier.client import Client

        client = Client(server, model=model_id, layout=layout, expect={"chunk_size": chunk_size} if chunk_size else None)
        if client.info is None:  # an engine would serve without the cache; a demo without one shows nothing
            client.close()
            raise KVTierError(f"cannot reach a kvtier server at {server}; start one (kvtier server --l1-size-gb 2 "
                              "--eviction-policy LRU) or use --server auto")
        return client
    from kvtier.cache import KVCache
    from kvtier.config import load_config

    overrides = {"chunk_size": chunk_size or 256, "l1_size_gb": l1_size_gb,
                 "l2_adapters": [{"type": "local_disk", "path": disk_path}], "enable_kv_events": events or None}
    return KVCache(load_config(overrides=overrides, environ=_cache_environ()), model_id, layout, publish_events=False)


def _cache_environ() -> dict[str, str]:
    # KVTIER_MODEL_CACHE belongs to kvtier.demo.models, not to the cache configuration tree
    return {k: v for k, v in os.environ.items() if k != "KVTIER_MODEL_CACHE"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def own_server(chunk_size: int | None, l1_size_gb: str, disk_path: str, log, timeout_seconds: float = 120.0):
    """Run ``kvtier server`` on free 127.0.0.1 ports for the demo (L1 in shared memory, local disk L2 at
    ``disk_path``); yields (its URL, its admin token) once its admin ``/healthz`` answers; stops it (SIGTERM,
    then SIGKILL)."""
    port, admin_port, token = _free_port(), _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "kvtier", "server", "--host", "127.0.0.1", "--port", str(port),
           "--admin-port", str(admin_port), "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU",
           "--chunk-size", str(chunk_size or 256), "--log-level", "WARNING",
           "--l2-adapter", json.dumps({"type": "local_disk", "path": disk_path})]
    url = f"tcp://127.0.0.1:{port}"
    log(f"starting a kvtier server at {url}")
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errors,
                                env={**_cache_environ(), "KVTIER_ADMIN_TOKEN": token})
        try:
            deadline = time.monotonic() + timeout_seconds
            while not _healthy(f"http://127.0.0.1:{admin_port}/healthz"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    errors.seek(0)
                    tail = "\n".join(errors.read().strip().splitlines()[-10:])
                    raise KVTierError(f"the demo's kvtier server did not start (exit {proc.poll()}):\n{tail}")
                time.sleep(0.2)
            yield url, token
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return reply.status == 200
    except (OSError, ValueError):
        return False


def _warm_up(model, threads: int | None = None) -> None:
    """Set torch's CPU threads (None: torch's default) and run one tiny forward pass: the first call in a
    process pays one-time setup that is not prefill time."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]]), attention_mask=torch.ones((1, 4), dtype=torch.long))


def answer(connector, tokenizer, document: str, question: str, max_new_tokens: int) -> dict:
    """Answer one question with the connector; returns one table row (tokens, hits, TTFT, answer)."""
    prompt = build_prompt(tokenizer, document, question)
    output, stats = connector.generate(prompt, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    new_ids = output[0, len(prompt):].tolist()
    return {"question": question, "num_prompt_tokens": stats["num_prompt_tokens"],
            "num_hit_tokens": stats["num_hit_tokens"], "ttft_seconds": stats["ttft_seconds"],
            **{k: stats[k] for k in ("lookup_seconds", "retrieve_seconds", "prefill_seconds", "store_seconds")},
            "answer_ids": new_ids, "answer": tokenizer.decode(new_ids, skip_special_tokens=True).strip()}


def _event_summary(cache) -> str:
    take = getattr(cache, "take_events", None)
    if take is None:
        return ""
    counts: dict[str, int] = {}
    for event in take():
        name = f"{type(event).__name__}({getattr(event, 'medium', None) or '-'})"
        counts[name] = counts.get(name, 0) + len(getattr(event, "block_hashes", None) or [1])
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def _child_command(opts: dict, document_path: Path, server_url: str | None, disk_path: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "kvtier", "demo", "--child", "--document", str(document_path),
           "--l1-size-gb", str(opts["l1_size_gb"]), "--max-new-tokens", str(opts["max_new_tokens"]),
           "--max-document-tokens", str(opts["max_document_tokens"])]
    for flag in ("chunk_size", "threads"):
        if opts.get(flag):
            cmd += ["--" + flag.replace("_", "-"), str(opts[flag])]
    return cmd + (["--server", server_url] if server_url else ["--server", "off", "--disk-path", disk_path])


def run_child(opts: dict, document_path: Path, server_url: str | None, disk_path: str | None, log) -> dict:
    """Run the cross-process round in a separate OS process; its JSON answer line is returned."""
    log("round in a second process: a new question over the same document")
    proc = subprocess.run(_child_command(opts, document_path, server_url, disk_path), check=False, capture_output=True,
                          text=True, env=os.environ)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise KVTierError(f"the cross-process demo round failed (exit {proc.returncode}):\n{tail}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise KVTierError(f"the cross-process demo round printed no result; its output was:\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1])


@contextlib.contextmanager
def cache_place(opts: dict, log):
    """Where the demo's cache lives, from ``opts["server"]`` (``"auto"``: a server started here, ``"off"``: in
    process, else a running server's URL) and ``opts["disk_path"]`` (None: a temporary folder, removed at the end).
    Yields ``(server_url or None, admin_token or None, disk_path or None)``; stops what it started."""
    mode = opts["server"] or "auto"
    with contextlib.ExitStack() as stack:
        disk_path = opts["disk_path"]
        if disk_path is None and mode in ("auto", "off"):
            disk_path = tempfile.mkdtemp(prefix="kvtier-demo-")
            stack.callback(shutil.rmtree, disk_path, ignore_errors=True)
        server_url, admin_token = (None if mode == "off" else mode), None
        if mode == "auto":
            server_url, admin_token = stack.enter_context(own_server(opts["chunk_size"], opts["l1_size_gb"], disk_path, log))
        yield server_url, admin_token, disk_path


@contextlib.contextmanager
def cleared_cache(model, opts: dict, server_url, admin_token, disk_path):
    """The demo's cache (``open_cache``), emptied first so the first round is cold (another server: with
    ``$KVTIER_ADMIN_TOKEN``), closed at the end."""
    cache = open_cache(model, server=server_url, chunk_size=opts["chunk_size"], l1_size_gb=opts["l1_size_gb"],
                       disk_path=disk_path, events=opts.get("events", False))
    try:
        cache.clear(**({"admin_token": admin_token} if admin_token else {}))
        yield cache
    finally:
        cache.close()


def run_demo(opts: dict, log=lambda msg: None) -> dict:
    """The whole demo flow; returns the rounds and the summary (the ``--json`` fields).

    Args:
        opts: ``document``, ``rounds``, ``chunk_size`` (None: 256, or a running server's), ``l1_size_gb``,
            ``disk_path`` (None: a temporary folder), ``server`` (``"auto"``: start one for the demo, ``"off"``:
            in-process cache with a local disk tier, or a running server's URL), ``max_new_tokens``,
            ``max_document_tokens``, ``threads`` (torch CPU threads; None: torch's default), ``events``, ``progress``.
        log: called with one-line progress messages.

    Mutates: clears the cache first so round 1 is cold (with a running server: all of its cache).
    """
    document_path = find_document(opts["document"])  # before the slow imports: a bad path fails fast
    from kvtier.connectors.hf import HFConnector
    from kvtier.demo.models import load_smollm2

    mode = opts["server"] or "auto"
    with contextlib.ExitStack() as stack:
        server_url, admin_token, disk_path = stack.enter_context(cache_place(opts, log))
        model, tokenizer = load_smollm2(progress=opts.get("progress", True))
        _warm_up(model, opts.get("threads"))
        document = read_document(tokenizer, document_path, opts["max_document_tokens"])
        cache = stack.enter_context(cleared_cache(model, opts, server_url, admin_token, disk_path))
        connector = HFConnector(model, cache)
        questions = [QUESTIONS[0], QUESTIONS[0], *QUESTIONS[1:]]
        rounds = []
        for i in range(opts["rounds"]):
            question = questions[i % len(questions)]
            log(f"round {i + 1} ({'cold' if i == 0 else 'warm'}): {question}")
            row = answer(connector, tokenizer, document, question, opts["max_new_tokens"])
            row.update(round=str(i + 1), where="cold" if i == 0 else "warm", events=_event_summary(cache))
            rounds.append(row)
        flush = getattr(cache, "flush", None)
        if flush is not None and not flush(60.0):
            log("warning: some disk writes were still queued after 60 s")
        child = run_child(opts, document_path, server_url, disk_path, log)
        child.update(round=str(opts["rounds"] + 1), events="",
                     where="2nd process: " + ("disk" if mode == "off" else "server"))
        rounds.append(child)
    cold, warm = rounds[0], rounds[1:-1]
    summary = {
        "cold_ttft_seconds": cold["ttft_seconds"],
        "warm_ttft_seconds": statistics.median(r["ttft_seconds"] for r in warm),
        "cross_process_ttft_seconds": child["ttft_seconds"],
        "num_prompt_tokens": cold["num_prompt_tokens"],
        "num_hit_tokens": warm[0]["num_hit_tokens"],
        "outputs_identical": warm[0]["answer_ids"] == cold["answer_ids"],
    }
    return {"rounds": rounds, "summary": summary, "document": str(document_path), "mode": mode}


def run_child_round(opts: dict) -> None:
    """The second process: answer one new question, reusing the document prefix; print one JSON line."""
    from kvtier.connectors.hf import HFConnector
    from kvtier.demo.models import load_smollm2

    model, tokenizer = load_smollm2(progress=False)
    _warm_up(model, opts.get("threads"))
    document = read_document(tokenizer, find_document(opts["document"]), opts["max_document_tokens"])
    server = None if opts["server"] == "off" else opts["server"]
    cache = open_cache(model, server=server, chunk_size=opts["chunk_size"], l1_size_gb=opts["l1_size_gb"],
                       disk_path=opts["disk_path"])
    try:
        row = answer(HFConnector(model, cache), tokenizer, document, CROSS_PROCESS_QUESTION,
                     opts["max_new_tokens"])
    finally:
        cache.close()
    click.echo(json.dumps(row))
