"""What the network adapters (s3, azure_blob, redis) share: health, reconnection, and their base class.

A remote adapter never fails to construct because its service is down: it starts unhealthy, answers
every operation as a miss, and retries its connect step with bounded exponential backoff on the next
operation or ``health()`` call after the backoff has passed. Configuration errors found by the
connect step (missing bucket, wrong credentials) are raised from the constructor when the service is
reachable, and reported through ``health()`` when they only show up on a later reconnect.

Errors: these adapters raise ``from None``, deliberately, where every other adapter and the server keep the
cause (``from exc``): a client library's exception text can hold a credential (a URL's password, a SAS query, an
access key) and L2 errors are logged with their traceback; the message carries the cause's type and its text
with the secrets scrubbed (``scrubber``) instead.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pydantic

from kvtier.errors import ConfigError, StorageError
from kvtier.l2.base import AdapterConfig, Buffer, L2Adapter, Usage

log = logging.getLogger("kvtier.l2")


class Reconnector:
    """Tracks one service's health and decides when to try connecting again.

    ``connect`` is called with no arguments and must raise on failure; ``transient`` says which
    exceptions mean "service unreachable" (retried with backoff) rather than a configuration error.
    Thread-safe; ``connect`` runs at most once at a time.
    """

    def __init__(self, label: str, connect: Callable[[], None], transient: Callable[[BaseException], bool],
                 backoff_seconds: float = 0.5, backoff_max_seconds: float = 30.0, scrub: Callable[[str], str] = str):
        self.label = label
        self._connect = connect
        self._transient = transient
        self._scrub = scrub
        self._backoff_seconds = backoff_seconds
        self._backoff_max_seconds = backoff_max_seconds
        self._delay_seconds = backoff_seconds
        self._next_try = 0.0
        self._healthy = False
        self._reason = "not connected yet"
        self._lock = threading.RLock()  # re-entrant: a failure reported while reconnecting must not deadlock
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
                self._delay_seconds = self._backoff_seconds
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
                log.warning("L2 %s: cannot connect (%s); retrying in %.1f s", self.label, self._reason, self._delay_seconds)
                return False
            if not self._healthy and self.num_attempts > 1:
                log.info("L2 %s: connected again", self.label)
            self._healthy, self._reason = True, "ok"
            self._delay_seconds = self._backoff_seconds
            return True
        finally:
            self._lock.release()

    def _mark_down(self, reason: str) -> None:
        self._healthy = False
        self._reason = self._scrub(reason)
        self._next_try = time.monotonic() + self._delay_seconds
        self._delay_seconds = min(self._delay_seconds * 2, self._backoff_max_seconds)


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

    renamed_fields = {"connect_timeout_s": "connect_timeout_seconds", "retry_backoff_s": "retry_backoff_seconds",
                      "retry_backoff_max_s": "retry_backoff_max_seconds"}

    prefix: str = "kvtier/"
    connect_timeout_seconds: float = pydantic.Field(2.0, gt=0)
    max_connections: int = pydantic.Field(16, ge=1, le=1024)  # also the number of requests in flight per batch
    retry_backoff_seconds: float = pydantic.Field(0.5, gt=0)  # first wait before reconnecting after a failure
    retry_backoff_max_seconds: float = pydantic.Field(30.0, gt=0)  # the backoff doubles up to this


def join_parts(parts) -> bytes | memoryview:
    """One buffer from record parts; a single part is passed through without a copy."""
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)


class RemoteAdapter(L2Adapter):
    """Base of the network adapters: the ready guard, the name -> size index, errors, and a request fan-out.

    While the service is unreachable every operation answers a miss (``put`` False, ``get`` None,
    ``contains`` False, ``delete`` 0, ``list_names`` []) instead of raising. A subclass gives
    ``_connect`` (check the service; raise ConfigError for configuration errors), ``_list`` (name -> size
    of every record under the prefix) and either the batch hooks (``_put``, ``_get``, ``_contains``,
    ``_delete``) or the per-record ones they fan out to (``_put_one``, ...), then calls ``_start``.

    Raises:
        StorageError (operations): a request failed (reason scrubbed of secrets); the L2 tier counts it as a miss.
    """

    config: RemoteConfig
    index_may_lag = True  # a service: other servers write into the same prefix

    def __init__(self, config: RemoteConfig, secrets: Iterable[str | None]):
        super().__init__(config)
        self._scrub = scrubber(secrets)
        self._index: dict[str, int] = {}  # name -> record bytes, for usage()
        # no worker thread starts before the first submit, so an adapter that never fans out pays nothing
        self._pool = ThreadPoolExecutor(config.max_connections, thread_name_prefix=f"kvtier-{self.label}")

    def _start(self, transient: Callable[[BaseException], bool]) -> None:
        """First connect (raises ConfigError); ``transient`` tells an unreachable service from a bad config."""
        cfg = self.config
        self._link = Reconnector(self.label, self._reconnect, transient, cfg.retry_backoff_seconds,
                                 cfg.retry_backoff_max_seconds, self._scrub)
        self._link.start()

    def _reconnect(self) -> None:
        self._connect()
        self._index = self._list()

    @abstractmethod
    def _connect(self) -> None:
        """Check the service is usable; raise ConfigError for what only the operator can fix."""

    @abstractmethod
    def _list(self) -> dict[str, int]:
        """Name -> size in bytes of every record under the prefix, asked of the service."""

    def _fail(self, op: str, exc: BaseException) -> StorageError:
        """The StorageError for ``exc`` met during ``op``; an unreachable service also marks the link down.
        Callers raise it ``from None``, the one place adapters drop the cause: the cause's text can hold a
        credential (a URL's password, a SAS query) and L2 errors are logged with their traceback; its type and
        scrubbed text are in the message instead."""
        self._link.failed(exc)
        return StorageError(f"L2 {self.label}: {op} failed: {self._scrub(describe(exc))}")

    def _run(self, op: str, fn, items) -> list:
        """Run ``fn`` on every item with ``max_connections`` in flight; any failure -> one StorageError."""
        futures = [self._pool.submit(fn, item) for item in items]
        results, first_error = [], None
        for fut in futures:
            try:
                results.append(fut.result())
            except Exception as exc:  # noqa: BLE001 - reported below as one StorageError
                results.append(None)
                first_error = first_error or exc
        if first_error is not None:
            raise self._fail(op, first_error) from None
        return results

    # contract: the ready guard, then the subclass's batch hook
    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        if not self._link.ready():
            return [False] * len(items)
        return self._put(items)

    def get(self, names: Sequence[str]) -> list[Buffer | None]:
        if not self._link.ready():
            return [None] * len(names)
        return self._get(names)

    def contains(self, names: Sequence[str]) -> list[bool]:
        if not self._link.ready():
            return [False] * len(names)
        return self._contains(names)

    def indexed(self, names: Sequence[str]) -> list[bool]:
        index = self._index  # list_names may swap in a new dict meanwhile; either is a valid answer
        return [name in index for name in names]

    def delete(self, names: Sequence[str]) -> int:
        if not names or not self._link.ready():
            return 0
        return self._delete(list(dict.fromkeys(names)))

    def list_names(self) -> list[str]:
        if not self._link.ready():
            return []
        try:
            self._index = self._list()
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._fail("list", exc) from None
        return list(self._index)

    def usage(self) -> Usage:
        """Bytes and records this server has listed or written (other writers show up after ``list_names``)."""
        sizes = list(self._index.values())
        return Usage(used_bytes=sum(sizes), num_records=len(sizes))

    def health(self) -> tuple[bool, str]:
        return self._link.health()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # per-record hooks: a subclass without batch hooks of its own gives these
    def _put_one(self, item: tuple[str, Sequence[Buffer]]) -> bool:
        raise NotImplementedError(f"{type(self).__name__} gives neither _put nor _put_one")

    def _get_one(self, name: str) -> Buffer | None:
        raise NotImplementedError(f"{type(self).__name__} gives neither _get nor _get_one")

    def _contains_one(self, name: str) -> bool:
        raise NotImplementedError(f"{type(self).__name__} gives neither _contains nor _contains_one")

    def _delete_one(self, name: str) -> bool:
        raise NotImplementedError(f"{type(self).__name__} gives neither _delete nor _delete_one")

    # batch hooks: by default one request per record, fanned out by _run
    def _put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        return self._run("put", self._put_one, items)

    def _get(self, names: Sequence[str]) -> list[Buffer | None]:
        return self._run("get", self._get_one, names)

    def _contains(self, names: Sequence[str]) -> list[bool]:
        return self._run("contains", self._contains_one, names)

    def _delete(self, names: list[str]) -> int:
        """Remove ``names`` (no repeats); returns how many existed."""
        return sum(self._run("delete", self._delete_one, names))
