"""Disaggregated-prefill proxy for two vLLM OpenAI servers sharing one kvtier server.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to the prefill instance
(``kv_role=kv_producer``) with ``max_tokens=1``, which computes the prompt's KV and stores it in kvtier;
then the original request goes to the decode instance (``kv_role=kv_consumer``), which finds the prompt in
kvtier and only computes the last block. The decode instance's answer (streamed or not) is returned.

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Needs starlette, uvicorn and httpx (all in the vLLM environment).
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("kvtier.proxy")


def make_app(prefill_url: str, decode_url: str, timeout_seconds: float = 600.0) -> Starlette:
    client = httpx.AsyncClient(timeout=timeout_seconds)

    async def forward(request: Request) -> Response:
        body = await request.json()
        path = request.url.path
        warm = {**body, "max_tokens": 1, "stream": False}
        warm.pop("stream_options", None)
        if "max_completion_tokens" in warm:
            warm["max_completion_tokens"] = 1
        try:
            first = await client.post(prefill_url + path, json=warm)
            if first.status_code != 200:  # the decode instance can still compute the prompt itself
                log.warning("prefill instance answered %d: %s", first.status_code, first.text[:200])
        except httpx.HTTPError as exc:
            log.warning("prefill instance unreachable (%s); the decode instance computes the prompt", exc)
        if body.get("stream"):
            req = client.build_request("POST", decode_url + path, json=body)
            upstream = await client.send(req, stream=True)

            async def relay():
                try:
                    async for part in upstream.aiter_raw():
                        yield part
                finally:
                    await upstream.aclose()

            return StreamingResponse(relay(), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type", "text/event-stream"))
        second = await client.post(decode_url + path, json=body)
        return Response(second.content, status_code=second.status_code,
                        media_type=second.headers.get("content-type", "application/json"))

    async def models(request: Request) -> Response:
        got = await client.get(decode_url + "/v1/models")
        return Response(got.content, status_code=got.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        ok = True
        for url in (prefill_url, decode_url):
            try:
                ok &= (await client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
        return JSONResponse({"healthy": ok}, status_code=200 if ok else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    return Starlette(routes=[
        Route("/v1/completions", forward, methods=["POST"]),
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ], lifespan=lifespan)


def main() -> None:
    ap = argparse.ArgumentParser(description="kvtier disaggregated-prefill proxy for vLLM")
    ap.add_argument("--prefill", required=True, help="base URL of the prefill (kv_producer) vLLM server")
    ap.add_argument("--decode", required=True, help="base URL of the decode (kv_consumer) vLLM server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
