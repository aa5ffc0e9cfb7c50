"""L2 adapter for Redis and Valkey, standalone (``redis://``, ``rediss://``) or Redis Cluster.

Keys: ``<prefix>{<name>}`` holds the record; the hash tag ``{name}`` keeps every key of one record in
one cluster slot. The value is one tag byte then either the whole record (``\\x00``) or, for records
larger than ``max_value_bytes`` (the server's ``proto-max-bulk-len``, 512 MiB by default), a manifest
(``\\x01``): the parts are written first under ``<prefix>{<name>}:part:<write id>:<i>``, then the
manifest (total length, part size, xxh3-64 of the record, write id) replaces the main key in one SET.
A reader therefore sees a whole record or a miss: parts of a half-written record are never
referenced, two writers use different write ids, and a reassembled record is checked against the
manifest's length and checksum. Parts of a replaced or deleted manifest are removed after the swap
(read back atomically with MULTI/EXEC); the one exception, a whole record written over a split one
(only when servers disagree on ``max_value_bytes``), leaves parts that expire or that ``clear`` removes.
"""

from __future__ import annotations

import logging
import os
import struct
import urllib.parse
from collections.abc import Sequence

import pydantic
import redis
import redis.cluster
import redis.exceptions as rexc
import xxhash
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvtier.units import SizeBytes
from kvtier.errors import ConfigError, StorageError
from kvtier.l2.base import Buffer
from kvtier.l2.remote import RemoteAdapter, RemoteConfig, describe

log = logging.getLogger("kvtier.l2.redis")

_WHOLE, _MANIFEST = b"\x00", b"\x01"
_MANIFEST_FMT = struct.Struct("<QQQ16s")  # total_bytes, part_bytes, xxh3_64, write id (hex)


class RedisConfig(RemoteConfig):
    """``{"type": "redis", "url": "redis://127.0.0.1:6379/0"}``; ``{"type": "valkey", ...}`` is the same adapter.

    ``cluster`` uses Redis Cluster (the URL names any node). ``ttl_seconds`` expires records. The URL may carry
    a password; it is a secret and never shown (``password`` is the alternative field).
    """

    renamed_fields = {"ttl_s": "ttl_seconds", "socket_timeout_s": "socket_timeout_seconds"}

    url: pydantic.SecretStr
    cluster: bool = False
    password: pydantic.SecretStr | None = None
    tls_ca_file: str | None = None  # CA bundle (PEM) to verify a rediss:// server; default: the system's
    ttl_seconds: float | None = pydantic.Field(None, gt=0)
    max_value_bytes: SizeBytes = pydantic.Field(512 << 20, ge=1024)  # records above this are split into parts
    socket_timeout_seconds: float = pydantic.Field(5.0, gt=0)
    retries: int = pydantic.Field(1, ge=0, le=20)  # redis-py retries of one command on connection errors

    @pydantic.field_validator("url")
    @classmethod
    def _scheme(cls, url: pydantic.SecretStr) -> pydantic.SecretStr:
        scheme = urllib.parse.urlsplit(url.get_secret_value()).scheme
        if scheme not in ("redis", "rediss", "valkey", "valkeys", "unix"):
            raise ValueError(f"url scheme must be redis://, rediss:// or unix://, not {scheme + '://'!r}")
        return url


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, rexc.AuthenticationError):
        return False
    return isinstance(exc, (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError,
                            rexc.RedisClusterException, rexc.TryAgainError))


def _is_auth(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError)) or (
        isinstance(exc, rexc.ResponseError) and text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")))


class RedisAdapter(RemoteAdapter):
    """Records as Redis string values. Thread-safe (redis-py clients are).

    Raises:
        ConfigError (constructor): authentication failed. An unreachable server does not raise: the adapter
            starts unhealthy and reconnects with backoff.
        StorageError (operations): a command failed; the L2 tier counts it as a miss.
    """

    config_class = RedisConfig

    def __init__(self, config: RedisConfig):
        url = config.url.get_secret_value()
        parts = urllib.parse.urlsplit(url)
        password = config.password.get_secret_value() if config.password else None
        super().__init__(config, [password, parts.password, url])
        self.config: RedisConfig = config
        self._where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}"
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        self._px = int(config.ttl_seconds * 1000) if config.ttl_seconds else None  # PX takes ms
        self._part_bytes = config.max_value_bytes
        self._start(_transient)

    def __repr__(self) -> str:
        return f"RedisAdapter({self._where}, cluster={self.config.cluster}, prefix={self.config.prefix!r})"

    def _connect(self) -> None:
        cfg = self.config
        kwargs = {"socket_timeout": cfg.socket_timeout_seconds, "socket_connect_timeout": cfg.connect_timeout_seconds,
                  "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), cfg.retries),
                  "max_connections": cfg.max_connections}
        if cfg.password is not None:
            kwargs["password"] = cfg.password.get_secret_value()
        if cfg.tls_ca_file is not None:
            kwargs["ssl_ca_certs"] = cfg.tls_ca_file
        url = cfg.url.get_secret_value()
        if url.startswith("valkey"):  # valkey:// and valkeys:// are redis-py's redis:// and rediss://
            url = "redis" + url[len("valkey"):]
        try:
            if self._client is None:
                if cfg.cluster:
                    self._client = redis.cluster.RedisCluster.from_url(url, **kwargs)
                else:
                    self._client = redis.Redis.from_url(url, **kwargs)
            self._client.ping()
        except Exception as exc:
            if _is_auth(exc):
                raise ConfigError(f"L2 {self.label}: authentication to {self._where} failed; check the password "
                                  "in the url or the 'password' field") from None
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise ConfigError(f"L2 {self.label}: the TLS certificate of {self._where} is not trusted; set "
                                  "'tls_ca_file' to the CA that signed it") from None
            raise  # a cluster client that failed to build stays None and is built again on the next try

    # helpers
    def _key(self, name: str) -> str:
        return f"{self.config.prefix}{{{name}}}"

    def _part_key(self, name: str, write_id: str, i: int) -> str:
        return f"{self._key(name)}:part:{write_id}:{i}"

    def _fail(self, op: str, exc: BaseException) -> StorageError:
        if not self.config.cluster:  # in a cluster one down node must not stop the other slots
            self._link.failed(exc)
        return StorageError(f"L2 {self.label}: {op} on {self._where} failed: {self._scrub(describe(exc))}")

    def _execute(self, op: str, build, transaction: bool = False) -> list:
        pipe = self._client.pipeline(transaction=transaction)
        build(pipe)
        try:
            return pipe.execute()
        except Exception as exc:  # noqa: BLE001
            raise self._fail(op, exc) from None

    def _part_keys_of(self, name: str, manifest) -> list[str]:
        total, part_bytes, _, write_id = manifest
        count = -(-total // part_bytes)
        return [self._part_key(name, write_id.decode(), i) for i in range(count)]

    @staticmethod
    def _manifest(value) -> tuple | None:
        if value is not None and value[:1] == _MANIFEST and len(value) == 1 + _MANIFEST_FMT.size:
            return _MANIFEST_FMT.unpack_from(value, 1)
        return None

    def _drop_old(self, pairs: list[tuple[str, bytes | None]]) -> None:
        """Delete the parts of replaced or deleted manifests (best effort: TTL or a later delete cleans up)."""
        keys = [k for name, old in pairs if (m := self._manifest(old)) for k in self._part_keys_of(name, m)]
        if keys:
            try:
                self._execute("delete parts", lambda p: [p.delete(k) for k in keys])
            except StorageError as exc:
                log.warning("%s", exc)

    def _call(self, op: str, fn):
        """One direct command (cheaper than a pipeline of one), errors as StorageError."""
        try:
            return fn(self._client)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(op, exc) from None

    def _replace(self, op: str, pairs: list[tuple[str, Buffer | None]]) -> list[bytes]:
        """Set (or delete, where the value is None) each name's main key; return the head of each old value.

        Each read-then-write runs in one MULTI/EXEC, so the manifest returned is the one replaced and its
        parts can be removed. Only the old value's head is read back, never the old record.
        """
        def build(pipe, batch):
            for name, value in batch:
                key = self._key(name)
                pipe.getrange(key, 0, _MANIFEST_FMT.size)
                if value is None:
                    pipe.delete(key)
                else:
                    pipe.set(key, value, px=self._px)
        if self.config.cluster:  # a cluster transaction must stay within one slot: one per name
            results = [r for pair in pairs
                       for r in self._execute(op, lambda p, one=pair: build(p, [one]), transaction=True)]
        else:
            results = self._execute(op, lambda p: build(p, pairs), transaction=True)
        heads = results[0::2]
        self._drop_old([(name, head) for (name, _), head in zip(pairs, heads)])
        return heads

    # batch hooks, called by RemoteAdapter once the link is ready
    def _put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        whole, sizes = [], {}
        for name, parts in items:
            size = sum(memoryview(p).nbytes for p in parts)
            sizes[name] = size
            if 1 + size <= self.config.max_value_bytes:
                # one joined value: measured faster than SET header + APPEND payload (a server-side copy)
                whole.append((name, b"".join([_WHOLE, *parts])))
            else:
                self._put_split(name, parts, size)
        # A plain SET, like the raw client's: no MULTI and no read-back of the old value. A whole record only
        # replaces a split one when servers disagree on max_value_bytes; clear() removes such leftover parts.
        if len(whole) == 1:
            key, value = self._key(whole[0][0]), whole[0][1]
            self._call("put", lambda c: c.set(key, value, px=self._px))
        elif whole:
            self._execute("put", lambda p: [p.set(self._key(n), v, px=self._px) for n, v in whole])
        self._index.update(sizes)
        return [True] * len(items)

    def _put_split(self, name: str, parts: Sequence[Buffer], size: int) -> None:
        data = memoryview(b"".join(parts))
        write_id = os.urandom(8).hex()
        step = self._part_bytes
        # one command per part keeps each request within the server's bulk limit
        for i, start in enumerate(range(0, size, step)):
            key, chunk = self._part_key(name, write_id, i), data[start:start + step]
            self._call("put part", lambda c, k=key, v=chunk: c.set(k, v, px=self._px))
        manifest = _MANIFEST + _MANIFEST_FMT.pack(size, step, xxhash.xxh3_64_intdigest(data), write_id.encode())
        self._replace("put manifest", [(name, manifest)])

    def _get(self, names: Sequence[str]) -> list[Buffer | None]:
        try:
            if len(names) == 1:
                key = self._key(names[0])
                values = [self._call("get", lambda c: c.get(key))]
            else:
                values = self._execute("get", lambda p: [p.get(self._key(n)) for n in names])
        except StorageError:
            if not self.config.cluster or len(names) == 1:
                raise
            values = self._get_each(names)  # a down node: misses for its slots only
        out: list[Buffer | None] = []
        for name, value in zip(names, values):
            if value is None:
                self._index.pop(name, None)
                out.append(None)
            elif value[:1] == _WHOLE:
                out.append(memoryview(value)[1:])
            else:
                out.append(self._reassemble(name, value))
        return out

    def _get_each(self, names: Sequence[str]) -> list:
        values, failed, num_failed = [], None, 0
        for name in names:
            try:
                values.append(self._client.get(self._key(name)))
            except Exception as exc:  # noqa: BLE001 - that key's node is down: a miss
                values.append(None)
                failed, num_failed = exc, num_failed + 1
        if failed is not None:
            log.warning("L2 %s: %d of %d keys unreachable (%s); answered as misses", self.label,
                        num_failed, len(names), self._scrub(describe(failed)))
            self._errors("get", num_failed)
        return values

    def _reassemble(self, name: str, value: bytes) -> bytes | None:
        manifest = self._manifest(value)
        if manifest is None:
            log.warning("L2 %s: key %r holds an unknown value; treated as a miss", self.label, self._key(name))
            return None
        keys = self._part_keys_of(name, manifest)
        chunks = self._execute("get parts", lambda p: [p.get(k) for k in keys])
        if any(c is None for c in chunks):
            return None  # replaced or expired while we read: a miss, never a mixed record
        data = b"".join(chunks)
        if len(data) != manifest[0] or xxhash.xxh3_64_intdigest(data) != manifest[2]:
            log.warning("L2 %s: record %s failed its manifest check; treated as a miss", self.label, name)
            return None
        return data

    def _contains(self, names: Sequence[str]) -> list[bool]:
        found = [bool(n) for n in self._execute("contains", lambda p: [p.exists(self._key(n)) for n in names])]
        for name, hit in zip(names, found):  # adopt what another writer stored (size known after list_names)
            if hit:
                self._index.setdefault(name, 0)
            else:
                self._index.pop(name, None)
        return found

    def _delete(self, names: list[str]) -> int:
        heads = self._replace("delete", [(n, None) for n in names])
        for name in names:
            self._index.pop(name, None)
        return sum(bool(head) for head in heads)  # GETRANGE of a missing key is empty; a record has its tag byte

    def _pattern(self) -> str:
        """SCAN pattern of every main key under the prefix (glob characters in the prefix escaped)."""
        return "".join("\\" + c if c in "*?[]\\" else c for c in self.config.prefix) + "{*}"

    def _list(self) -> dict[str, int]:
        prefix = self.config.prefix
        keys = [k.decode() if isinstance(k, bytes) else k
                for k in self._client.scan_iter(match=self._pattern(), count=1000)]
        heads = self._execute("list", lambda p: [(p.strlen(k), p.getrange(k, 0, _MANIFEST_FMT.size)) for k in keys])
        found = {}
        for key, strlen, head in zip(keys, heads[0::2], heads[1::2]):
            manifest = self._manifest(head)
            found[key[len(prefix) + 1:-1]] = manifest[0] if manifest else strlen - 1
        return found

    def clear(self) -> list[str]:
        """Delete every record under the prefix, and any parts left behind by replaced split records."""
        names = self.list_names()
        self.delete(names)
        if self._link.ready():
            pattern = self._pattern() + ":part:*"
            orphans = list(self._call("clear", lambda c: list(c.scan_iter(match=pattern, count=1000))))
            if orphans:
                self._execute("clear", lambda p: [p.delete(k) for k in orphans])
        return names

    def close(self) -> None:
        super().close()
        if self._client is not None:
            self._client.close()
