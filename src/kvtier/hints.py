"""Retention hints on a store: ``priority`` (0-3), ``ttl_seconds``, ``session_id``; validation with field names.

What they do to eviction is ``kvtier.l1.retention``'s business; this module is only the value and its checks, so
the engine side (``kvtier.client``, the connectors) can build hints without importing L1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.errors import InputError

MAX_PRIORITY = 3
MAX_SESSION_ID_CHARS = 256
HINT_FIELDS = ("priority", "ttl_seconds", "session_id")


@dataclass(frozen=True, slots=True)
class RetentionHint:
    """What a store asks for its chunks. ``priority``: 0 (ordinary) to 3; ``ttl_seconds``: > 0, or None (no
    expiry but ``retention_max_ttl_seconds``; with a ``session_id``, the configured session TTL); ``session_id``:
    groups chunks for the management API (non-empty, at most 256 characters); ``owner``: who set it, whose share
    of the protected bytes it counts against (the server sets the client's principal; None: nobody's). Build it
    with ``check_hint`` to get field-naming errors."""

    priority: int = 0
    ttl_seconds: float | None = None
    session_id: str | None = None
    owner: str | None = None

    @property
    def protects(self) -> bool:
        return self.priority > 0 or self.ttl_seconds is not None or self.session_id is not None


def check_hint(priority=None, ttl_seconds=None, session_id=None) -> RetentionHint | None:
    """A validated ``RetentionHint`` (None when every field is None). Raises InputError naming the bad field:
    ``priority`` not an int in 0..3, ``ttl_seconds`` not a finite number > 0, ``session_id`` not a non-empty
    string of at most 256 characters."""
    if priority is None and ttl_seconds is None and session_id is None:
        return None
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not 0 <= priority <= MAX_PRIORITY):
        raise InputError(f"retention hint field 'priority' must be an int from 0 to {MAX_PRIORITY}, got {priority!r}")
    if ttl_seconds is not None:
        if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, (int, float)) or not math.isfinite(ttl_seconds):
            raise InputError(f"retention hint field 'ttl_seconds' must be a number of seconds, got {ttl_seconds!r}")
        if ttl_seconds <= 0:
            raise InputError(f"retention hint field 'ttl_seconds' must be > 0 (omit it for no expiry), "
                             f"got {ttl_seconds!r}")
    if session_id is not None and (not isinstance(session_id, str) or not session_id
                                   or len(session_id) > MAX_SESSION_ID_CHARS):
        raise InputError(f"retention hint field 'session_id' must be a non-empty string of at most "
                         f"{MAX_SESSION_ID_CHARS} characters, got {session_id!r:.80}")
    return RetentionHint(priority or 0, None if ttl_seconds is None else float(ttl_seconds), session_id)


def check_ttl_bound(hint: RetentionHint | None, max_ttl_seconds: float) -> None:
    """Raise InputError when ``hint`` asks for a TTL past ``retention_max_ttl_seconds`` (``max_ttl_seconds``)."""
    if hint is not None and hint.ttl_seconds is not None and hint.ttl_seconds > max_ttl_seconds:
        raise InputError(f"retention hint field 'ttl_seconds' ({hint.ttl_seconds:g}) exceeds "
                         f"retention_max_ttl_seconds ({max_ttl_seconds:g}): ask for a shorter TTL, or store again "
                         "to extend it")


def hint_from_params(params: Mapping | None) -> RetentionHint | None:
    """The hint in an engine's per-request parameters (vLLM ``kv_transfer_params``; Dynamo passes its frontend's
    through): ``kvtier.priority``, ``kvtier.ttl_seconds``, ``kvtier.session_id`` (other keys are left alone).
    Raises InputError naming a bad field."""
    if not params:
        return None
    if not isinstance(params, Mapping):
        raise InputError(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
    return check_hint(*(params.get("kvtier." + name) for name in HINT_FIELDS))
