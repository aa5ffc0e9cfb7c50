"""``kvtier cache ...`` end to end against a real server (issue 19 §2): a prompt given as text is tokenized by the
server with the model's tokenizer (SmolLM2's folder) and found where a client stored the same tokens; pin, sessions,
delete of a session; refusals print the server's message."""

from __future__ import annotations

import json
import subprocess

import torch
from click.testing import CliRunner
from support.server import CHUNK, CHUNK_BYTES, LAYOUT, ServerProc, kvtier_cmd

from kvtier.cli import cli
from kvtier.client import Client
from kvtier.hints import RetentionHint
from kvtier.demo.models import SMOLLM2, converted_model_dir

TOKEN = "cli-token"
TEXT = "The management API shows which tier holds each chunk of a prompt. " * 8


def test_cache_commands_end_to_end(tmp_path):
    from transformers import AutoTokenizer

    folder = str(converted_model_dir(SMOLLM2))  # converted here when no earlier test did
    tokens = AutoTokenizer.from_pretrained(folder, local_files_only=True).encode(TEXT)
    num_chunks = len(tokens) // CHUNK
    assert num_chunks >= 2
    config = {"l2_adapters": [{"type": "local_disk", "path": str(tmp_path / "disk")}]}
    with ServerProc(tmp_path, token=TOKEN, config=config) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        kv = torch.randn(LAYOUT.chunk_shape(len(tokens)))
        assert client.store(tokens, kv, hint=RetentionHint(session_id="chat-1")) == num_chunks
        assert client.flush(30)
        (tmp_path / "token").write_text(TOKEN + "\n")
        conn = ["--admin-url", server.admin, "--token-file", str(tmp_path / "token"), "--timeout-seconds", "120"]
        runner = CliRunner()

        def run(*args):
            result = runner.invoke(cli, ["cache", *args], catch_exceptions=True)
            assert result.exit_code == 0, (result.output, result.exception)
            return result.output

        answer = json.loads(run("lookup", *conn, "--model", "m", "--text", TEXT, "--tokenizer", folder, "--json"))
        assert answer["num_prompt_tokens"] == len(tokens) and answer["num_l1_tokens"] == num_chunks * CHUNK
        assert all(c["l1"] and c["l2"] == ["local_disk"] for c in answer["chunks"])
        table = run("lookup", *conn, "--model", "m", "--tokens", ",".join(map(str, tokens)))
        assert f"{num_chunks * CHUNK} of {len(tokens)} tokens cached" in table and "session chat-1" in table

        assert f"pinned: {num_chunks}," in run("pin", *conn, "--model", "m", "--session", "chat-1")
        rows = json.loads(run("sessions", *conn, "--json"))["sessions"]
        assert [(r["session_id"], r["num_chunks"], r["bytes"], r["num_pinned"]) for r in rows] == \
            [("chat-1", num_chunks, num_chunks * CHUNK_BYTES, num_chunks)]
        assert "chat-1" in run("sessions", *conn)

        gone = json.loads(run("delete", *conn, "--model", "m", "--session", "chat-1", "--json"))
        assert gone == {"num_chunks": num_chunks, "deleted": {"CPU": num_chunks, "local_disk": num_chunks},
                        "remaining": 0}
        assert client.lookup(tokens) == 0
        again = runner.invoke(cli, ["cache", "delete", *conn, "--model", "m", "--session", "chat-1"])
        assert again.exit_code == 0 and "no chunks of session 'chat-1'" in again.stderr
        for bad in ("nan", "inf", "0"):
            result = runner.invoke(cli, ["cache", "ttl", *conn, "--model", "m", "--session", "s", "--ttl-seconds", bad])
            assert result.exit_code == 2 and "--ttl-seconds" in result.output, result.output
        empty = runner.invoke(cli, ["cache", "lookup", *conn, "--model", "m", "--tokens", ""])
        assert empty.exit_code == 2 and "no token ids" in empty.output

        refused = runner.invoke(cli, ["cache", "lookup", "--admin-url", server.admin, "--model", "m", "--tokens", "1,2"])
        assert refused.exit_code != 0 and "401" in str(refused.exception)
        usage = runner.invoke(cli, ["cache", "delete", *conn, "--model", "m"])
        assert usage.exit_code == 2 and "exactly one of" in usage.output
        proc = subprocess.run(kvtier_cmd("cache", "lookup", "--admin-url", server.admin, "--admin-token", "wrong",
                                         "--model", "m", "--tokens", "1,2"), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "error:" in proc.stderr and "missing or wrong admin token" in proc.stderr
        proc = subprocess.run(kvtier_cmd("cache", "sessions", "--admin-url", "not-a-url"), capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and "is not an http URL" in proc.stderr and "Traceback" not in proc.stderr
