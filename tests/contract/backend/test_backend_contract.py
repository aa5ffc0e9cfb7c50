"""The ``KVBackend`` contract (``kvtier/backend.py``), the same tests for every implementation (``conftest.BACKENDS``):
the in-process ``KVCache`` and the server ``Client`` over shared memory and over frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.server import CHUNK, LAYOUT

from conftest import ADMIN_TOKEN

from kvtier.backend import KVBackend, Retrieved, TierHits
from kvtier.cache import KVCache
from kvtier.errors import InputError

DTYPE = LAYOUT.numpy_dtype()


def prompt(seed: int, num_tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, num_tokens).tolist()


def kv_of(seed: int, num_tokens: int) -> np.ndarray:
    """Distinct, reproducible KV ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` for a prompt."""
    return np.random.default_rng(seed + 1_000_000).standard_normal(LAYOUT.chunk_shape(num_tokens)).astype(DTYPE)


class Recorder:
    """A ``fill`` that copies from ``kv`` and records what it was asked for."""

    def __init__(self, kv: np.ndarray):
        self.kv, self.calls = kv, []

    def __call__(self, start: int, dst: np.ndarray) -> None:
        self.calls.append((start, dst.shape, dst.dtype, dst.flags.writeable))
        dst[...] = self.kv[:, :, start:start + dst.shape[2]]


def read_all(backend, tokens, **kw) -> tuple[Retrieved, list]:
    """Retrieve ``tokens`` and copy every chunk out inside the block: (the Retrieved after the block, copies)."""
    with backend.retrieve_chunks(tokens, **kw) as got:
        assert isinstance(got, Retrieved)
        copies = [(start, view.copy(), view.flags.writeable) for start, view in got.chunks]
        first = copies[0][0] if copies else 0  # 0 unless a ``start`` skipped leading chunks
        assert got.num_tokens == first + sum(chunk.shape[2] for _, chunk, _ in copies)
    assert got.chunks == []  # the views die with the pins
    return got, copies


def test_is_a_kvbackend(backend):
    assert isinstance(backend, KVBackend)
    assert backend.chunk_size == CHUNK


def test_lookup_after_store_counts_whole_chunks(backend):
    tokens = prompt(1, 2 * CHUNK + CHUNK // 2)  # two whole chunks and a partial tail
    assert backend.lookup(tokens) == 0
    assert backend.store_chunks(tokens, Recorder(kv_of(1, len(tokens)))) == 2
    assert backend.lookup(tokens) == 2 * CHUNK  # the partial tail is not stored (save_unfull_chunk off)
    assert backend.lookup(tokens[:CHUNK + 3]) == CHUNK
    assert backend.lookup(tokens[:CHUNK - 1]) == 0
    longer = tokens + prompt(2, 3 * CHUNK)
    assert backend.lookup(longer) == 2 * CHUNK  # the same prefix inside a longer prompt


def test_store_chunks_asks_fill_only_for_missing_chunks(backend):
    tokens = prompt(3, 4 * CHUNK)
    kv = kv_of(3, len(tokens))
    first = Recorder(kv)
    assert backend.store_chunks(tokens[:2 * CHUNK], first) == 2
    assert [c[0] for c in first.calls] == [0, CHUNK]
    shape = LAYOUT.chunk_shape(CHUNK)
    assert all(c[1:] == (shape, DTYPE, True) for c in first.calls)  # whole writable chunks of the layout dtype
    second = Recorder(kv)
    assert backend.store_chunks(tokens, second) == 2
    assert [c[0] for c in second.calls] == [2 * CHUNK, 3 * CHUNK]  # never the chunks already held
    third = Recorder(kv)
    assert backend.store_chunks(tokens, third) == 0 and third.calls == []
    assert backend.lookup(tokens) == 4 * CHUNK


def test_retrieve_chunks_yields_the_stored_bytes_as_read_only_views(backend):
    tokens = prompt(4, 3 * CHUNK + 5)
    kv = kv_of(4, len(tokens))
    backend.store_chunks(tokens, Recorder(kv))
    got, copies = read_all(backend, tokens)
    assert got.ok is True and got.num_tokens == 3 * CHUNK
    assert [start for start, _, _ in copies] == [0, CHUNK, 2 * CHUNK]
    for start, chunk, writeable in copies:
        assert not writeable
        assert chunk.dtype == DTYPE and chunk.shape == LAYOUT.chunk_shape(CHUNK)
        assert chunk.tobytes() == kv[:, :, start:start + CHUNK].tobytes()
    with backend.retrieve_chunks(tokens) as got:
        with pytest.raises(ValueError):
            got.chunks[0][1][...] = 0  # a reader can never write the cache's copy
    got, copies = read_all(backend, tokens)  # and it is unchanged
    assert got.ok and copies[0][1].tobytes() == kv[:, :, :CHUNK].tobytes()


def test_a_prefix_miss(backend):
    tokens = prompt(5, 2 * CHUNK)
    backend.store_chunks(tokens, Recorder(kv_of(5, len(tokens))))
    other_head = prompt(6, CHUNK) + tokens[CHUNK:]  # same second chunk, different first: a miss (prefix hashes)
    for miss in (prompt(7, 2 * CHUNK), other_head, tokens[:CHUNK - 1]):
        assert backend.lookup(miss) == 0
        got, copies = read_all(backend, miss)
        assert (got.num_tokens, copies, got.ok) == (0, [], False)


def test_namespaces_never_mix(backend):
    tokens = prompt(8, 2 * CHUNK)
    assert backend.store_chunks(tokens, Recorder(kv_of(8, len(tokens))), namespace="lora-a") == 2
    assert backend.lookup(tokens, namespace="lora-a") == 2 * CHUNK
    assert backend.lookup(tokens, namespace="lora-b") == 0
    assert backend.lookup(tokens) == 0  # the default namespace is another one
    got, _ = read_all(backend, tokens, namespace="lora-b")
    assert got.num_tokens == 0


def test_a_failing_fill_stores_nothing(backend):
    tokens = prompt(9, 3 * CHUNK)
    kv = kv_of(9, len(tokens))

    def fill(start, dst):
        if start == 2 * CHUNK:
            raise RuntimeError("engine copy failed")
        dst[...] = kv[:, :, start:start + dst.shape[2]]

    with pytest.raises(RuntimeError, match="engine copy failed"):
        backend.store_chunks(tokens, fill)
    assert backend.lookup(tokens) == 0
    assert backend.store_chunks(tokens, Recorder(kv)) == 3  # the aborted slots did not stay reserved


def test_store_and_retrieve_wrap_the_chunk_path(backend):
    tokens = prompt(10, 2 * CHUNK + 1)
    kv = torch.from_numpy(kv_of(10, len(tokens)))
    assert backend.store(tokens, kv) == 2
    _, copies = read_all(backend, tokens)
    assert b"".join(c.tobytes() for _, c, _ in copies) == b"".join(
        kv[:, :, s:s + CHUNK].numpy().tobytes() for s in (0, CHUNK))
    out, n = backend.retrieve(tokens)
    assert n == 2 * CHUNK and torch.equal(out, kv[:, :, :n])
    out, n = backend.retrieve(prompt(11, CHUNK))
    assert n == 0 and tuple(out.shape) == LAYOUT.chunk_shape(0)


def test_flush_and_take_events(backend):
    tokens = prompt(12, 2 * CHUNK)
    backend.store_chunks(tokens, Recorder(kv_of(12, len(tokens))))
    assert backend.flush(timeout_seconds=30.0) is True
    events = backend.take_events()
    assert isinstance(events, list)
    assert backend.take_events() == []  # taken once


def test_prefetch_brings_l2_chunks_into_l1(backend):
    tokens = prompt(23, 2 * CHUNK)
    kv = kv_of(23, len(tokens))
    assert backend.prefetch(tokens, wait=True) == 0  # nothing stored: a miss, not an error
    backend.store_chunks(tokens, Recorder(kv))
    assert backend.flush(timeout_seconds=30.0) is True
    clear_l1(backend)  # now only L2 holds them
    assert backend.prefetch(tokens, wait=True) == 2 * CHUNK
    assert backend.prefetch(tokens + prompt(24, CHUNK)) in (0, 2 * CHUNK)  # no wait: the server client says 0
    got, copies = read_all(backend, tokens)
    assert got.ok and got.num_tokens == 2 * CHUNK
    assert all(np.array_equal(chunk, kv[:, :, start:start + CHUNK]) for start, chunk, _ in copies)
    with pytest.raises(InputError):
        backend.prefetch([-1])


@pytest.mark.parametrize("bad", [[1.5, 2.0], [[1, 2]], [-1], "text"])
def test_bad_tokens_raise_input_error(backend, bad):
    with pytest.raises(InputError):
        backend.lookup(bad)
    with pytest.raises(InputError):
        backend.store_chunks(bad, Recorder(kv_of(0, 1)))
    with pytest.raises(InputError):
        with backend.retrieve_chunks(bad):
            pass


def clear_l1(backend) -> None:
    """Drop L1 only (kvtier admin operation; the server's needs its admin token)."""
    if isinstance(backend, KVCache):
        backend.clear("CPU")
    else:
        backend.clear("CPU", admin_token=ADMIN_TOKEN)


def test_lookup_tiers_splits_l1_and_l2(backend):
    tokens = prompt(13, 2 * CHUNK + 7)
    assert backend.lookup_tiers(tokens) == TierHits(0, 0)
    backend.store_chunks(tokens, Recorder(kv_of(13, len(tokens))))
    assert backend.lookup_tiers(tokens) == TierHits(2 * CHUNK, 2 * CHUNK)  # just stored: in L1
    assert backend.flush(timeout_seconds=30.0) is True
    clear_l1(backend)
    assert backend.lookup_tiers(tokens) == TierHits(2 * CHUNK, 0)  # now only L2 holds them
    assert backend.lookup(tokens) == 2 * CHUNK
    got, _ = read_all(backend, tokens[:CHUNK + 1])  # retrieving promotes the first chunk into L1
    assert got.ok and got.num_tokens == CHUNK
    assert backend.lookup_tiers(tokens) == TierHits(2 * CHUNK, CHUNK)


def test_retrieve_chunks_within_a_timeout(backend):
    tokens = prompt(14, CHUNK)
    backend.store_chunks(tokens, Recorder(kv_of(14, len(tokens))))
    got, copies = read_all(backend, tokens, timeout_seconds=30.0)
    assert got.ok and got.num_tokens == CHUNK and len(copies) == 1


def test_start_stores_looks_up_and_retrieves_only_the_chunks_from_there(backend):
    """A sliding-window group keeps only its window: chunks before ``start`` are hashed, never stored or read."""
    tokens = prompt(21, 4 * CHUNK)
    kv = kv_of(21, len(tokens))
    fill = Recorder(kv)
    assert backend.store_chunks(tokens, fill, start=2 * CHUNK + 1) == 2
    assert [c[0] for c in fill.calls] == [2 * CHUNK, 3 * CHUNK]  # start inside chunk 2: from chunk 2 on
    assert backend.lookup(tokens) == 0  # chunk 0 is not held: a plain lookup finds nothing
    assert backend.lookup(tokens, start=2 * CHUNK) == 4 * CHUNK  # the end of the run, in absolute tokens
    assert backend.lookup_tiers(tokens, start=CHUNK) == TierHits(0, 0)  # the run must begin at start's chunk
    assert backend.lookup(tokens[:3 * CHUNK], start=2 * CHUNK) == 3 * CHUNK
    got, copies = read_all(backend, tokens, start=2 * CHUNK)
    assert got.ok and got.num_tokens == 4 * CHUNK and [s for s, _, _ in copies] == [2 * CHUNK, 3 * CHUNK]
    for s, chunk, _ in copies:
        np.testing.assert_array_equal(chunk, kv[:, :, s:s + CHUNK])
    # keys are prefix hashes: the same chunk positions of another prompt are other chunks
    assert backend.lookup(prompt(22, 4 * CHUNK), start=2 * CHUNK) == 0
    with pytest.raises(InputError, match="start"):
        backend.lookup(tokens, start=-1)


def test_start_reads_l2_only_chunks_back_into_l1(backend):
    tokens = prompt(23, 3 * CHUNK)
    kv = kv_of(23, len(tokens))
    assert backend.store_chunks(tokens, Recorder(kv), start=CHUNK) == 2
    assert backend.flush(timeout_seconds=30.0) is True
    clear_l1(backend)
    assert backend.lookup_tiers(tokens, start=CHUNK) == TierHits(3 * CHUNK, 0)  # only L2 holds them
    got, copies = read_all(backend, tokens, start=CHUNK)
    assert got.ok and got.num_tokens == 3 * CHUNK and [s for s, _, _ in copies] == [CHUNK, 2 * CHUNK]
    np.testing.assert_array_equal(copies[1][1], kv[:, :, 2 * CHUNK:])
    assert backend.lookup_tiers(tokens, start=CHUNK) == TierHits(3 * CHUNK, 3 * CHUNK)  # promoted into L1
