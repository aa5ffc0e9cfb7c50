"""The engine side of ``kvtier server``: ``Client`` (a ``KVBackend``) and its shared-memory data plane.

Importing this package loads the wire protocol, pyzmq and numpy, never the server, the storage tiers
(L1, L2), the event publisher or the admin stack (OpenTelemetry, starlette).
"""

from kvtier.backend import KVBackend, Retrieved
from kvtier.client.client import Client

__all__ = ["Client", "KVBackend", "Retrieved"]
