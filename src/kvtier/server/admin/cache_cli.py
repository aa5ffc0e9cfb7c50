"""``kvtier cache lookup|pin|unpin|ttl|delete|sessions``: the management API (``server/admin/manage_http.py``) from a shell.

Each command calls a running server's admin HTTP (``--admin-url``, as ``kvtier status``) with the admin token from
``--admin-token`` / ``KVTIER_ADMIN_TOKEN`` or ``--token-file``, and prints a table (``--json``: the server's answer).
A refusal prints the server's message as one ``error: ...`` line, exit 2 (``kvtier.cli.main``).
"""

from __future__ import annotations

import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kvtier.errors import KVTierError


def _token(admin_token: str | None, token_file: str | None) -> str | None:
    if token_file is None:
        return admin_token
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise KVTierError(f"cannot read --token-file {token_file}: {exc.strerror}") from exc
    if not token:
        raise KVTierError(f"--token-file {token_file} is empty; write the server's admin token into it")
    return token


def _call(opts: dict, method: str, path: str, body: dict | None = None) -> dict:
    """The server's JSON answer to ``method path`` (``body`` as JSON). Raises KVTierError with its message."""
    url = opts["admin_url"].rstrip("/") + path
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if opts["token"]:
        headers["Authorization"] = f"Bearer {opts['token']}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
    except ValueError as exc:  # not a URL at all (no scheme)
        raise KVTierError(f"--admin-url {opts['admin_url']!r} is not an http URL (e.g. http://127.0.0.1:8080): "
                          f"{exc}") from exc
    try:
        with urllib.request.urlopen(request, timeout=opts["timeout_seconds"]) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc).get("error", exc.reason)
        except ValueError:
            message = exc.reason
        raise KVTierError(f"{url} answered {exc.code}: {message}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise KVTierError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}; is the server running?") from exc


def _common(fn):
    """The connection options every command takes."""
    for option in reversed([
        click.option("--admin-url", default="http://127.0.0.1:8080", show_default=True, help="The server's admin HTTP."),
        click.option("--admin-token", envvar="KVTIER_ADMIN_TOKEN", default=None,
                     help="The server's admin token (or KVTIER_ADMIN_TOKEN)."),
        click.option("--token-file", type=click.Path(dir_okay=False), default=None,
                     help="A file holding the admin token (instead of --admin-token)."),
        click.option("--timeout-seconds", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
                     help="Seconds to wait for the answer (> 0)."),
        click.option("--json", "as_json", is_flag=True, help="Print the server's JSON answer."),
    ]):
        fn = option(fn)
    return fn


def _target(fn):
    """The options naming a cache as a client session does (``server/admin/manage.py``)."""
    for option in reversed([
        click.option("--model", required=True, help="The model id the engines send (see kvtier status: clients)."),
        click.option("--namespace", default="", help="The clients' namespace (LoRA / cache salt digest) [default: none]."),
        click.option("--tenant", default=None, help="Speak for this tenant's clients (their namespace)."),
        click.option("--layout-id", default=None, help="The KV layout, when the model was opened with several."),
    ]):
        fn = option(fn)
    return fn


def _prompt(sessions: bool):
    """The options naming the chunks: a prompt (token ids or text) and, for mutations, a session."""
    options = [
        click.option("--tokens", default=None, help="Token ids, comma separated (or a JSON list)."),
        click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="A file with the token ids as a JSON list."),
        click.option("--text", default=None, help="Prompt text, tokenized by the server with --tokenizer."),
        click.option("--text-file", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="A file with the prompt text."),
        click.option("--tokenizer", default=None, help="The model's local folder on the server (for --text)."),
        click.option("--add-special-tokens/--no-add-special-tokens", default=True, show_default=True,
                     help="Tokenize --text with the tokenizer's special tokens (e.g. BOS), as the engine does."),
    ]
    if sessions:
        options.append(click.option("--session", "session_id", default=None, help="A session id (instead of a prompt)."))

    def wrap(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return wrap


def _body(kw: dict) -> dict:
    """The request body from the command's options (which it consumes from ``kw``)."""
    body = {"model": kw.pop("model"), "namespace": kw.pop("namespace"), "tenant": kw.pop("tenant"),
            "layout_id": kw.pop("layout_id")}
    tokens, tokens_file = kw.pop("tokens", None), kw.pop("tokens_file", None)
    text, text_file = kw.pop("text", None), kw.pop("text_file", None)
    if sum(x is not None for x in (tokens, tokens_file, text, text_file, kw.get("session_id"))) != 1:
        names = "--tokens, --tokens-file, --text, --text-file" + (", --session" if "session_id" in kw else "")
        raise click.UsageError(f"name the chunks with exactly one of {names}")
    if tokens is not None:
        body["tokens"] = _parse_tokens(tokens, "--tokens")
    elif tokens_file is not None:
        body["tokens"] = _parse_tokens(Path(tokens_file).read_text(), "--tokens-file")
    elif text is not None or text_file is not None:
        body["text"] = text if text is not None else Path(text_file).read_text()
        body["tokenizer"] = kw.pop("tokenizer")
        body["add_special_tokens"] = kw.pop("add_special_tokens")
    if kw.get("session_id") is not None:
        body["session_id"] = kw["session_id"]
    return {k: v for k, v in body.items() if v is not None}


def _parse_tokens(value: str, flag: str) -> list[int]:
    value = value.strip()
    try:
        tokens = json.loads(value) if value.startswith("[") else [int(t) for t in value.replace(",", " ").split()]
    except ValueError as exc:
        raise click.BadParameter(f"token ids must be integers, comma separated or a JSON list: {exc}",
                                 param_hint=flag) from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise click.BadParameter("a JSON list of integers", param_hint=flag)
    if not tokens:
        raise click.BadParameter("no token ids given", param_hint=flag)
    if not all(0 <= t < 2**63 for t in tokens):
        raise click.BadParameter("token ids must be integers in [0, 2**63)", param_hint=flag)
    return tokens


def _opts(kw: dict) -> dict:
    return {"admin_url": kw.pop("admin_url"), "token": _token(kw.pop("admin_token"), kw.pop("token_file")),
            "timeout_seconds": kw.pop("timeout_seconds"), "as_json": kw.pop("as_json")}


def _print_json(answer: dict) -> None:
    json.dump(answer, sys.stdout, indent=2)
    sys.stdout.write("\n")


@click.group()
def cache() -> None:
    """Look up, pin, set a TTL for, and delete a prompt's or a session's chunks on a running server; list sessions
    (the management API, see docs/deployment.md)."""


@cache.command()
@_common
@_target
@_prompt(sessions=False)
def lookup(**kw) -> None:
    """Which tiers hold each chunk of a prompt (L1, each L2 adapter) and its retention hint."""
    opts = _opts(kw)
    answer = _call(opts, "POST", "/cache/lookup", _body(kw))
    if opts["as_json"]:
        return _print_json(answer)
    console = Console(width=160)
    console.print(f"model {answer['model']!r}, namespace {answer['namespace']!r}, layout {answer['layout_id']}: "
                  f"{answer['num_tokens']} of {answer['num_prompt_tokens']} tokens cached "
                  f"({answer['num_l1_tokens']} leading in L1)", highlight=False)
    table = Table("chunk", "tokens", "hash", "L1", *(f"L2 {label}" for label in answer["l2_adapters"]), "retention")
    for chunk in answer["chunks"]:
        table.add_row(str(chunk["index"]), f"{chunk['start']}-{chunk['end']}", chunk["hash"][:16],
                      _yes(chunk["l1"]), *(_yes(label in chunk["l2"]) for label in answer["l2_adapters"]),
                      _retention(chunk["retention"]))
    console.print(table)


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def _retention(hint: dict | None) -> str:
    if hint is None:
        return "-"
    parts = ["pinned" if hint["pinned"] else f"priority {hint['priority']}"]
    if hint["expires_in_seconds"] is not None:
        parts.append(f"ttl {hint['expires_in_seconds']:.0f} s")
    if hint["session_id"]:
        parts.append(f"session {hint['session_id']}")
    return ", ".join(parts)


def _mutation(path: str, kw: dict, extra: dict | None = None) -> None:
    opts = _opts(kw)
    body = {**_body(kw), **(extra or {})}
    answer = _call(opts, "POST", path, body)
    if "session_id" in body and answer.get("num_chunks") == 0:  # not an error (deletes are idempotent), but a typo?
        click.echo(f"note: the server holds no chunks of session {body['session_id']!r} for model {body['model']!r}; "
                   f"`kvtier cache sessions` lists the sessions", err=True)
    if opts["as_json"]:
        return _print_json(answer)
    click.echo(", ".join(f"{k}: {v}" for k, v in answer.items()))


@cache.command()
@_common
@_target
@_prompt(sessions=True)
@click.option("--priority", type=click.IntRange(0, 3), default=None, help="Priority kept with the pin (0-3).")
def pin(priority, **kw) -> None:
    """Pin the chunks L1 holds of a prompt or a session: never evicted until unpinned."""
    _mutation("/cache/pin", kw, {"priority": priority} if priority is not None else None)


@cache.command()
@_common
@_target
@_prompt(sessions=True)
def unpin(**kw) -> None:
    """Make a prompt's or a session's chunks ordinary eviction candidates (a session keeps its chunks)."""
    _mutation("/cache/unpin", kw)


@cache.command()
@_common
@_target
@_prompt(sessions=True)
@click.option("--ttl-seconds", type=float, required=True, help="Seconds from now the chunks stay protected (> 0).")
@click.option("--priority", type=click.IntRange(0, 3), default=None, help="Their priority meanwhile (0-3).")
def ttl(ttl_seconds, priority, **kw) -> None:
    """Protect a prompt's or a session's chunks for --ttl-seconds (replaces their hint, a pin too)."""
    if not math.isfinite(ttl_seconds) or ttl_seconds <= 0:
        raise click.BadParameter(f"must be a finite number of seconds > 0, got {ttl_seconds}",
                                 param_hint="--ttl-seconds")
    _mutation("/cache/ttl", kw, {"ttl_seconds": ttl_seconds, **({"priority": priority} if priority is not None else {})})


@cache.command()
@_common
@_target
@_prompt(sessions=True)
def delete(**kw) -> None:
    """Delete a prompt's or a session's chunks from L1 and every L2 adapter (BlockRemoved events follow)."""
    _mutation("/cache/delete", kw)


@cache.command()
@_common
@click.option("--model", default=None, help="Only this model's sessions.")
@click.option("--namespace", default=None, help="Only this namespace (with --model).")
@click.option("--tenant", default=None, help="Only this tenant's (with --model).")
def sessions(model, namespace, tenant, **kw) -> None:
    """Sessions (retention hints' session_id) with the chunks and bytes L1 holds for them."""
    opts = _opts(kw)
    query = {k: v for k, v in (("model", model), ("namespace", namespace), ("tenant", tenant)) if v is not None}
    answer = _call(opts, "GET", "/cache/sessions" + (f"?{urllib.parse.urlencode(query)}" if query else ""))
    if opts["as_json"]:
        return _print_json(answer)
    table = Table("session", "model", "namespace", "tenant", "chunks", "bytes", "pinned", "in L2")
    for row in answer["sessions"]:
        table.add_row(row["session_id"], row["model"], row["namespace"] or "-", row.get("tenant") or "-",
                      str(row["num_chunks"]), str(row["bytes"]), str(row["num_pinned"]), str(row["num_l2_chunks"]))
    Console(width=160).print(table)
