"""The ``KVBackend`` contract for prompts named by page keys (``kvtier.pages.PageChain``, SGLang's HiCache keys), the
same tests for every implementation (``conftest.BACKENDS``): each page is one chunk keyed by its digest, nothing is
hashed again, answers count pages times the page size, and L2 records of pages are read back verified."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from support.server import LAYOUT

from conftest import ADMIN_TOKEN

from kvtier.client import Client
from kvtier.errors import InputError
from kvtier.pages import PageChain

DTYPE = LAYOUT.numpy_dtype()
PAGE = 8  # tokens per page: not the chunk size, so a page's bytes come from the page size


def chain(seed: str, num_pages: int, page_size: int = PAGE, start: int = 0) -> PageChain:
    """Pages ``start .. start + num_pages - 1`` of a SHA-256 chain over ``seed`` (SGLang's keys have this form)."""
    digests, prev = [], b""
    for i in range(start + num_pages):
        prev = hashlib.sha256(prev + f"{seed}/{i}".encode()).digest()
        digests.append(prev)
    return PageChain(tuple(digests[start:]), page_size, digests[start - 1] if start else None)


def page_kv(seed: int, num_tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.chunk_shape(num_tokens)).astype(DTYPE)


def store(backend, pages: PageChain, kv: np.ndarray) -> tuple[int, list[int]]:
    starts = []

    def fill(start, dst):
        assert dst.shape == LAYOUT.chunk_shape(pages.page_size) and dst.flags.writeable
        starts.append(start)
        dst[...] = kv[:, :, start:start + pages.page_size]

    return backend.store_chunks(pages, fill), starts


def read(backend, pages: PageChain) -> tuple[int, dict[int, np.ndarray]]:
    with backend.retrieve_chunks(pages) as got:
        copies = {start: view.copy() for start, view in got.chunks}
    assert got.ok == bool(got.num_tokens)
    return got.num_tokens, copies


def test_pages_store_look_up_and_read_back_bit_exact(backend):
    pages = chain("a", 5)
    kv = page_kv(1, pages.num_tokens)
    assert backend.lookup(pages) == 0
    stored, starts = store(backend, pages, kv)
    assert stored == 5 and starts == [i * PAGE for i in range(5)]
    assert backend.lookup(pages) == 5 * PAGE
    num_tokens, copies = read(backend, pages)
    assert num_tokens == 5 * PAGE and sorted(copies) == starts
    for start, chunk in copies.items():
        assert chunk.tobytes() == kv[:, :, start:start + PAGE].tobytes()
    assert store(backend, pages, kv)[0] == 0  # held already: fill is not asked again


def test_a_missing_page_ends_the_prefix(backend):
    pages = chain("b", 6)
    head = PageChain(pages.hashes[:2], PAGE)
    assert store(backend, head, page_kv(2, head.num_tokens))[0] == 2
    assert backend.lookup(pages) == 2 * PAGE
    assert read(backend, pages)[0] == 2 * PAGE
    # pages past a gap are never counted, even when held
    tail = PageChain(pages.hashes[3:], PAGE, pages.hashes[2])
    assert store(backend, tail, page_kv(3, tail.num_tokens))[0] == 3
    assert backend.lookup(pages) == 2 * PAGE and backend.lookup(tail) == 3 * PAGE


def test_the_page_size_and_the_namespace_are_part_of_the_key(backend):
    pages = chain("c", 3)
    assert store(backend, pages, page_kv(4, pages.num_tokens))[0] == 3
    assert backend.lookup(PageChain(pages.hashes, 2 * PAGE)) == 0  # same digests, another page size
    assert backend.lookup(pages, namespace="other") == 0
    assert backend.lookup(pages) == 3 * PAGE


def test_pages_never_meet_token_prompts(backend):
    tokens = list(range(1, 2 * PAGE + 1))
    assert backend.store_chunks(tokens, lambda start, dst: dst.fill(0)) >= 1
    assert backend.lookup(chain("d", 2)) == 0


def test_l2_pages_are_read_back_into_l1_verified(backend):
    pages = chain("e", 4)
    kv = page_kv(5, pages.num_tokens)
    assert store(backend, pages, kv)[0] == 4
    assert backend.flush(60)
    backend.clear("CPU", **({"admin_token": ADMIN_TOKEN} if isinstance(backend, Client) else {}))
    assert backend.lookup_tiers(pages) == (4 * PAGE, 0)  # in L2 only
    num_tokens, copies = read(backend, pages)
    assert num_tokens == 4 * PAGE
    assert b"".join(copies[s].tobytes() for s in sorted(copies)) == b"".join(
        kv[:, :, s:s + PAGE].tobytes() for s in range(0, 4 * PAGE, PAGE))
    assert backend.lookup_tiers(pages) == (4 * PAGE, 4 * PAGE)


@pytest.mark.parametrize("bad", [{"extra_keys": [None]}])
def test_a_chain_takes_no_extra_keys(backend, bad):
    with pytest.raises(InputError):
        backend.lookup(chain("f", 1), **bad)


def test_a_bad_chain_is_refused_when_made():
    with pytest.raises(InputError, match="1-64 bytes"):
        PageChain((b"",), PAGE)
    with pytest.raises(InputError, match="page_size"):
        PageChain((b"x" * 32,), 0)
    with pytest.raises(InputError, match="hex"):
        PageChain.from_hex(["zz"], PAGE)

