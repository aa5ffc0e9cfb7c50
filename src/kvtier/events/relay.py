"""A same-host relay from an authenticated kvtier event stream to a plain ZMQ PUB on ``ipc://``.

Why: the routers kvtier serves (vLLM's consumers, NVIDIA Dynamo's KV router, llm-d) subscribe with plain ZMQ
and cannot speak CurveZMQ, while a kvtier server with authentication publishes only to holders of a key
(``kvtier.events.publisher``). The relay holds a key (a subscriber's file from ``kvtier auth subscriber``, or
a tenant's to relay one tenant's stream), reads the stream with gap recovery (``Subscriber``) and republishes
every event in order on a vLLM-compatible PUB (and optional replay ROUTER) bound to ``ipc://`` paths, whose
socket files it makes mode 0600: only the relay's OS user (the router running beside it) can connect.
Batches the upstream could not replay are logged and counted (``stats()["missed_batches"]``); the relay's
own sequence numbers stay contiguous.
"""

from __future__ import annotations

import logging
import os
import threading

from kvtier.config.tree import KVEventsConfig
from kvtier.errors import ConfigError
from kvtier.events.publisher import EventPublisher
from kvtier.events.subscriber import Subscriber

log = logging.getLogger(__name__)


def _ipc_path(endpoint: str, what: str) -> str:
    if not endpoint.startswith("ipc://") or len(endpoint) <= len("ipc://"):
        raise ConfigError(f"the relay's {what} {endpoint!r} must be an ipc:// path (e.g. ipc:///run/kvtier/events): "
                          "a plain ZMQ socket on tcp would let any local process read every event")
    path = endpoint[len("ipc://"):]
    if path.startswith("@"):  # Linux abstract namespace: no socket file, so no permissions to restrict it
        raise ConfigError(f"the relay's {what} {endpoint!r} names an abstract socket (ipc://@...), which any local "
                          "process can connect to: give a file path instead (e.g. ipc:///run/kvtier/events)")
    return path


class EventRelay:
    """Relays one authenticated event stream to plain ZMQ sockets on ``ipc://`` paths (mode 0600).

    Args:
        endpoint / replay_endpoint: the kvtier server's ``kv_events.endpoint`` / ``replay_endpoint``.
        secret_file: the credential file to read with (subscriber, tenant or the server's secret file).
        to: the ``ipc://`` path to publish on; ``replay_to``: optional ``ipc://`` path of a replay ROUTER.
        topic: the topic of the relayed stream (the server's ``kv_events.topic``); republished under it.
        encoding: ``vllm`` (default), ``vllm-legacy`` or ``sglang``: what the router reads.

    Raises:
        ConfigError: an output endpoint that is not ``ipc://``; a credential file that is missing or unsafe.
        KVTierError: an endpoint that cannot be bound or connected.

    ``start()`` runs it on a daemon thread, ``close()`` stops it; ``run()`` relays on the calling thread.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, secret_file: str, to: str, *,
                 replay_to: str | None = None, topic: str = "kv-events", encoding: str = "vllm") -> None:
        paths = [_ipc_path(to, "output")] + ([_ipc_path(replay_to, "replay output")] if replay_to else [])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sub = Subscriber(endpoint, replay_endpoint, topic, start_seq=0 if replay_endpoint else None,
                               raw_hashes=True, secret_file=secret_file)
        old = os.umask(0o077)  # the socket files are created mode 0600 from the start, never readable by others
        try:
            self._pub = EventPublisher(KVEventsConfig(endpoint=to, replay_endpoint=replay_to, topic=topic,
                                                      encoding=encoding, batch_max_delay_seconds=0))
        except BaseException:
            self._sub.close()
            raise
        finally:
            os.umask(old)
        for path in paths:
            os.chmod(path, 0o600)
        self.endpoint, self.replay_endpoint = self._pub.endpoint, self._pub.replay_endpoint

    def run(self) -> None:
        """Relay until ``close()`` (or KeyboardInterrupt)."""
        while not self._stop.is_set():
            got = self._sub.recv(timeout_seconds=0.1)
            if got is not None:
                self._pub.publish(list(got[1].events))

    def start(self) -> EventRelay:
        self._thread = threading.Thread(target=self.run, name="kvtier-events-relay", daemon=True)
        self._thread.start()
        return self

    def stats(self) -> dict:
        """``relayed_batches`` (received from upstream), ``missed_batches`` (lost upstream for good), and the
        output publisher's ``published_events``."""
        return {"relayed_batches": self._sub.stats.received + self._sub.stats.replayed,
                "missed_batches": self._sub.stats.missed_batches,
                "published_events": self._pub.stats()["published_events"]}

    def close(self) -> None:
        """Stop relaying, publish what is queued, close every socket. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._pub.close()
        self._sub.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
