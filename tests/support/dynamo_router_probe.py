"""Ask Dynamo's KV router what it knows, without parsing logs: a line-oriented JSON service on stdin/stdout.

Runs in the Dynamo environment (``.venv-dynamo``), started by ``tests/support/dynamo_procs.py``::

    python dynamo_router_probe.py --block-size 16

It builds ``dynamo.llm.KvRouter`` (the frontend's router code) on the workers' endpoint, prints ``ready``, then
answers each stdin line ``{"tokens": [...]}`` with one stdout line::

    {"workers": {"<worker id>": {"device": n, "host": n, "disk": n}}, "best": {"worker": id, "overlap": n}}

``device`` / ``host`` / ``disk`` are ``get_overlap_scores``' ``device_blocks`` / ``host_pinned_blocks`` /
``disk_blocks``: the number of leading blocks of ``tokens`` matched on that tier *or a faster one* (Dynamo
1.6.1 reports them cumulatively); ``best`` is ``best_worker(tokens)``. The router learns only events
published while it runs (a live-only source has no recovery), so start it before the events of interest.
Stops at end of input.
"""

import argparse
import asyncio
import json
import sys

from dynamo.llm import KvRouter, KvRouterConfig
from dynamo.runtime import DistributedRuntime


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, required=True, help="the workers' KV block size, in tokens")
    ap.add_argument("--endpoint", default="dynamo.backend.generate", help="the workers' Dynamo endpoint")
    args = ap.parse_args()
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    router = KvRouter(runtime.endpoint(args.endpoint), args.block_size, KvRouterConfig())
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    try:
        while line := await reader.readline():
            tokens = json.loads(line)["tokens"]
            scores = await router.get_overlap_scores(tokens)
            workers = {str(w["worker_id"]): {"device": w["device_blocks"], "host": w["host_pinned_blocks"],
                                             "disk": w["disk_blocks"]} for w in scores["workers"]}
            worker, _, overlap = await router.best_worker(tokens)
            print(json.dumps({"workers": workers, "best": {"worker": str(worker), "overlap": overlap}}), flush=True)
    finally:
        runtime.shutdown()


asyncio.run(main())
