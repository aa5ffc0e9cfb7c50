"""PromptKeys.known_refs: a prompt not in the memo is resolved by its first chunk alone, nothing memoised; a
memoised prefix is never hashed again (issue 38 finding 7: hash once)."""

import numpy as np
import pytest

from kvtier.cache.memo import LookupMemo
from kvtier.cache.prompt_keys import PromptKeys
from kvtier.config import KVTierConfig
from kvtier.errors import InputError
from kvtier.hashing import prefix_hashes
from kvtier.keys import segment_namespace


def keys(**config) -> PromptKeys:
    return PromptKeys(KVTierConfig(chunk_size=64, block_size=16, **config), "m", "layout", "default",
                      LookupMemo(1 << 20))


def test_a_new_prompt_gives_its_first_chunk_ref_alone_equal_to_the_full_refs_first():
    pk = keys()
    tokens = np.arange(1, 64 * 4 + 1)
    _, head, whole = pk.known_refs(tokens)
    assert len(head) == 1 and not whole
    assert pk.unhashed_tokens(tokens) == 64 * 4  # nothing memoised: the rest was never hashed
    _, refs = pk.chunk_refs(tokens)
    assert len(refs) == 4
    assert (head[0].key, head[0].start, head[0].end) == (refs[0].key, refs[0].start, refs[0].end)


def test_a_memoised_prompt_gives_every_ref():
    pk = keys()
    tokens = np.arange(1, 64 * 3 + 1)
    _, refs = pk.chunk_refs(tokens)
    _, head, whole = pk.known_refs(tokens)
    assert whole and [r.key for r in head] == [r.key for r in refs]
    assert pk.unhashed_tokens(tokens) == 0


def test_one_chunk_is_whole_and_a_segment_keeps_its_partial_tail():
    pk = keys()
    assert pk.known_refs(np.arange(1, 65))[2]  # the first chunk is every chunk
    _, head, whole = pk.known_refs(np.arange(1, 40))  # shorter than a chunk, no save_unfull_chunk
    assert head == [] and whole
    ns = segment_namespace("doc")
    tokens = np.arange(1, 100)
    _, head, whole = pk.known_refs(tokens, ns)
    _, refs = pk.chunk_refs(tokens, ns)
    assert not whole and head[0].key == refs[0].key and refs[-1].end == 99


def test_bad_tokens_past_the_first_chunk_are_refused():
    pk = keys()
    tokens = np.arange(1, 64 * 2 + 1)
    tokens[100] = -3
    with pytest.raises(InputError, match="non-negative"):
        pk.known_refs(tokens)
    good = np.arange(1, 64 * 2 + 1)
    pk.chunk_refs(good)
    longer = np.concatenate([good, np.arange(64) - 5])  # a memoised prefix, then bad ids: still refused
    with pytest.raises(InputError, match="non-negative"):
        pk.chunk_refs(longer)


class Counting:
    """``prefix_hashes`` that counts the tokens it hashes."""

    def __init__(self):
        self.tokens = 0

    def __call__(self, tokens, *args, **kwargs):
        self.tokens += len(tokens)
        return prefix_hashes(tokens, *args, **kwargs)


@pytest.mark.parametrize("save_unfull_chunk", [False, True])
def test_a_prompt_extended_or_cut_is_hashed_once_and_keyed_as_if_hashed_whole(save_unfull_chunk):
    """vLLM's connector asks about one prompt at several lengths (lookup, prefetch, load, each chunked-prefill
    store): the memo finds the longest whole-chunk prefix and only the rest is hashed, chained from it."""
    pk, fresh, hasher = keys(save_unfull_chunk=save_unfull_chunk), keys(save_unfull_chunk=save_unfull_chunk), Counting()
    prompt = np.arange(1, 64 * 40 + 30)  # 40 chunks and a partial one; fingerprints every 256 tokens (4 chunks)
    for end in (64 * 8, 64 * 16, 64 * 24, 64 * 32, len(prompt), 64 * 5, 64 * 8 + 7, 64 * 40):
        _, refs = pk.chunk_refs(prompt[:end], hasher=hasher)
        _, want = fresh.chunk_refs(prompt[:end])
        assert [(r.key, r.start, r.end) for r in refs] == [(r.key, r.start, r.end) for r in want]
        assert all(r.blocks.digests[:-(-r.end // 16)] == w.blocks.digests[:-(-w.end // 16)] for r, w in zip(refs, want))
    # each stored prefix extends the last; a cut between fingerprints (5 chunks) hashes from the one before (4
    # chunks); the partial tail (save_unfull_chunk) is hashed per length that has one
    tails = (29 + 7) if save_unfull_chunk else 0
    assert hasher.tokens == 64 * 40 + 64 + tails
    other = np.concatenate([prompt[:64 * 8], np.arange(10**6, 10**6 + 64 * 8)])  # a shared prefix, then others
    hasher.tokens = 0
    _, refs = pk.chunk_refs(other, hasher=hasher)
    assert hasher.tokens == 64 * 8 and [r.key for r in refs] == [r.key for r in fresh.chunk_refs(other)[1]]


def test_extra_keys_and_namespaces_keep_prompts_apart():
    pk, hasher = keys(), Counting()
    tokens = np.arange(1, 64 * 4 + 1)
    _, plain = pk.chunk_refs(tokens, hasher=hasher)
    image = tuple([None] * 8 + [(("mm", "img-1"),)] + [None] * 7)  # block 8 carries an image hash
    _, with_image = pk.chunk_refs(tokens, extra_keys=image, hasher=hasher)
    assert [r.key for r in with_image[:2]] == [r.key for r in plain[:2]] and with_image[2].key != plain[2].key
    _, again = pk.chunk_refs(tokens, hasher=hasher)
    assert [r.key for r in again] == [r.key for r in plain]
    _, other_ns = pk.chunk_refs(tokens, "another", hasher=hasher)
    assert all(a.key != b.key for a, b in zip(other_ns, plain))
