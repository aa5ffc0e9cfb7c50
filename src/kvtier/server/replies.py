"""Error replies of the request plane (``kvtier.protocol.Error``), with the metric a refused bound counts."""

from __future__ import annotations

from kvtier import protocol as P


def error_reply(msg, code: str, message: str) -> P.Error:
    """The ``Error`` answering request ``msg`` (``code``: one of ``kvtier.protocol``'s error codes)."""
    return P.Error(id=msg.id, code=code, message=message)


def limited_reply(metrics, msg, limit: str, message: str) -> P.Error:
    """``Error(limit_exceeded)`` for ``msg``, counted in ``kvtier_client_limit_exceeded_total{limit}``."""
    metrics.inc("kvtier_client_limit_exceeded_total", limit=limit)
    return P.Error(id=msg.id, code="limit_exceeded", message=message)
