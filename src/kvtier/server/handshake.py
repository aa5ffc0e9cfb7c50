"""The handshake: what a ``Hello`` must agree on with the server, and how a client's namespace is scoped.

``check_hello`` refuses a session that cannot work (another protocol version, a KV layout the server computes
differently or that does not fit L1, a setting the client expects otherwise, an identity past its bound) with a
message naming both sides of the difference; ``handshake_values`` are the settings a client checks.
"""

from __future__ import annotations

from kvtier import __version__
from kvtier import protocol as P
from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError
from kvtier.keys import tenant_namespace
from kvtier.layout import KVLayout
from kvtier.server.limits import identity_refusal


def scoped_namespace(tenant: str | None, namespace: str | None) -> str | None:
    """``namespace`` as the server keys it for a client of ``tenant``: the tenant's own, whatever it names."""
    return namespace if namespace is None or tenant is None else tenant_namespace(tenant, namespace)


class HandshakeRefused(KVTierError):
    """A Hello the server refuses; ``code`` is the protocol error code, the message says what differs."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def handshake_values(config: KVTierConfig) -> dict:
    """The settings a client must agree with (sent in HelloReply, checked against ``Hello.expect``)."""
    return {"chunk_size": config.chunk_size, "block_size": config.effective_block_size,
            "hash_algorithm": config.hash_algorithm, "hash_seed": config.hash_seed,
            "save_unfull_chunk": config.save_unfull_chunk}


# setting -> how the server is told (flag, or config key / variable where there is no flag)
_HOW = {"chunk_size": "--chunk-size", "block_size": "--block-size", "hash_algorithm": "--hash-algorithm",
        "hash_seed": "--hash-seed", "save_unfull_chunk": "save_unfull_chunk in --config (or KVTIER_SAVE_UNFULL_CHUNK)"}


def check_hello(msg: P.Hello, config: KVTierConfig, l1_capacity_bytes: int) -> KVLayout:
    """The client's KV layout if the session can open. Raises HandshakeRefused (version, layout or
    setting mismatch, empty model id) with a message naming both sides of the difference."""
    if msg.version != P.PROTOCOL_VERSION:
        raise HandshakeRefused("version_mismatch", f"client speaks protocol version {msg.version}, this server "
                               f"{P.PROTOCOL_VERSION} (kvtier {__version__}): upgrade the older side")
    try:
        layout = KVLayout.from_dict(msg.layout)
    except KVTierError as exc:
        raise HandshakeRefused("layout_mismatch", f"invalid KV layout: {exc}") from exc
    if layout.layout_id != msg.layout_id:
        raise HandshakeRefused("layout_mismatch", f"layout id differs: client computed {msg.layout_id}, server "
                               f"computes {layout.layout_id} for {layout.to_dict()}; kvtier versions differ")
    chunk_bytes = layout.chunk_bytes(config.chunk_size)
    if chunk_bytes > l1_capacity_bytes:
        raise HandshakeRefused("layout_mismatch", f"one chunk of this layout is {chunk_bytes} bytes, more than "
                               f"the whole L1 ({l1_capacity_bytes} bytes): raise --l1-size-gb")
    if not msg.model:
        raise HandshakeRefused("bad_request", "model id must not be empty")
    refusal = identity_refusal(config.server, model=msg.model, namespace=msg.namespace)
    if refusal:
        raise HandshakeRefused("bad_request", refusal)
    mine = handshake_values(config)
    unknown = sorted(set(msg.expect) - set(mine))
    if unknown:
        raise HandshakeRefused("bad_request", f"cannot check unknown settings {unknown}; known: {', '.join(mine)}")
    diffs = [f"{key} differs: client expects {want!r}, server uses {mine[key]!r} (start the server with "
             f"{_HOW[key]} {want})" for key, want in msg.expect.items() if want != mine[key]]
    if diffs:
        raise HandshakeRefused("config_mismatch", "; ".join(diffs))
    return layout
