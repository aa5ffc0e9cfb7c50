"""Requests naming their prompt by page digests (protocol v6 ``pages``, ``kvtier.pages.PageChain``) at a real server:
the prompt bound counts pages times the page size, and pages come alone (no tokens, extra keys or start)."""

from __future__ import annotations

from support.server import LAYOUT, ServerProc, metric_value

from kvtier import protocol as P
from kvtier.client import Client
from kvtier.pages import PageChain


def test_a_page_prompt_is_bounded_and_comes_alone(tmp_path, caplog):
    with ServerProc(tmp_path, config={"server": {"max_prompt_tokens": 64}}) as server:
        with Client(server.url, model="m", layout=LAYOUT) as client:
            fits = PageChain(tuple(bytes([i]) * 32 for i in range(8)), 8)  # 64 tokens
            assert client.store_chunks(fits, lambda start, dst: dst.fill(1)) == 8
            assert client.lookup(fits) == 64
            over = PageChain(fits.hashes + (b"\x09" * 32,), 8)  # 72 tokens
            assert client.lookup(over) == 0
            limited = metric_value(server.metrics_text(), "kvtier_client_limit_exceeded_total", limit="prompt_tokens")
            assert limited == 1
            mixed = P.Lookup(id=client.transport.new_id(), tokens=P.pack_tokens([1, 2]), pages=P.Pages([b"x" * 32], 8))
            with client.transport.lock:
                reply, _ = client.transport.call(mixed)
            assert reply is None  # refused: the transport logs the server's error and answers nothing
            assert any("answered bad_request to Lookup: a request with pages names its prompt by them alone"
                       in r.getMessage() for r in caplog.records)
