"""EventEmitter: vLLM-equal block hashes (reference events-and-hashing.md §2.4), per-copy announcements,
removals counted per (medium, block hash), LoRA / salt / multimodal identity in the events."""

import numpy as np
import pytest

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.events import AllBlocksCleared, BlockIndex, BlockRemoved, BlockStored, EventBatch, EventEmitter
from kvtier.extra_keys import block_extra_keys
from kvtier.hashing import event_id, prefix_hashes
from kvtier.keys import namespace_of
from kvtier.layout import KVLayout

H0, H1 = 2164874634404590027, 17270480062156288726  # vLLM's own sha256_cbor block hashes, seed "0", §2.4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)


class Setup:
    """An emitter and a cache whose ``chunk_refs`` give it real refs (the cache itself announces nothing)."""

    def __init__(self, chunk_size=8, block_size=None, **extra):
        self.config = build_config({"chunk_size": chunk_size, "block_size": block_size, "hash_seed": "0",
                                    "hash_algorithm": "sha256_cbor", "l1_size_gb": "1MiB", **extra})
        self.em = EventEmitter(self.config)
        self.caches = {}

    def refs(self, tokens, namespace="", model="m", extra_keys=None):
        cache = self.caches.get(model) or self.caches.setdefault(model, KVCache(self.config, model, LAYOUT))
        return cache.chunk_refs(tokens, namespace, extra_keys=extra_keys)[1]

    def stored(self, tokens, first, count, medium="CPU", **kw):
        return self.em.stored(np.asarray(tokens), self.refs(tokens, **kw)[first:first + count], medium)

    def names(self, tokens, first, count, **kw):
        return [r.key.name() for r in self.refs(tokens, **kw)[first:first + count]]


def ids_of(tokens, block_size, **kw):
    return [event_id(d) for d in prefix_hashes(tokens, block_size, "sha256_cbor", "0", **kw)]


def test_published_hashes_equal_vllm_block_hashes_section_2_4():
    s = Setup(chunk_size=8, block_size=4)
    assert s.stored(list(range(1, 9)), 0, 1) == 1
    [ev] = s.em.take_events()
    assert ev == BlockStored([H0, H1], None, list(range(1, 9)), 4, None, "CPU", None, extra_keys=[None, None])


def test_parent_chains_across_calls_and_blocks_inside_chunks():
    tokens = list(range(100, 124))
    expected = ids_of(tokens, 2)
    s = Setup(chunk_size=8, block_size=2)
    s.stored(tokens[:8], 0, 1)
    s.stored(tokens, 1, 2, "STORAGE")
    a, b = s.em.take_events()
    assert a.block_hashes + b.block_hashes == expected
    assert a.parent_block_hash is None and b.parent_block_hash == expected[3]
    assert b.token_ids == tokens[8:] and b.medium == "STORAGE" and b.block_size == 2


def test_same_copy_announced_once_per_medium_and_removed_once():
    s = Setup(chunk_size=4)
    tokens = list(range(1, 9))
    assert s.stored(tokens, 0, 2) == 2
    assert s.stored(tokens, 0, 2) == 0  # this copy is already held in CPU
    assert s.stored(tokens, 0, 2, "STORAGE") == 2  # another medium is another announcement
    events = s.em.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [("BlockStored", "CPU"), ("BlockStored", "STORAGE")]
    assert s.em.removed(s.names(tokens, 1, 1), "CPU") == 1
    [removed] = s.em.take_events()
    assert removed == BlockRemoved([H1], "CPU")
    index = BlockIndex()
    index.apply(EventBatch(0.0, events + [removed], 0))
    assert index.contains(H0, "CPU") and not index.contains(H1, "CPU") and index.contains(H1, "STORAGE")
    assert s.stored(tokens, 0, 2) == 1  # announced again once stored again
    [again] = s.em.take_events()
    assert again.block_hashes == [H1] and again.parent_block_hash == H0


@pytest.mark.parametrize("other", [{"namespace": namespace_of(cache_salt="t")}, {"model": "other-weights@2"}],
                         ids=["namespace", "model"])
def test_every_copy_is_announced_and_a_hash_is_removed_with_its_last_copy(other):
    s = Setup(chunk_size=4)
    tokens = list(range(1, 9))
    assert s.stored(tokens, 0, 2) == 2
    assert s.stored(tokens, 0, 2, **other) == 2  # same block hashes, another full key: a copy of its own
    first, second = s.em.take_events()
    assert first.block_hashes == second.block_hashes == [H0, H1]
    assert s.em.num_known_chunks("CPU") == 4
    assert s.em.removed(s.names(tokens, 0, 2), "CPU") == 0  # the other copy still holds H0 and H1
    assert s.em.take_events() == []
    assert s.em.removed(s.names(tokens, 1, 1, **other), "CPU") == 1
    assert s.em.take_events() == [BlockRemoved([H1], "CPU")]


def test_a_partial_chunk_and_a_full_chunk_sharing_a_block():
    s = Setup(chunk_size=8, block_size=4, save_unfull_chunk=True)
    short, full = list(range(1, 13)), list(range(1, 17))  # short's partial chunk = block 2, full's chunk 1 = blocks 2-3
    s.stored(short, 1, 1)
    s.stored(full, 1, 1)
    a, b = s.em.take_events()
    blocks = ids_of(full, 4)
    assert a.block_hashes == [blocks[2]] and b.block_hashes == blocks[2:]
    s.em.removed(s.names(short, 1, 1), "CPU")
    assert s.em.take_events() == []  # block 2 is still held by the full chunk


def test_removing_an_unknown_chunk_publishes_its_hash_unless_held():
    s = Setup(chunk_size=4)
    tokens = list(range(1, 9))
    s.stored(tokens, 0, 1)
    s.em.take_events()
    stranger = s.names(list(range(50, 54)), 0, 1)  # never announced (e.g. found in L2 after a restart)
    assert s.em.removed(stranger, "CPU") == 1
    assert s.em.take_events() == [BlockRemoved(ids_of(range(50, 54), 4), "CPU")]
    held_elsewhere = s.names(tokens, 0, 1, model="never-announced")  # H0, but H0 is held by the announced copy
    assert s.em.removed(held_elsewhere, "CPU") == 0 and s.em.take_events() == []


def test_middle_chunk_already_known_splits_into_runs_with_correct_parents():
    s = Setup(chunk_size=4)
    tokens = list(range(1, 17))
    s.stored(tokens[:12], 1, 2)
    s.em.take_events()
    s.stored(tokens, 0, 4)  # chunks 0 and 3 are new, 1-2 known
    a, b = s.em.take_events()
    ids = ids_of(tokens, 4)
    assert a.block_hashes == [ids[0]] and a.parent_block_hash is None
    assert b.block_hashes == [ids[3]] and b.parent_block_hash == ids[2] and b.token_ids == tokens[12:]


def test_clearing_one_medium_removes_only_its_blocks_and_clearing_all_is_one_event():
    s = Setup(chunk_size=4)
    tokens = list(range(1, 9))
    s.stored(tokens, 0, 2)
    s.stored(tokens, 0, 2, "STORAGE")
    s.stored(tokens, 0, 2, "STORAGE", namespace=namespace_of(cache_salt="x"))  # a second copy: named once
    s.em.take_events()
    s.em.cleared("STORAGE")
    assert s.em.take_events() == [BlockRemoved([H0, H1], "STORAGE")]
    assert s.em.num_known_chunks("CPU") == 2 and s.em.num_known_chunks("STORAGE") == 0
    s.em.cleared("STORAGE")  # nothing left there: no event
    assert s.em.take_events() == []
    s.em.cleared()
    assert s.em.take_events() == [AllBlocksCleared()]
    assert s.em.num_known_chunks("CPU") == 0


def test_bytes_hash_format_publishes_full_digests():
    s = Setup(chunk_size=4, kv_events={"hash_format": "bytes"})
    tokens = list(range(1, 9))
    s.stored(tokens, 0, 2)
    [ev] = s.em.take_events()
    assert ev.block_hashes == prefix_hashes(tokens, 4, "sha256_cbor", "0") and len(ev.block_hashes[0]) == 32


def test_partial_chunk_with_save_unfull_chunk_is_its_own_short_block():
    s = Setup(chunk_size=8, block_size=4, save_unfull_chunk=True)
    tokens = list(range(1, 15))  # one full chunk + 6 tokens
    s.stored(tokens, 0, 2)
    full, partial = s.em.take_events()
    every = ids_of(tokens, 4, include_partial=True)
    assert full.block_hashes == every[:3] and full.block_size == 4 and full.token_ids == tokens[:12]
    assert partial.block_hashes == every[3:] and partial.block_size == 2
    assert partial.parent_block_hash == every[2] and partial.token_ids == tokens[12:]


def test_lora_salt_and_multimodal_identity_in_the_event():
    """lora_name is set; extra_keys are vLLM's untagged event form (§2.3); hashes include the tagged keys."""
    s = Setup(chunk_size=8, block_size=4)
    tokens = list(range(1, 9))
    extra = block_extra_keys(8, 4, lora=("sql", "/adapters/sql"), cache_salt="s1", mm_items=[("img-hash", 2, 4)])
    s.stored(tokens, 0, 1, extra_keys=extra, namespace=namespace_of("sql@x", "s1"))
    [ev] = s.em.take_events()
    assert ev.lora_name == "sql"
    assert ev.extra_keys == [("sql", ("img-hash", 2), "s1"), ("sql", ("img-hash", -2))]
    assert ev.block_hashes == ids_of(tokens, 4, extra_keys=extra) != ids_of(tokens, 4)


class Recorder:
    """A publisher that records what each stream is given (``EventPublisher.publish``'s signature)."""

    def __init__(self):
        self.calls = []

    def publish(self, events, tenant=None, *, operator=True):
        self.calls.append((tenant, operator, list(events)))
        return len(events)

    def stream(self, tenant):
        return [e for t, op, evs in self.calls if t == tenant or (tenant is None and op) for e in evs]


def test_a_tenants_copies_reach_its_stream_and_its_removals_wait_for_its_last_copy():
    from kvtier.keys import tenant_namespace

    s = Setup(chunk_size=8, block_size=8)
    rec = Recorder()
    s.em.publisher = rec
    tokens = list(range(16))
    ns_a, ns_b = tenant_namespace("team-a", ""), tenant_namespace("team-b", "")
    s.stored(tokens, 0, 2, namespace=ns_a)
    s.stored(tokens, 0, 2, namespace=ns_b)  # the same prompt: the same block hashes, another tenant's copies
    a = [e for e in rec.stream("team-a") if isinstance(e, BlockStored)]
    assert [t for e in a for t in e.token_ids] == tokens and len(rec.stream("team-b")) == len(a)
    assert len([e for e in rec.stream(None) if isinstance(e, BlockStored)]) == 2 * len(a)
    rec.calls.clear()
    s.em.removed(s.names(tokens, 0, 2, namespace=ns_a), "CPU")
    # team-a holds no copy any more; the operator stream still has team-b's copies of the same hashes
    removed_a = [h for e in rec.stream("team-a") for h in e.block_hashes]
    assert removed_a == ids_of(tokens, 8) and rec.stream("team-b") == [] and rec.stream(None) == []
    s.em.cleared()
    assert rec.calls[-1][0] == "*" and isinstance(rec.calls[-1][2][0], AllBlocksCleared)


def test_token_ids_can_be_left_out_of_block_stored():
    s = Setup(chunk_size=8, block_size=4, kv_events={"include_token_ids": False})
    s.stored(list(range(16)), 0, 2)
    stored = [e for e in s.em.take_events() if isinstance(e, BlockStored)]
    assert stored and all(e.token_ids == [] for e in stored)
    assert [h for e in stored for h in e.block_hashes] == ids_of(list(range(16)), 4)
