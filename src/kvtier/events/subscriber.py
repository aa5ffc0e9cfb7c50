"""Subscribe to KV cache events from kvtier, vLLM or SGLang, recovering missed batches through replay.

Live batches arrive on a SUB socket; a jump in the sequence number means batches were missed (PUB drops
silently past its high-water mark or during reconnects). They are asked for on the publisher's replay ROUTER
through a DEALER (``[b"", start_seq]``; a DEALER, unlike REQ, receives every streamed reply), and delivered in
order before the live batch. Batches the publisher no longer buffers are reported as a ``Gap`` (to ``on_gap``,
``Subscriber.gaps`` and ``stats.missed_batches``): the consumer must resync (e.g. drop its index).
A catch-up (``start_seq``) whose publisher does not answer yet is asked again while no live batch arrives: a PUB
drops what it sends before the SUB has joined, so the first batches of a publisher that starts after the
subscriber can only come from replay, and no later batch may come to reveal them as a gap; for the same reason
a catch-up is repeated while idle until the first live batch arrives.
Reference: events-and-hashing.md §1.1 (replay layouts of vLLM <= 0.25 and >= 0.26 are both read) and §7.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import zmq

from kvtier.auth.curve import apply_client
from kvtier.auth.secret_file import read_credentials
from kvtier.errors import KVTierError
from kvtier.events.model import DecodeError, EventBatch, decode_batch
from kvtier.events.replay import END_SEQ
from kvtier.events.streams import tenant_topic
from kvtier.zmq_context import Context

log = logging.getLogger(__name__)
CATCH_UP_RETRY_SECONDS = 1.0  # an unanswered catch-up is asked again after this long without a live batch


@dataclass(frozen=True)
class Gap:
    """Batches ``first_missing..last_missing`` (inclusive seqs) are lost for good; ``reason`` says why."""

    first_missing: int
    last_missing: int
    reason: str

    @property
    def num_batches(self) -> int:
        return self.last_missing - self.first_missing + 1


@dataclass
class SubscriberStats:
    """Counts of what the subscriber received, recovered, skipped and lost."""

    received: int = 0  # live batches delivered
    replayed: int = 0  # batches delivered from replay
    wrong_topic: int = 0
    bad_seq: int = 0  # sequence frame not 8 bytes
    bad_payload: int = 0  # not a decodable event batch
    bad_frames: int = 0  # wrong number of frames
    duplicates: int = 0  # live batches already delivered through replay
    restarts: int = 0  # the publisher's sequence went backwards (it restarted)
    missed_batches: int = 0  # lost for good (see gaps)
    dropped_by_hook: int = 0  # fault injection: drop_next()
    replays_refused: int = 0  # replay requests a kvtier publisher refused (a per-principal bound)
    gaps: list = field(default_factory=list)


def _default_on_gap(gap: Gap) -> None:
    log.warning("KV events: missed batches %d..%d (%d): %s", gap.first_missing, gap.last_missing,
                gap.num_batches, gap.reason)


class Subscriber:
    """Receives ``(seq, EventBatch)`` in sequence order.

    Args:
        endpoint: the publisher's PUB address (connected to; ``bind=True`` binds instead, llm-d style).
        replay_endpoint: the publisher's replay ROUTER, or None (gaps are then reported, not recovered).
        topic: frame-0 topic to accept ("" accepts every topic).
        start_seq: replay from this seq first (a late subscriber catching up); None starts with live traffic.
        on_gap: called with each ``Gap``; default logs a warning.
        replay_timeout_seconds: how long one replay request may take before its range is reported as a gap.
        raw_hashes: keep hashes as sent instead of normalising to uint64 ints.
        secret_file: the kvtier server's secret file, a tenant's or a subscriber's credential file
            (``kvtier auth tenant`` / ``kvtier auth subscriber``), for a publisher with authentication
            (``kv_events.auth``): both sockets then speak CurveZMQ, and a tenant's file reads that tenant's
            stream (topic ``tenant:<name>/<topic>``, ``kvtier.events.streams``); None: plain ZMQ.

    Raises:
        KVTierError: an endpoint is malformed (from the constructor).

    Not thread-safe: use from one thread. ``close()`` releases the sockets.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *,
                 start_seq: int | None = None, on_gap=None, replay_timeout_seconds: float = 2.0,
                 raw_hashes: bool = False, bind: bool = False, secret_file: str | None = None) -> None:
        self._topic_asked = topic.encode()
        self._endpoint, self._bind = endpoint, bind
        self.replay_endpoint = replay_endpoint
        self.on_gap = on_gap or _default_on_gap
        self.replay_timeout_seconds = replay_timeout_seconds
        self.raw_hashes = raw_hashes
        self._creds = read_credentials(secret_file) if secret_file else None
        self.stats = SubscriberStats()
        self._dealer = None
        self._sub = None
        self._ctx = Context()
        try:
            self._open_sub()
            if replay_endpoint:
                self._open_dealer()
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise KVTierError(f"cannot open KV event subscriber on {endpoint!r} (replay {replay_endpoint!r}): "
                              f"{exc.strerror}; use an address like tcp://127.0.0.1:5557") from exc
        self._ready: collections.deque = collections.deque()
        self._last: int | None = None  # highest seq delivered (or given up on)
        self._live_last: int | None = None  # highest seq seen on the live socket
        self._start_seq = start_seq
        self._catch_up_at: float | None = None  # monotonic time to ask the replay again (an unanswered catch-up)
        self._drop = 0

    @property
    def gaps(self) -> list[Gap]:
        return self.stats.gaps

    def _open_sub(self) -> None:
        """(Re)open the live SUB with the current credentials: a tenant reads its own stream's topic."""
        if self._sub is not None:
            self._sub.close(linger=0)
        tenant = self._creds.tenant if self._creds is not None else None
        self.topic = tenant_topic(tenant, self._topic_asked) if tenant else self._topic_asked
        self._sub = self._ctx.socket(zmq.SUB)
        if self._creds is not None:
            apply_client(self._sub, self._creds)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        (self._sub.bind if self._bind else self._sub.connect)(self._endpoint)
        if tenant and not self._topic_asked:
            self.topic = b""  # every topic of the tenant's prefix is accepted

    def use_secret_file(self, secret_file: str) -> None:
        """Authenticate with ``secret_file`` from now on (e.g. one the server created after this subscriber
        started): both sockets are reopened with it, and batches sent meanwhile come back through replay.
        Raises ConfigError: the file is missing, unsafe or malformed."""
        creds = read_credentials(secret_file)
        if self._creds is not None and creds.secret == self._creds.secret and creds.path == self._creds.path:
            return
        self._creds = creds
        self._close_dealer()
        self._open_sub()

    def drop_next(self, num_frames: int) -> None:
        """Fault injection: discard the next ``num_frames`` live messages, as a lossy network would."""
        self._drop += num_frames

    # ------------------------------------------------------------------ receiving
    def recv(self, timeout_seconds: float | None = None) -> tuple[int, EventBatch] | None:
        """Next batch in order, or None when nothing arrived within ``timeout_seconds`` (None: wait forever)."""
        if self._start_seq is not None:
            start, self._start_seq = self._start_seq, None
            self._recover(start, None)
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        while not self._ready:
            now = time.monotonic()
            if self._catch_up_at is not None and now >= self._catch_up_at:
                self._recover(self._last + 1, None)
                continue
            until = min((t for t in (deadline, self._catch_up_at) if t is not None), default=None)
            wait_milliseconds = None if until is None else max(0, int((until - now) * 1000))
            if self._sub.poll(wait_milliseconds):
                self._on_live(self._sub.recv_multipart())
            elif deadline is not None and time.monotonic() >= deadline:
                return None
        return self._ready.popleft()

    def iter(self, timeout_seconds: float | None = None):
        """Yield ``(seq, EventBatch)`` until ``timeout_seconds`` passes without a batch (None: forever)."""
        while (item := self.recv(timeout_seconds)) is not None:
            yield item

    __iter__ = iter

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload, raw_hashes=self.raw_hashes)
        except DecodeError as exc:
            self.stats.bad_payload += 1
            log.warning("KV events: skipping an undecodable batch: %s", exc)
            return None

    def _on_live(self, frames: list[bytes]) -> None:
        if self._drop:
            self._drop -= 1
            self.stats.dropped_by_hook += 1
            return
        if len(frames) != 3:
            self.stats.bad_frames += 1
            return
        topic, seq8, payload = frames
        if self.topic and topic != self.topic:  # ZMQ filters by prefix only
            self.stats.wrong_topic += 1
            return
        if len(seq8) != 8:
            self.stats.bad_seq += 1
            return
        seq = int.from_bytes(seq8, "big")
        if self._live_last is not None and seq <= self._live_last:
            self.stats.restarts += 1
            log.warning("KV events: sequence went back from %d to %d; the publisher restarted", self._live_last, seq)
            self._last = -1
        self._live_last = seq
        self._catch_up_at = None  # the publisher is up: a gap before this batch is recovered below
        if self._last is not None and seq <= self._last:
            self.stats.duplicates += 1
            return
        if self._last is not None and seq > self._last + 1:
            self._recover(self._last + 1, seq - 1)
        self._last = seq
        batch = self._decode(payload)
        if batch is not None:
            self.stats.received += 1
            self._ready.append((seq, batch))

    # ------------------------------------------------------------------ replay
    def _gap(self, first: int, last: int, reason: str) -> None:
        gap = Gap(first, last, reason)
        self.stats.gaps.append(gap)
        self.stats.missed_batches += gap.num_batches
        self.on_gap(gap)

    def _open_dealer(self) -> None:
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.RCVHWM, 0)
        # a DEALER with no usable peer (e.g. its CurveZMQ handshake was dropped) blocks a send: bound it, so an
        # unanswerable replay is a timeout (a gap, or a catch-up on a fresh connection), never a hung subscriber
        self._dealer.setsockopt(zmq.SNDTIMEO, max(1, int(self.replay_timeout_seconds * 1000)))
        if self._creds is not None:
            apply_client(self._dealer, self._creds)
        self._dealer.connect(self.replay_endpoint)

    def _close_dealer(self) -> None:
        """Drop the replay connection (the next replay opens a fresh one)."""
        if self._dealer is not None:
            self._dealer.close()
            self._dealer = None

    def _replay(self, first: int, last: int | None) -> list[tuple[int, bytes]] | str | None:
        """Ask the ROUTER for seqs >= first; return (seq, payload) in [first, last], None on timeout, or the
        reason kvtier's replay port refused the request (its end marker's last frame: ``kvtier.events.replay``)."""
        if self._dealer is None:
            self._open_dealer()
        try:
            self._dealer.send_multipart((b"", first.to_bytes(8, "big")))
        except zmq.Again:  # no peer took the request within the timeout: as unanswered
            self._close_dealer()
            return None
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout_seconds
        while True:
            wait_milliseconds = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._dealer.poll(wait_milliseconds):
                self._close_dealer()  # late replies must not answer the next request
                return None
            frames = self._dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:  # vLLM >= 0.26: topic, seq, payload
                _, seq8, payload = frames
            elif len(frames) == 2:  # vLLM <= 0.25: seq, payload
                seq8, payload = frames
            else:
                self.stats.bad_frames += 1
                continue
            if seq8 == END_SEQ:
                if payload:  # kvtier's refusal (a vLLM publisher always ends with b"")
                    self.stats.replays_refused += 1
                    return payload.decode(errors="replace")
                return got
            if len(seq8) != 8:
                self.stats.bad_seq += 1
                continue
            seq = int.from_bytes(seq8, "big")
            if seq >= first and (last is None or seq <= last):
                got.append((seq, payload))

    def _recover(self, first: int, last: int | None) -> None:
        """Deliver seqs first..last from replay in order; report what the publisher no longer has."""
        if not self.replay_endpoint:
            if last is not None:
                self._gap(first, last, "no replay endpoint to recover them from")
            return
        got = self._replay(first, last)
        if got is None or isinstance(got, str):
            why = f"replay {got}" if got else f"replay did not answer within {self.replay_timeout_seconds} s"
            if last is not None:
                self._gap(first, last, why)
            else:  # the publisher is not up yet: asked again while idle, or the first live batch's gap asks
                if self._catch_up_at is None:
                    log.warning("KV events: %s (%s); catching up from seq %d later", why, self.replay_endpoint, first)
                self._catch_up_at = time.monotonic() + max(CATCH_UP_RETRY_SECONDS, self.replay_timeout_seconds)
                if self._last is None:
                    self._last = first - 1
            return
        # until a live batch shows the subscription works, a batch sent before it did (an authenticated PUB
        # subscribes a connection only once its handshake is done) could be the last one for a long time:
        # keep asking the replay while idle
        self._catch_up_at = (time.monotonic() + CATCH_UP_RETRY_SECONDS
                             if last is None and self._live_last is None else None)
        expected = first
        for seq, payload in sorted(got):
            if seq < expected:
                continue
            if seq > expected:
                self._gap(expected, seq - 1, "no longer in the publisher's replay buffer")
            expected = seq + 1
            batch = self._decode(payload)
            if batch is not None:
                self.stats.replayed += 1
                self._ready.append((seq, batch))
        if last is not None and expected <= last:
            self._gap(expected, last, "no longer in the publisher's replay buffer")
        self._last = (expected - 1) if last is None else last

    def close(self) -> None:
        """Close the sockets. Idempotent."""
        self._ctx.destroy(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
