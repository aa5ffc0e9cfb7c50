"""Event streams of one publisher: the operator's (every event) and, with authentication, one per tenant.

Why streams: a ZMQ PUB sends each message to every subscriber whose subscription prefixes its topic, so the
only way to keep tenant A's token ids from tenant B is to publish A's events under a topic B cannot subscribe
to. With authentication the publisher's XPUB (``XPUB_MANUAL``) decides each subscription itself from the
connection's ZAP ``User-Id`` (``subscription_for``):

* a tenant ``t`` is only ever subscribed to ``tenant:<t>/...``; its stream's topic is ``tenant:<t>/<topic>``
  and it carries only events of chunks in ``t``'s namespaces (``keys.tenant_namespace``);
* the operator (``"*"``: the server's own secret, or a subscriber key of ``kvtier auth subscriber``) asking
  for a prefix of ``<topic>`` (``""`` included) is subscribed to exactly ``<topic>``, the operator stream of
  every event; asking for ``tenant:<t>/`` it watches that tenant's stream.

Each stream has its own sequence numbers (0, 1, 2, ...) and its own replay ring, so a tenant's consumer sees a
contiguous stream and can detect and recover its gaps exactly as with vLLM's publisher. The topic must then be
non-empty and must neither start with nor be a prefix of ``tenant:`` (``check_topic``), else an operator's
subscription would also match the tenant streams.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from kvtier.auth.secret_file import FULL_ACCESS
from kvtier.errors import ConfigError

TENANT_PREFIX = b"tenant:"


def tenant_topic(tenant: str, topic: bytes) -> bytes:
    """The topic of ``tenant``'s stream: ``tenant:<tenant>/<topic>``."""
    return TENANT_PREFIX + tenant.encode() + b"/" + topic


def check_topic(topic: bytes) -> None:
    """Raise ConfigError unless ``topic`` can name the operator stream beside tenant streams."""
    if not topic or topic.startswith(TENANT_PREFIX) or TENANT_PREFIX.startswith(topic):
        raise ConfigError(f"kv_events.topic {topic.decode(errors='replace')!r} cannot be used with authenticated "
                          "events: it must be non-empty and neither start with nor be a prefix of 'tenant:' "
                          "(tenant streams are published as tenant:<name>/<topic>); e.g. kv-events")


def subscription_for(user: str | None, prefix: bytes, topic: bytes) -> bytes | None:
    """The prefix the publisher subscribes a connection to when it asks for ``prefix``.

    Args:
        user: the connection's ZAP ``User-Id``: ``"*"`` (operator) or a tenant name; None (no authentication
            metadata) gets nothing.
        prefix: what the subscriber asked for (its SUB's ``SUBSCRIBE`` value).
        topic: the operator stream's topic (``kv_events.topic``).
    """
    if not user:
        return None
    if user == FULL_ACCESS:
        return topic if topic.startswith(prefix) else prefix
    own = tenant_topic(user, b"")
    return prefix if prefix.startswith(own) else own + prefix


@dataclass
class Stream:
    """One stream's topic, next sequence number and replay ring (bounded in batches and payload bytes)."""

    topic: bytes
    max_batches: int
    max_bytes: int
    next_seq: int = 0
    ring: collections.deque = field(default_factory=collections.deque)  # (seq, payload) oldest first
    ring_bytes: int = 0

    def take_seq(self) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq

    def keep(self, seq: int, payload: bytes) -> None:
        """Buffer a sent batch for replay; the oldest go first past either bound."""
        self.ring.append((seq, payload))
        self.ring_bytes += len(payload)
        while len(self.ring) > self.max_batches or self.ring_bytes > self.max_bytes:
            self.ring_bytes -= len(self.ring.popleft()[1])

    def since(self, start: int) -> list[tuple[int, bytes]]:
        return [(seq, payload) for seq, payload in self.ring if seq >= start]
