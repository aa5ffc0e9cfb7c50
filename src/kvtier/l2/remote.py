"""Health and reconnection shared by the network adapters (s3, azure_blob, redis).

A remote adapter never fails to construct because its service is down: it starts unhealthy, answers
every operation as a miss, and retries its connect step with bounded exponential backoff on the next
operation or ``health()`` call after the backoff has passed. Configuration errors found by the
connect step (missing bucket, wrong credentials) are raised from the constructor when the service is
reachable, and reported through ``health()`` when they only show up on a later reconnect.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import pydantic

from kvtier.errors import ConfigError
from kvtier.l2.base import AdapterConfig

log = logging.getLogger("kvtier.l2")


class Reconnector:
    """Tracks one service's health and decides when to try connecting again.

    ``connect`` is called with no arguments and must raise on failure; ``transient`` says which
    exceptions mean "service unreachable" (retried with backoff) rather than a configuration error.
    Thread-safe; ``connect`` runs at most once at a time.
    """

    def __init__(self, label: str, connect: Callable[[], None], transient: Callable[[BaseException], bool],
                 backoff_s: float = 0.5, backoff_max_s: float = 30.0, scrub: Callable[[str], str] = str):
        self.label = label
        self._connect = connect
        self._transient = transient
        self._scrub = scrub
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._delay_s = backoff_s
        self._next_try = 0.0
        self._healthy = False
        self._reason = "not connected yet"
        self._lock = threading.Lock()
        self.num_attempts = 0

    def start(self) -> None:
        """First connect. Raises ConfigError for configuration errors; a transient failure only marks unhealthy."""
        self._try(raise_config=True)

    def ready(self) -> bool:
        """True when healthy; otherwise retries the connect if the backoff has passed."""
        if self._healthy:
            return True
        if time.monotonic() < self._next_try:
            return False
        return self._try(raise_config=False)

    def failed(self, exc: BaseException) -> None:
        """An operation met ``exc``: if the service looks unreachable, mark unhealthy and back off."""
        if not self._transient(exc):
            return
        with self._lock:
            if self._healthy:
                log.warning("L2 %s: service unreachable (%s); answering misses and retrying", self.label,
                            self._scrub(describe(exc)))
                self._delay_s = self._backoff_s
            self._mark_down(describe(exc))

    def health(self) -> tuple[bool, str]:
        self.ready()
        return self._healthy, "ok" if self._healthy else self._reason

    def _try(self, raise_config: bool) -> bool:
        if not self._lock.acquire(blocking=False):
            return self._healthy  # another thread is connecting
        try:
            self.num_attempts += 1
            try:
                self._connect()
            except ConfigError as exc:
                self._mark_down(str(exc))
                if raise_config:
                    raise
                return False
            except Exception as exc:  # noqa: BLE001 - any connect failure leaves us unhealthy
                if raise_config and not self._transient(exc):
                    raise ConfigError(f"L2 {self.label}: {self._scrub(describe(exc))}") from None
                self._mark_down(describe(exc))
                log.warning("L2 %s: cannot connect (%s); retrying in %.1f s", self.label, self._reason, self._delay_s)
                return False
            if not self._healthy and self.num_attempts > 1:
                log.info("L2 %s: connected again", self.label)
            self._healthy, self._reason = True, "ok"
            self._delay_s = self._backoff_s
            return True
        finally:
            self._lock.release()

    def _mark_down(self, reason: str) -> None:
        self._healthy = False
        self._reason = self._scrub(reason)
        self._next_try = time.monotonic() + self._delay_s
        self._delay_s = min(self._delay_s * 2, self._backoff_max_s)


def describe(exc: BaseException) -> str:
    """One line for logs and errors: exception type and its first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def scrubber(secrets: Iterable[str | None]) -> Callable[[str], str]:
    """A function that replaces every non-empty secret (and its pieces of a connection string) with ``***``."""
    values = sorted({s for s in secrets if s}, key=len, reverse=True)

    def scrub(text: str) -> str:
        for value in values:
            text = text.replace(value, "***")
        return text
    return scrub


class RemoteConfig(AdapterConfig):
    """Fields shared by the network adapters."""

    prefix: str = "kvtier/"
    connect_timeout_s: float = pydantic.Field(2.0, gt=0)
    max_connections: int = pydantic.Field(16, ge=1, le=1024)  # also the number of requests in flight per batch
    retry_backoff_s: float = pydantic.Field(0.5, gt=0)  # first wait before reconnecting after a failure
    retry_backoff_max_s: float = pydantic.Field(30.0, gt=0)  # the backoff doubles up to this


def join_parts(parts) -> bytes | memoryview:
    """One buffer from record parts; a single part is passed through without a copy."""
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)
