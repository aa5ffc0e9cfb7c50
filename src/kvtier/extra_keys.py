"""Per-block extra keys: what besides the tokens enters a block's hash, in vLLM 0.32's tagged form
(``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``).

``("lora", name, path)`` on every block of a LoRA request, ``("mm", identifier, offset_in_block)`` for each
multimodal item overlapping the block, ``("cache_salt", salt)`` on block 0, ``("prompt_embeds", digest)``; a
block's entry is the tuple of those (in that order) or None. They enter the block hash
(``hashing.prefix_hashes``), so kvtier's digests equal vLLM's for LoRA, salted and multimodal requests.
``block_extra_keys`` builds them without vLLM; ``check_extra_keys`` validates what a caller or a client sent
(``refreeze_extra_keys`` again after msgpack); ``event_extra_keys`` gives vLLM's untagged event form
(reference events-and-hashing.md §2.3); ``lora_name_of`` reads the LoRA name back.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import InputError

MAX_KEYS_PER_BLOCK = 256  # extra keys in one block's entry
MAX_KEY_DEPTH = 3  # a key, and sequences nested in it (entry -> ("mm", id, offset) is depth 1)
MAX_KEY_BYTES = 4096  # one str or bytes inside a key
_FLAT = frozenset({str, bytes, int, type(None)})  # exact types: a bool is no key part


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
