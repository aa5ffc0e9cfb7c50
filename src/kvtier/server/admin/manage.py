"""The management API's operations (issue 19 §2): what a call names, resolved into the chunk keys a client would use.

A call names a cache the way a client session does: ``model`` (the id clients send in ``Hello``), ``namespace``
(the client's, e.g. ``keys.namespace_of(lora, cache_salt)``; ``""`` for the base model), ``tenant`` (the caller
speaks for a tenant's clients: their namespace is ``keys.tenant_namespace(tenant, namespace)``, as
``session.scoped_namespace`` makes it for them) and, when that model was seen with several KV layouts,
``layout_id``. The keys are then the cache's own (``KVCache.chunk_refs``, the one hash chain), so what is asked
about here is exactly what that client's lookups, stores and retrieves reach. A (model, namespace) no client
ever opened on this server is refused (404): no chunk of it can exist.

Operations: ``lookup`` (per chunk: its hash, whether L1 holds it, which L2 adapters' indexes hold it, its
retention hint), ``pin`` / ``unpin`` / ``set_ttl`` (L1 retention hints of a prompt's or a session's chunks),
``delete`` (from L1 and every L2 adapter, with BlockRemoved events; ``Tiers.delete``) and ``sessions`` (what each
session holds). Who may call which, and the HTTP side, is ``manage_http.py``.

Thread-safety: called on the admin HTTP's worker threads; L1, the L2 tier and the memo are thread-safe, and
``KnownCaches`` (``server/connections.py``) has its own lock, so the server's lock is not taken (the request thread never waits for a
management call's L2 I/O).
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from dataclasses import dataclass

from kvtier.errors import InputError, KVTierError
from kvtier.hashing import as_token_array, prefix_hashes
from kvtier.hints import RetentionHint, check_hint
from kvtier.keys import ChunkKey, namespace_tenant
from kvtier.server.hashproc import HashProcess, HashProcessError
from kvtier.server.handshake import scoped_namespace

_DIGEST = re.compile(r"[0-9a-f]{32}")  # keys.namespace_of


class ManageError(KVTierError):
    """A management call refused with HTTP ``status`` (400 bad input, 403 not this caller's, 404 no such cache)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def shown_namespace(namespace: str | None) -> str | None:
    """A namespace as the admin HTTP shows it: the connector's are digests already (``keys.namespace_of``: no
    cache_salt in them); any other string a client chose is shown as a digest of it, never as given."""
    if not namespace or _DIGEST.fullmatch(namespace):
        return namespace
    return "sha256:" + hashlib.sha256(namespace.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Target:
    """What a call names (see the module docstring); ``admin``: the caller holds the admin token (or the server
    allows unauthenticated admin), so it may speak for any tenant."""

    model: str
    namespace: str = ""
    tenant: str | None = None
    layout_id: str | None = None
    admin: bool = False


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ManageError(400, "'text' needs transformers on the server (pip install 'kvtier[hf]'); send 'tokens'") \
            from exc
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ManageError(400, f"'tokenizer': no tokenizer at {path!r} on the server (a local model folder with "
                               f"tokenizer files): {exc}") from exc


def tokenize(text: str, tokenizer: str | None, add_special_tokens: bool = True) -> list[int]:
    """``text`` as token ids by the tokenizer of the local model folder ``tokenizer`` (transformers
    ``AutoTokenizer``, loaded once; ``add_special_tokens`` as the engine adds them, e.g. a BOS). Raises ManageError."""
    if not tokenizer:
        raise ManageError(400, "'text' needs 'tokenizer': the local path of the model's folder (or send 'tokens')")
    return list(_tokenizer(tokenizer).encode(text, add_special_tokens=add_special_tokens))


class Management:
    """The operations over a server's parts: its ``config``, ``tiers``, ``known`` caches (``KnownCaches``),
    ``keyring`` (None without authentication) and client ``limits``.

    Long prompts (``server.hash_offload_min_tokens`` and more) are hashed by a child process of their own
    (``server/hashproc.py``), not holding the GIL the request thread needs; call ``close`` to stop it.
    """

    def __init__(self, config, tiers, known, keyring, limits):
        self.config, self.tiers, self.known, self.keyring, self.limits = config, tiers, known, keyring, limits
        self.l1 = tiers.l1
        self._hashproc = HashProcess(config.server.promote_timeout_seconds)
        self._hash_lock = threading.Lock()  # HashProcess: one caller at a time

    def close(self) -> None:
        self._hashproc.close()

    # ---- resolving ---------------------------------------------------------------------------------
    def namespace_of(self, target: Target) -> str:
        """The namespace the target's clients are keyed under. Raises ManageError: an unknown tenant (404), a
        tenant's namespace without the admin token (403)."""
        if not isinstance(target.model, str) or not target.model:
            raise ManageError(400, "'model' must be the non-empty model id the engines send (see /status clients)")
        if target.tenant is not None:
            keyring = self.keyring
            if keyring is None or target.tenant not in keyring.creds.tenants:
                raise ManageError(404, f"'tenant': no tenant {target.tenant!r} on this server (kvtier auth tenant "
                                       "adds one)")
        namespace = scoped_namespace(target.tenant, target.namespace)
        if not target.admin and namespace_tenant(namespace) is not None:
            raise ManageError(403, "a tenant's namespace needs the admin token: send 'Authorization: Bearer <token>'")
        return namespace

    def caches_of(self, target: Target) -> tuple[str, list]:
        """(namespace, the caches of the target's model there). Raises ManageError (404: no client ever opened it)."""
        namespace = self.namespace_of(target)
        caches = self.known.matching(target.model, namespace, target.layout_id)
        if not caches:
            known = f"; models seen: {', '.join(self.known.models()) or 'none'}" if target.admin else ""
            layout = f" with layout_id {target.layout_id!r}" if target.layout_id else ""
            raise ManageError(404, f"no client opened model {target.model!r}{layout} in that namespace on this server "
                                   f"('model', 'namespace', 'tenant' name it as the engines' sessions do){known}")
        return namespace, caches

    def prompt_refs(self, target: Target, tokens, extra_keys=None, *, memo_only: bool = False) -> tuple | None:
        """(the cache, its namespace, the prompt's chunk refs) as the target's clients key them (``memo_only``: None
        unless the refs are memoised, nothing hashed). Raises ManageError: a layout to choose (400), a prompt over
        ``server.max_prompt_tokens`` (400), bad tokens or extra keys (400)."""
        namespace, caches = self.caches_of(target)
        if len(caches) > 1:
            layouts = ", ".join(sorted(c.layout.layout_id for c in caches))
            raise ManageError(400, f"model {target.model!r} was opened with several KV layouts: name one as "
                                   f"'layout_id' ({layouts})")
        limits = self.limits
        if limits.enabled and len(tokens) > limits.max_prompt_tokens:
            raise ManageError(400, f"'tokens': a prompt of {len(tokens)} tokens exceeds server.max_prompt_tokens "
                                   f"({limits.max_prompt_tokens}); send a shorter prompt")
        cache = caches[0]
        try:
            arr = as_token_array(tokens)
            if memo_only and cache.unhashed_tokens(arr, namespace, extra_keys=extra_keys):
                return None
            long = len(arr) >= self.config.server.hash_offload_min_tokens
            _, refs = cache.chunk_refs(arr, namespace, extra_keys=extra_keys,
                                       hasher=self._hash if long else prefix_hashes)
        except InputError as exc:
            raise ManageError(400, f"'tokens' / 'extra_keys': {exc}") from exc
        return cache, namespace, refs

    def _hash(self, *args, **kwargs) -> list[bytes]:
        with self._hash_lock:
            try:
                return self._hashproc.prefix_hashes(*args, **kwargs)
            except HashProcessError:
                return prefix_hashes(*args, **kwargs)

    def session_keys(self, target: Target, session_id) -> list[ChunkKey]:
        """The L1 keys whose retention hint names ``session_id``, of the target's model and namespace."""
        check_hint(session_id=session_id)  # names the field when bad
        namespace, caches = self.caches_of(target)
        layouts = {c.keys.key_layout_id for c in caches}
        return [k for k in self.l1.session_keys(session_id)
                if k.model == target.model and k.namespace == namespace and k.layout_id in layouts]

    # ---- reads -------------------------------------------------------------------------------------
    def lookup(self, target: Target, tokens, extra_keys=None, *, memo_only: bool = False) -> dict | None:
        """Per chunk of the prompt: index, token range, hash, whether L1 holds it, the L2 adapters whose index holds
        it, its retention hint; and the leading tokens a lookup would answer (all of it, then L1's part).
        ``memo_only``: None unless the prompt's refs are memoised (then no hashing, no I/O: quick)."""
        found = self.prompt_refs(target, tokens, extra_keys, memo_only=memo_only)
        if found is None:
            return None
        cache, namespace, refs = found
        keys = [r.key for r in refs]
        scope = keys[0].scope if keys else ""  # one cache: one scope (a name's hex is half a lookup's work)
        names = [f"{scope}-{k.prefix_hash.hex()}" for k in keys]
        in_l1 = [self.l1.contains(k) for k in keys]
        holders = self.tiers.l2.holders(keys, names)
        n_l1 = _leading(in_l1)
        in_l2 = [any(hits[i] for _, hits in holders) for i in range(len(keys))]
        n = n_l1 + _leading(in_l2[n_l1:])
        chunks = [{"index": r.index, "start": r.start, "end": r.end, "hash": r.key.prefix_hash.hex(),
                   "name": names[i], "l1": in_l1[i], "l2": [label for label, hits in holders if hits[i]],
                   "retention": self.l1.retention_of(r.key) if in_l1[i] else None} for i, r in enumerate(refs)]
        return {"model": target.model, "namespace": shown_namespace(namespace),
                "layout_id": cache.layout.layout_id, "chunk_size": cache.chunk_size, "num_prompt_tokens": len(tokens),
                "num_tokens": refs[n - 1].end if n else 0, "num_l1_tokens": refs[n_l1 - 1].end if n_l1 else 0,
                "l2_adapters": [label for label, _ in holders], "chunks": chunks}

    def sessions(self, target: Target | None, admin: bool) -> list[dict]:
        """Per (session, model, namespace): chunks and bytes L1 holds under its hints, how many of them are pinned
        and how many some L2 index holds. ``target``: only its model and namespace; None: all (a tenant's only
        for ``admin``)."""
        namespace = None if target is None else self.namespace_of(target)
        rows = []
        for session_id in sorted(self.l1.sessions()):
            groups: dict[tuple[str, str], list[ChunkKey]] = {}
            for key in self.l1.session_keys(session_id):
                if target is not None and (key.model != target.model or key.namespace != namespace):
                    continue
                if not admin and namespace_tenant(key.namespace) is not None:
                    continue
                groups.setdefault((key.model, key.namespace), []).append(key)
            for (model, ns), keys in groups.items():
                rows.append(self._session_row(session_id, model, ns, keys, admin))
        return rows

    def _session_row(self, session_id: str, model: str, namespace: str, keys: list[ChunkKey], admin: bool) -> dict:
        nbytes = pinned = 0
        for key in keys:
            cache, tokens, hint = self.known.of_key(key), self.l1.meta(key), self.l1.retention_of(key)
            if cache is not None and tokens is not None:
                nbytes += cache.layout.chunk_bytes(tokens)
            pinned += bool(hint and hint["pinned"])
        holders = self.tiers.l2.holders(keys)
        in_l2 = sum(any(hits[i] for _, hits in holders) for i in range(len(keys)))
        row = {"session_id": session_id, "model": model, "namespace": shown_namespace(namespace),
               "num_chunks": len(keys), "bytes": nbytes, "num_pinned": pinned, "num_l2_chunks": in_l2}
        if admin:
            row["tenant"] = namespace_tenant(namespace)
        return row

    # ---- mutations ---------------------------------------------------------------------------------
    def pin(self, keys: list[ChunkKey], priority=None) -> dict:
        """Pin the chunks L1 holds of ``keys`` (never evicted, no expiry; a session they belong to is kept)."""
        hint = check_hint(priority=priority) or RetentionHint()
        present = [k for k in keys if self.l1.contains(k)]
        accepted, refused = self.l1.hint(present, hint, pinned=True)
        return self._outcome(keys, accepted, refused, "pinned")

    def unpin(self, keys: list[ChunkKey]) -> dict:
        """Make ``keys`` ordinary eviction candidates again; one of a session stays in it (the session TTL)."""
        done = 0
        for key in keys:
            hint = self.l1.retention_of(key)
            if hint is None:
                continue
            self.l1.unhint([key])
            if hint["session_id"] is not None:
                self.l1.hint([key], RetentionHint(session_id=hint["session_id"]))
            done += 1
        return {"num_chunks": len(keys), "unpinned": done, "absent": sum(not self.l1.contains(k) for k in keys)}

    def set_ttl(self, keys: list[ChunkKey], ttl_seconds, priority=None) -> dict:
        """Give the chunks L1 holds of ``keys`` a TTL of ``ttl_seconds`` from now (and ``priority``), replacing
        their hint (a pin too); a session they belong to is kept. Raises InputError naming a bad field."""
        if ttl_seconds is None:
            raise ManageError(400, "'ttl_seconds' is required (a number of seconds > 0)")
        hint = check_hint(priority, ttl_seconds)
        accepted = refused = 0
        for key in keys:
            if not self.l1.contains(key):
                continue
            old = self.l1.retention_of(key)
            self.l1.unhint([key])
            a, r = self.l1.hint([key], RetentionHint(hint.priority, hint.ttl_seconds, old and old["session_id"]))
            accepted, refused = accepted + a, refused + r
        return self._outcome(keys, accepted, refused, "set")

    def _outcome(self, keys: list[ChunkKey], accepted: int, refused: int, verb: str) -> dict:
        out = {"num_chunks": len(keys), verb: accepted, "refused": refused,
               "absent": sum(not self.l1.contains(k) for k in keys)}
        if refused:
            share = self.config.l1_retention_max_share
            raise ManageError(409, f"{refused} of {len(keys)} chunks were refused: protected chunks would hold more "
                                   f"than l1_retention_max_share ({share:g}) of L1; {accepted} were {verb}. Unpin or "
                                   f"delete other chunks, or raise l1_retention_max_share. Outcome: {out}")
        return out

    def delete(self, keys: list[ChunkKey]) -> dict:
        """Delete ``keys`` from L1 and every L2 adapter with their BlockRemoved events (``Tiers.delete``), and say
        how many remain anywhere afterwards (L1, the L2 indexes): 0 unless a promotion raced the delete."""
        deleted = self.tiers.delete(keys)
        holders = self.tiers.l2.holders(keys)
        remaining = sum(self.l1.contains(k) or any(hits[i] for _, hits in holders) for i, k in enumerate(keys))
        return {"num_chunks": len(keys), "deleted": deleted, "remaining": remaining}


def _leading(flags: list[bool]) -> int:
    count = 0
    while count < len(flags) and flags[count]:
        count += 1
    return count
