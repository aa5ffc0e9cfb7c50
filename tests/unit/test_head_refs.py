"""PromptKeys.head_refs: a prompt not in the memo is resolved by its first chunk alone, nothing memoised."""

import numpy as np
import pytest

from kvtier.cache.memo import LookupMemo
from kvtier.cache.prompt_keys import PromptKeys
from kvtier.config import KVTierConfig
from kvtier.errors import InputError
from kvtier.keys import segment_namespace


def keys(**config) -> PromptKeys:
    return PromptKeys(KVTierConfig(chunk_size=64, block_size=16, **config), "m", "layout", "default",
                      LookupMemo(1 << 20))


def test_a_new_prompt_gives_its_first_chunk_ref_alone_equal_to_the_full_refs_first():
    pk = keys()
    tokens = np.arange(1, 64 * 4 + 1)
    _, head, whole = pk.head_refs(tokens)
    assert len(head) == 1 and not whole
    assert not pk.memoised(tokens)  # nothing memoised: the rest was never hashed
    _, refs = pk.chunk_refs(tokens)
    assert len(refs) == 4
    assert (head[0].key, head[0].start, head[0].end) == (refs[0].key, refs[0].start, refs[0].end)


def test_a_memoised_prompt_gives_every_ref():
    pk = keys()
    tokens = np.arange(1, 64 * 3 + 1)
    _, refs = pk.chunk_refs(tokens)
    _, head, whole = pk.head_refs(tokens)
    assert whole and head is refs


def test_one_chunk_is_whole_and_a_segment_keeps_its_partial_tail():
    pk = keys()
    assert pk.head_refs(np.arange(1, 65))[2]  # the first chunk is every chunk
    _, head, whole = pk.head_refs(np.arange(1, 40))  # shorter than a chunk, no save_unfull_chunk
    assert head == [] and whole
    ns = segment_namespace("doc")
    tokens = np.arange(1, 100)
    _, head, whole = pk.head_refs(tokens, ns)
    _, refs = pk.chunk_refs(tokens, ns)
    assert not whole and head[0].key == refs[0].key and refs[-1].end == 99


def test_bad_tokens_past_the_first_chunk_are_refused():
    pk = keys()
    tokens = np.arange(1, 64 * 2 + 1)
    tokens[100] = -3
    with pytest.raises(InputError, match="non-negative"):
        pk.head_refs(tokens)
