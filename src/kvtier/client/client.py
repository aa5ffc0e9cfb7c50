"""Client: the engine's handle on a kvtier server; a ``KVBackend`` (``kvtier.backend``) like ``KVCache``.

Imports nothing of the server or the storage tiers (L1, L2, events): an engine process that talks to a
server loads only the wire protocol, the data plane and pyzmq.

The connection (socket, monitor, handshake, one request with the availability rules) is ``Transport``
(``client/transport.py``), a part ``Client`` owns; its resilience rules hold for every method here. Only caller
mistakes raise (InputError: bad tokens, KV of the wrong shape or dtype), as in KVCache (``extra_keys`` are checked
by the server: bad ones are answered ``bad_request``, logged, and a miss); a handshake refusal (version, layout or
config mismatch) raises ProtocolError from the constructor, and so does ``clear`` without the admin token.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from kvtier import protocol as P
from kvtier.backend import Fill, Retrieved, TierHits
from kvtier.client import dataplane as D
from kvtier.client.transport import Transport
from kvtier.errors import InputError
from kvtier.hashing import as_token_array
from kvtier.hints import RetentionHint
from kvtier.layout import KVLayout
from kvtier.metrics import Metrics
from kvtier.pages import PageChain
from kvtier.tensors import as_numpy, chunk_view, copy_from, empty_kv, join_chunks
from kvtier.medium import Medium

FLUSH_REPLY_GRACE_SECONDS = 5.0  # a Flush reply may arrive this long after the server's own deadline


class Client:
    """Connects to ``kvtier server`` at ``url`` for one (model, KV layout, namespace).

    Args:
        url: the server's ZMQ endpoint, e.g. ``"tcp://127.0.0.1:5555"``.
        model: the weights' identity (``identity.model_identity``), part of every key.
        layout: the KV layout (``KVLayout`` or its ``to_dict()``).
        namespace: default namespace (LoRA / cache_salt, see ``keys.namespace_of``).
        timeout_seconds: longest wait for one reply.
        shared_memory: use the server's shared L1 when it is on this host (else bytes travel as frames).
        expect: server settings this client relies on (``chunk_size``, ``block_size``, ``hash_algorithm``,
            ``hash_seed``, ``save_unfull_chunk``); a difference refuses the session.
        retry_after_seconds: after a timeout, calls are fast misses for this long before the next try.
        metrics: where ``kvtier_client_unavailable_total`` is counted (a new ``Metrics`` if None).
        prefault: populate the pages of each shared-L1 slot this client is handed, once per 2 MiB region
            (``SharedMapping.populate``), before copying: page faults are paid in batches instead of one per
            4 KiB page on the first copy. Attaching never touches the whole arena, so start-up time and
            committed memory do not depend on the L1 size. For a process that copies KV (an engine worker).
        secret_file: the server's secret file, or a tenant credential file (``kvtier.auth``); default
            ``$KVTIER_AUTH_SECRET_FILE``, else the file a same-user server on this host keeps for the URL's port.

    Raises:
        ProtocolError: the server refused the handshake (the message says what differs).
    """

    def __init__(self, url: str, *, model: str, layout: KVLayout | dict, namespace: str = "",
                 timeout_seconds: float = 10.0, shared_memory: bool = True, expect: dict | None = None,
                 retry_after_seconds: float = 1.0, metrics: Metrics | None = None, prefault: bool = False,
                 secret_file: str | os.PathLike | None = None):
        self.url = url
        self.layout = layout if isinstance(layout, KVLayout) else KVLayout.from_dict(layout)
        self.metrics = metrics or Metrics()
        self.prefault = prefault
        self._unflushed: set[str] = set()  # server_ids that acknowledged stores since the last good flush
        self.transport = Transport(url, model=model, layout=self.layout, namespace=namespace,
                                   timeout_seconds=timeout_seconds, shared_memory=shared_memory,
                                   expect=dict(expect or {}), retry_after_seconds=retry_after_seconds,
                                   metrics=self.metrics, secret_file=secret_file)

    @property
    def info(self) -> P.HelloReply | None:
        """The server's answer to the last handshake (None before the server was ever reached)."""
        return self.transport.info

    # ---- the KVBackend interface ---------------------------------------------------------------
    @property
    def chunk_size(self) -> int:
        """Tokens per chunk: the server's (from the last handshake); before the server was ever reached, the
        ``expect["chunk_size"]`` given, else 0 (unknown; every call is a miss until the server answers)."""
        if self.info is not None:
            return self.info.chunk_size
        return int(self.transport.expect.get("chunk_size", 0))

    def lookup(self, tokens, namespace: str | None = None, *, extra_keys=None, start: int = 0) -> int:
        """Number of leading tokens of ``tokens`` whose KV the server holds (0 when it is unavailable).
        ``extra_keys``: per-block extra keys, as for ``KVCache``; ``start``: as for ``KVBackend``."""
        return self.lookup_tiers(tokens, namespace, extra_keys=extra_keys, start=start).num_tokens

    def lookup_tiers(self, tokens, namespace: str | None = None, *, extra_keys=None, start: int = 0) -> TierHits:
        """``lookup`` split by tier (``KVBackend.lookup_tiers``): (0, 0) when the server is unavailable."""
        prompt = P.prompt_fields(tokens, extra_keys, start)  # checked before the lock
        with self.transport.lock:
            reply, _ = self.transport.call(P.Lookup(id=self.transport.new_id(), **prompt, namespace=namespace,
                                           extra_keys=extra_keys, start=_start(start)))
        if not isinstance(reply, P.LookupReply):
            return TierHits(0, 0)
        return TierHits(reply.num_tokens, min(reply.num_l1_tokens, reply.num_tokens))

    def prefetch(self, tokens, namespace: str | None = None, *, extra_keys=None, wait: bool = False) -> int:
        """Ask the server to promote the leading chunks of ``tokens`` that only L2 holds into L1, in the
        background, so a later retrieve finds them in L1. ``wait`` False (the default): send and return 0 at
        once (the server's late reply is dropped); True: wait for the promotion (at most the server's
        ``promote_timeout_seconds``, bounded by ``timeout_seconds``) and return the leading tokens L1 holds then.
        A prefetch of evicted chunks is a miss, never an error. 0 when the server is unavailable. Raises
        InputError for bad tokens."""
        prompt = P.prompt_fields(tokens, extra_keys)
        with self.transport.lock:
            msg = P.Prefetch(id=self.transport.new_id(), **prompt, namespace=namespace, extra_keys=extra_keys)
            if not wait:
                self.transport.post(msg)
                return 0
            reply, _ = self.transport.call(msg)
        return reply.num_tokens if isinstance(reply, P.PrefetchReply) else 0

    def store(self, tokens, kv, namespace: str | None = None, *, extra_keys=None,
              hint: RetentionHint | None = None) -> int:
        """Store the KV of ``tokens`` (``(num_layers, 2, T, num_kv_heads, head_dim)``, layout dtype), through
        ``store_chunks``: only the chunks the server lacks are copied.

        Returns the number of chunks newly stored (0 when the server is unavailable).
        Raises InputError when ``tokens`` or ``kv`` do not match the layout.
        """
        arr = as_token_array(tokens)
        self.layout.validate_kv(kv, len(arr))
        return self.store_chunks(arr, copy_from(as_numpy(kv)), namespace, extra_keys=extra_keys, hint=hint)

    def store_chunks(self, tokens, fill: Fill, namespace: str | None = None, *, extra_keys=None, start: int = 0,
                     hint: RetentionHint | None = None) -> int:
        """``KVBackend.store_chunks`` over the server: ``dst`` is the server's L1 slot itself with shared
        memory (no intermediate copy), otherwise a buffer sent as a frame.

        Returns the number of chunks newly stored (0 when the server is unavailable, or when the lease ran
        out before every chunk was written: then nothing is stored). Raises InputError for bad tokens;
        whatever ``fill`` raises aborts the reservation and is raised. ``hint``: retention hint
        (``kvtier.hints.check_hint``) for the prompt's chunks; a server refusing it answers ``bad_request``.
        """
        prompt = P.prompt_fields(tokens, extra_keys, start)
        fields = {} if hint is None else {"priority": hint.priority or None, "ttl_seconds": hint.ttl_seconds,
                                          "session_id": hint.session_id}
        with self.transport.lock:
            shm = self.transport.arena is not None
            reply, _ = self.transport.call(P.StoreBegin(id=self.transport.new_id(), **prompt, shm=shm,
                                                        namespace=namespace, extra_keys=extra_keys, start=_start(start),
                                                        **fields))
            if not isinstance(reply, P.StoreSlots) or not reply.slots:
                return 0
            got_at = time.monotonic()
            ok, frames = False, []
            try:
                ok, frames = self._fill_slots(reply.slots, fill, got_at, _tokens_per_chunk(tokens, self.info))
            finally:  # commit, or abort on a failure of ``fill``: never leave the reservation to expire
                done, _ = self.transport.call(P.StoreCommit(id=self.transport.new_id(), ticket=reply.ticket, ok=ok),
                                     frames if ok else [], retry=False)
        if isinstance(done, P.StoreDone) and done.num_stored:
            self._unflushed.add(self.info.server_id)
        return done.num_stored if isinstance(done, P.StoreDone) else 0

    def _fill_slots(self, slots, fill: Fill, got_at: float, chunk_size: int) -> tuple[bool, list]:
        dtype = self.layout.numpy_dtype()
        in_shm = slots[0].offset >= 0 and self.transport.arena is not None
        # never write after half the lease: past the lease the server may have reused the slot
        budget = self.info.lease_seconds / 2
        frames = []
        if in_shm and self.prefault:
            self._populate(slots)
        for slot in slots:
            if in_shm and time.monotonic() - got_at > budget:
                return False, []
            n = D.slot_tokens(slot, self.layout)
            if in_shm:
                dst = chunk_view(self.transport.arena.view(slot.offset, slot.nbytes), self.layout, n, dtype)
            else:
                dst = np.empty(self.layout.chunk_shape(n), dtype=dtype)
                frames.append(dst.data)
            fill(slot.chunk_index * chunk_size, dst)
        return True, frames

    def retrieve(self, tokens, namespace: str | None = None, *, extra_keys=None):
        """KV of the leading available tokens, through ``retrieve_chunks``: ``(kv, num_tokens)``, kv a torch
        tensor ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` in the layout dtype; ``num_tokens`` is 0
        on a miss or when the server is unavailable. Bytes are never wrong: a copy made after the lease
        ended is discarded. Raises InputError for bad tokens."""
        with self.retrieve_chunks(tokens, namespace, extra_keys=extra_keys) as got:
            out = join_chunks(self.layout, got.num_tokens, got.chunks)
        if got.ok and got.num_tokens:
            return out, got.num_tokens
        return empty_kv(self.layout, 0)[0], 0

    @contextlib.contextmanager
    def retrieve_chunks(self, tokens, namespace: str | None = None, *, extra_keys=None,
                        timeout_seconds: float | None = None, start: int = 0):
        """``KVBackend.retrieve_chunks`` over the server: the views are the pinned L1 slots (shared memory)
        or the received frames. The client lock is held throughout the ``with`` block (one call at a time),
        so copy and leave. ``ok`` turns False when the server's lease ran out meanwhile (the slot may have
        been reused) or no reply came within ``timeout_seconds`` (counted from the call): discard the copy.
        Raises InputError for bad tokens.
        """
        prompt = P.prompt_fields(tokens, extra_keys, start)
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        got = Retrieved()
        with self.transport.lock:
            shm = self.transport.arena is not None
            reply, payload = self.transport.call(P.RetrieveBegin(id=self.transport.new_id(), **prompt, shm=shm,
                                                        namespace=namespace, extra_keys=extra_keys,
                                                        start=_start(start)),
                                        deadline=deadline)
            ticket = 0
            if isinstance(reply, P.RetrieveSlots) and reply.slots and self.transport.arena is not None:
                if self.prefault:
                    self._populate(reply.slots)
                buffers, ticket = [self.transport.arena.view(s.offset, s.nbytes) for s in reply.slots], reply.ticket
            elif isinstance(reply, P.RetrieveData) and reply.slots and _frames_match(payload, reply.slots):
                buffers = [f.buffer for f in payload]
            else:
                buffers = []
            if buffers:
                got.num_tokens, got.ok = reply.num_tokens, True
                got.chunks = self._chunk_views(reply.slots, buffers, _tokens_per_chunk(tokens, self.info))
            try:
                yield got
            finally:
                got.chunks = []  # the views die with the pins
                if ticket:
                    done, _ = self.transport.call(P.RetrieveEnd(id=self.transport.new_id(), ticket=ticket), retry=False,
                                         deadline=deadline)
                    got.ok = isinstance(done, P.Ok)

    def _populate(self, slots) -> None:
        for slot in slots:
            self.transport.arena.populate(slot.offset, slot.nbytes)

    def _chunk_views(self, slots, buffers, chunk_size: int) -> list:
        dtype = self.layout.numpy_dtype()
        out = []
        for slot, buf in zip(slots, buffers):
            view = chunk_view(buf, self.layout, D.slot_tokens(slot, self.layout), dtype)
            view.flags.writeable = False  # the slot is shared: a reader must never write it
            out.append((slot.chunk_index * chunk_size, view))
        return out

    def clear(self, medium: str | None = None, admin_token: str | None = None) -> int:
        """Drop every chunk the server holds, of every cache: all tiers, or only ``"CPU"`` (L1) or ``"STORAGE"``
        (L2). ``admin_token``: the server's admin token (default ``$KVTIER_ADMIN_TOKEN``). Returns the L1 chunks
        dropped (0 if unavailable). Raises InputError for another medium, ProtocolError when the server refuses
        (wrong or missing admin token; with none configured, unless the server allows unauthenticated admin)."""
        medium = Medium.of_kvtier(medium)
        token = admin_token if admin_token is not None else os.environ.get("KVTIER_ADMIN_TOKEN")
        with self.transport.lock:
            reply, _ = self.transport.call(P.Clear(id=self.transport.new_id(), medium=medium, admin_token=token))
        return reply.num_chunks if isinstance(reply, P.ClearReply) else 0

    def flush(self, timeout_seconds: float = 30.0) -> bool:
        """Wait (at most ``timeout_seconds``) until the server's queued L2 writes are done. True only when every
        store this client saw acknowledged since the last True is durable in the same server incarnation:
        False on timeout, when the server is unavailable, once after one of its L2 writes was dropped or failed,
        and once after the server restarted (a new ``server_id``: writes acknowledged by the old one may be
        lost)."""
        with self.transport.lock:  # the server answers at its own deadline: wait a little past it
            reply, _ = self.transport.call(P.Flush(id=self.transport.new_id(), timeout_seconds=timeout_seconds),
                                           deadline=time.monotonic() + timeout_seconds + FLUSH_REPLY_GRACE_SECONDS)
            if not (isinstance(reply, P.FlushReply) and reply.done):
                return False
            same_server = self._unflushed <= {self.info.server_id}
            self._unflushed.clear()  # a loss is reported once
            return same_server

    def take_events(self) -> list:
        """KV cache events for the engine to publish: always [] today, the server publishes its own events
        (``--enable-kv-events``); part of ``KVBackend`` so connectors treat both backends alike."""
        return []

    def ping(self) -> bool:
        """True when the server answers."""
        with self.transport.lock:
            reply, _ = self.transport.call(P.Ping(id=self.transport.new_id()))
        return isinstance(reply, P.Ok)

    def stats(self) -> dict:
        """The server's counters and gauges ({} when unavailable)."""
        with self.transport.lock:
            reply, _ = self.transport.call(P.Stats(id=self.transport.new_id()))
        return reply.stats if isinstance(reply, P.StatsReply) else {}

    @property
    def shared_memory(self):
        """The server's L1 arena as this process maps it now (``dataplane.SharedMapping``; a new one after the server
        restarts), or None when chunks travel as frames."""
        return self.transport.arena

    @property
    def uses_shared_memory(self) -> bool:
        """Whether KV bytes currently go through the server's shared L1 (else as frames)."""
        return self.transport.arena is not None

    def close(self) -> None:
        """Say goodbye (best effort, short wait) and release the socket and the arena mapping."""
        with self.transport.lock:
            self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _frames_match(payload, slots) -> bool:
    return len(payload) == len(slots) and all(len(f) == s.nbytes for f, s in zip(payload, slots))


def _tokens_per_chunk(tokens, info: P.HelloReply) -> int:
    """A prompt's chunk size: the page size of a ``PageChain``, else the server's chunk size."""
    return tokens.page_size if isinstance(tokens, PageChain) else info.chunk_size


def _start(start) -> int:
    """``start`` checked as ``KVCache`` checks it (the server would refuse a bad one as a protocol error)."""
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise InputError(f"start must be an int >= 0 (a token offset), got {start!r}")
    return start
