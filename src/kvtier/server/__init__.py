"""kvtier server: ZMQ protocol, shared-memory data plane, admin HTTP, and the engine-side ``Client``."""

from kvtier.server.client import Client
from kvtier.server.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "Client"]
