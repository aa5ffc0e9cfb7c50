"""kvtier server: the ZMQ request loop, sessions and leases, shared L1, and admin HTTP.

The engine-side client is ``kvtier.client.Client``; the wire protocol both speak is ``kvtier.protocol``.
"""

from kvtier.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
