"""Relay one vLLM-format ZMQ KV event stream into Dynamo's event plane as the events of one worker.

Runs in the Dynamo environment (``.venv-dynamo``), started by ``tests/support/dynamo_procs.py``::

    python dynamo_event_relay.py --worker-id ID --block-size 16 --zmq-endpoint tcp://127.0.0.1:5557

It is Dynamo's own relay (``dynamo.llm.KvEventPublisher`` with ``zmq_endpoint``: the code ``dynamo.vllm`` uses
for vLLM's stream), pointed at a kvtier server's event publisher. Dynamo's router takes one event source per
worker, so the worker named here must publish none itself (a mocker with ``--no-enable-prefix-caching``).
Prints ``ready`` once registered; stops on SIGTERM or SIGINT.
"""

import argparse
import asyncio
import signal

from dynamo.llm import KvEventPublisher
from dynamo.runtime import DistributedRuntime


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker-id", type=int, required=True)
    ap.add_argument("--block-size", type=int, required=True, help="the worker's KV block size, in tokens")
    ap.add_argument("--zmq-endpoint", required=True, help="the PUB socket to subscribe to")
    ap.add_argument("--endpoint", default="dynamo.backend.generate", help="the worker's Dynamo endpoint")
    args = ap.parse_args()
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    publisher = KvEventPublisher(endpoint=runtime.endpoint(args.endpoint), worker_id=args.worker_id,
                                 kv_block_size=args.block_size, zmq_endpoint=args.zmq_endpoint, zmq_topic="")
    print("ready", flush=True)
    await stop.wait()
    del publisher
    runtime.shutdown()


asyncio.run(main())
