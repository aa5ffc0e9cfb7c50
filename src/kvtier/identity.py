"""Identity: what besides the tokens decides a chunk's KV, in the forms keys and hashes need.

- ``model_identity``: the weights' identity (never a served name), the ``model`` of every ``ChunkKey``.
- ``lora_identity``: an adapter's identity (name, path and a digest of its files), for ``keys.namespace_of``.
- Per-block extra keys, vLLM 0.32's tagged form (``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``):
  ``("lora", name, path)`` on every block of a LoRA request, ``("mm", identifier, offset_in_block)`` for each
  multimodal item overlapping the block, ``("cache_salt", salt)`` on block 0, ``("prompt_embeds", digest)``;
  a block's entry is the tuple of those (in that order) or None. They enter the block hash
  (``hashing.prefix_hashes``), so kvtier's digests equal vLLM's for LoRA, salted and multimodal requests.
  ``block_extra_keys`` builds them without vLLM; ``check_extra_keys`` validates what a caller or a client sent;
  ``event_extra_keys`` gives vLLM's untagged event form (reference events-and-hashing.md §2.3).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import cbor2

from kvtier.errors import InputError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_HEAD_BYTES = 1 << 16  # every weight file's first bytes (safetensors / GGUF headers) ...
SAMPLE_BYTES, MAX_SAMPLES = 4096, 256  # ... and this many bytes at up to this many evenly spaced offsets
MAX_KEYS_PER_BLOCK = 256  # extra keys in one block's entry
MAX_KEY_DEPTH = 3  # a key, and sequences nested in it (entry -> ("mm", id, offset) is depth 1)
MAX_KEY_BYTES = 4096  # one str or bytes inside a key
_FLAT = frozenset({str, bytes, int, type(None)})  # exact types: a bool is no key part


def _digest16(obj) -> str:
    """16 hex chars of SHA-256 over the canonical CBOR of ``obj``."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).hexdigest()[:16]


# ---- model and adapter identity ----------------------------------------------------------------------
def model_identity(path_or_repo_id: str | os.PathLike, revision: str | None = None, *, extra: str | None = None) -> str:
    """The identity of a model's weights: ``"<name>@<16 hex>"``, the ``model`` field of every chunk key.

    The digest covers the resolved local path (or the hub repo id), ``revision``, a digest of ``config.json``
    and the names and sizes of the weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf``), for a
    model folder or a single weight file (a GGUF), plus a sample of each weight file's bytes (its first
    64 KiB and 4 KiB at up to 256 evenly spaced offsets: about 1 MiB read per file, whatever its size), so a
    checkpoint re-trained and saved over the old one (same path, config and sizes) gets a new identity too.
    Every process loading the same files agrees. A repo id that is not a local path is looked up in the
    local Hugging Face cache (``huggingface_hub``, no download); when absent there the digest covers the repo
    id and ``revision`` only (pin ``revision`` to a commit then). To share chunks between machines that keep
    the same weights under different paths, give every engine the same explicit model id instead
    (``kvtier.model``), and change it whenever the weights change. ``extra``: anything else that changes
    what the weights compute (an engine's effective model config, with its overrides), hashed along.

    Raises:
        InputError: an empty id, or a local folder that holds no ``config.json`` and no weight files.
    """
    text = os.fspath(path_or_repo_id)
    if not text:
        raise InputError("model path or repo id must not be empty")
    local = Path(text).expanduser()
    if local.exists():
        local = local.resolve()
        return f"{local.name}@{_digest16([*_files_identity(local, str(local), revision), extra])}"
    snapshot = _hub_snapshot(text, revision)
    if snapshot is not None:  # the same commit in any cache path: name it by repo id and commit
        return f"{text}@{_digest16([*_files_identity(snapshot, text, snapshot.name), extra])}"
    return f"{text}@{_digest16(['kvtier-model-v1', text, revision, None, [], extra])}"


def _files_identity(local: Path, source: str, revision: str | None) -> list:
    if local.is_file():
        return ["kvtier-model-v1", source, revision, None, [[local.name, *_weights_sample(local)]]]
    config = local / "config.json"
    config_digest = hashlib.sha256(config.read_bytes()).digest() if config.is_file() else None
    weights = sorted([p.relative_to(local).as_posix(), *_weights_sample(p)] for p in local.rglob("*")
                     if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if config_digest is None and not weights:
        raise InputError(f"{local} holds no config.json and no weight files ({', '.join(WEIGHT_SUFFIXES)}); "
                         "pass the model folder, a GGUF file, a hub repo id, or an explicit model id")
    return ["kvtier-model-v1", source, revision, config_digest, weights]


def _weights_sample(path: Path) -> list:
    """``[size, digest of the sampled bytes]`` of one weight file (offsets depend on the size only)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_HEAD_BYTES))
        count = min(MAX_SAMPLES, max(0, size - SAMPLE_HEAD_BYTES) // SAMPLE_BYTES)
        for k in range(count):
            f.seek(SAMPLE_HEAD_BYTES + (size - SAMPLE_HEAD_BYTES - SAMPLE_BYTES) * k // max(1, count - 1))
            h.update(f.read(SAMPLE_BYTES))
    return [size, h.digest()]


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of a hub repo (no network), or None."""
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 -- not installed, not cached, not a repo id: identity from the id alone
        return None


def lora_identity(name: str, path: str | os.PathLike | None = None) -> str:
    """A LoRA adapter's identity: ``"<name>@<16 hex>"`` over the name, the path and a digest of the adapter's
    files where they are readable (every regular file under ``path``, or the file ``path``).

    The same adapter at the same path gives the same identity in every process; an adapter re-trained under
    the same name and path gives a new one. File digests are cached per process by (path, size, mtime_ns).
    A ``path`` that is not readable here (e.g. a hub id) contributes its text only.

    Raises:
        InputError: an empty name.
    """
    if not isinstance(name, str) or not name:
        raise InputError(f"LoRA name must be a non-empty string, got {name!r}")
    path_text = None if path is None else os.fspath(path)
    return f"{name}@{_digest16(['kvtier-lora-v1', name, path_text, _adapter_digest(path_text)])}"


def _adapter_digest(path: str | None) -> bytes | None:
    if not path:
        return None
    root = Path(path).expanduser()
    try:
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(root).parts))
        else:
            return None
        parts = []
        for f in files:
            st = f.stat()
            parts.append([f.name if f == root else f.relative_to(root).as_posix(),
                          _file_digest(str(f.resolve()), st.st_size, st.st_mtime_ns)])
    except OSError:
        return None
    return hashlib.sha256(cbor2.dumps(parts, canonical=True)).digest()


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> bytes:  # size and mtime_ns: the cache key
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


# ---- per-block extra keys ----------------------------------------------------------------------------
def num_blocks_of(num_tokens: int, block_size: int) -> int:
    """Blocks of a T-token prompt, a trailing partial block included: the length ``extra_keys`` must have."""
    return -(-num_tokens // block_size)


def block_extra_keys(num_tokens: int, block_size: int, *, lora: tuple[str, str] | None = None,
                     cache_salt: str | None = None, mm_items: Sequence[tuple[str, int, int]] = (),
                     prompt_embeds_digests: Sequence[bytes] | None = None) -> list | None:
    """Per-block extra keys as vLLM 0.32 builds them, for callers without vLLM.

    Args:
        num_tokens: prompt length T; one entry per block, a trailing partial block included (``ceil(T / block_size)``).
        block_size: the engine's block size (the config's ``block_size``).
        lora: ``(lora_name, lora_path)`` of the adapter, or None.
        cache_salt: the request's salt, or None.
        mm_items: ``(identifier, offset, length)`` per multimodal item (identifier: vLLM's
            ``MultiModalFeatureSpec.identifier``, the item's content hash; offset/length: its placeholder
            token range in the prompt).
        prompt_embeds_digests: one SHA-256 digest (bytes) per block of the prompt embeddings, or None.

    Returns:
        a list with one entry per block (None or a tuple of tagged keys), or None when no block has any.

    Raises:
        InputError: negative sizes, or ``prompt_embeds_digests`` of the wrong length.
    """
    if num_tokens < 0 or block_size <= 0:
        raise InputError(f"need num_tokens >= 0 and block_size > 0, got {num_tokens} and {block_size}")
    n = num_blocks_of(num_tokens, block_size)
    if prompt_embeds_digests is not None and len(prompt_embeds_digests) != n:
        raise InputError(f"prompt_embeds_digests has {len(prompt_embeds_digests)} entries; need one per block ({n})")
    items = sorted(mm_items, key=lambda item: item[1])
    out: list = []
    for b in range(n):
        start, end = b * block_size, min((b + 1) * block_size, num_tokens)
        keys: list = [("lora", lora[0], lora[1])] if lora else []
        keys += [("mm", ident, offset - start) for ident, offset, length in items
                 if offset < end and start < offset + length]
        if b == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        if prompt_embeds_digests is not None:
            keys.append(("prompt_embeds", prompt_embeds_digests[b]))
        out.append(tuple(keys) or None)
    return out if any(e is not None for e in out) else None


def check_extra_keys(extra_keys, num_blocks: int) -> tuple | None:
    """Validate per-block extra keys and return them as tuples all the way down (what the hash needs: pickle
    tells a list from a tuple), or None when no block has any.

    ``extra_keys``: None, or a sequence of exactly ``num_blocks`` entries (a trailing partial block counts), each
    None or a non-empty sequence of keys; a key is a str, bytes, int, None, or a sequence of those (nested at most
    ``MAX_KEY_DEPTH`` deep). At most ``MAX_KEYS_PER_BLOCK`` keys a block, ``MAX_KEY_BYTES`` per str or bytes.

    Raises:
        InputError: saying which block and what is wrong.
    """
    if extra_keys is None:
        return None
    if isinstance(extra_keys, (str, bytes)) or not isinstance(extra_keys, Sequence):
        raise InputError(f"extra_keys must be None or a list with one entry per block, got {type(extra_keys).__name__}")
    if len(extra_keys) != num_blocks:
        raise InputError(f"extra_keys has {len(extra_keys)} entries; need exactly one per block of the tokens "
                         f"({num_blocks}, a trailing partial block included); use None for a block without keys")
    out, any_keys, seen = [], False, {}
    for b, entry in enumerate(extra_keys):
        if entry is None:
            out.append(None)
            continue
        if isinstance(entry, (str, bytes)) or not isinstance(entry, (list, tuple)) or not entry:
            raise InputError(f"extra_keys[{b}] must be None or a non-empty list/tuple of keys, got {entry!r:.80}")
        if len(entry) > MAX_KEYS_PER_BLOCK:
            raise InputError(f"extra_keys[{b}] holds {len(entry)} keys; at most {MAX_KEYS_PER_BLOCK} per block")
        out.append(tuple(_check_key(key, 1, b, seen) for key in entry))
        any_keys = True
    return tuple(out) if any_keys else None


def refreeze_extra_keys(entries) -> tuple:
    """``check_extra_keys``'s form again (tuples, one object per distinct flat key) for keys it accepted, one entry
    per block as given, after msgpack turned tuples into lists and shared keys into copies: pickle-based hashes
    (``sha256``, ``xxhash``) depend on both, so the server's hashing child must hash the very form the request
    thread would. Raises InputError as ``check_extra_keys`` does."""
    seen: dict = {}
    return tuple(None if entry is None else tuple(_check_key(key, 1, b, seen) for key in entry)
                 for b, entry in enumerate(entries))


def _check_key(key, depth: int, block: int, seen: dict):
    kind = type(key)
    if kind in _FLAT:
        return _check_scalar(key, block)
    if kind is not tuple and kind is not list:
        raise InputError(f"extra_keys[{block}]: a key part is a {kind.__name__}; only str, bytes, int, None "
                         "and lists/tuples of them are allowed")
    if len(key) > MAX_KEYS_PER_BLOCK:
        raise InputError(f"extra_keys[{block}]: a key of {len(key)} parts; at most {MAX_KEYS_PER_BLOCK}")
    if all(type(part) in _FLAT for part in key):  # the usual ("lora", name, path): flat, so safe to hash
        frozen = key if kind is tuple else tuple(key)
        hit = seen.get(frozen)
        if hit is None:  # the same key on many blocks (a LoRA) is checked once
            for part in frozen:
                _check_scalar(part, block)
            seen[frozen] = hit = frozen
        return hit
    if depth >= MAX_KEY_DEPTH:
        raise InputError(f"extra_keys[{block}]: keys nested deeper than {MAX_KEY_DEPTH} levels")
    return tuple(_check_key(part, depth + 1, block, seen) for part in key)


def _check_scalar(value, block: int):
    if isinstance(value, (str, bytes)):
        if len(value) > MAX_KEY_BYTES:
            raise InputError(f"extra_keys[{block}]: a str/bytes key part of {len(value)} characters; "
                             f"at most {MAX_KEY_BYTES}")
    elif type(value) is int and not -2**63 <= value < 2**64:
        raise InputError(f"extra_keys[{block}]: int key part {value} does not fit 64 bits")
    return value


def event_extra_keys(entry: tuple | None):
    """One block's extra keys in vLLM's untagged event form (``to_event_extra_keys``): ``key[1]`` for a tagged
    non-multimodal key (the LoRA name, the salt, the embeddings digest), ``(identifier, offset)`` for ``"mm"``;
    a key that is not tagged is published as it is."""
    if entry is None:
        return None
    return tuple((key[1:] if key[0] == "mm" else key[1])
                 if isinstance(key, tuple) and len(key) >= 2 and isinstance(key[0], str) else key
                 for key in entry)


def lora_name_of(entry: tuple | None) -> str | None:
    """The LoRA name in one block's extra keys (its ``("lora", name, path)`` key), or None."""
    for key in entry or ():
        if isinstance(key, tuple) and len(key) >= 2 and key[0] == "lora":
            return key[1]
    return None
