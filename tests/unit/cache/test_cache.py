"""KVCache over L1 + local disk: prefix semantics, exact bytes, bad input, drops, recovery."""

import subprocess
import sys
import textwrap

import pytest
import torch

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.errors import ConfigError, InputError, KVTierError
from kvtier.hints import RetentionHint
from kvtier.layout import KVLayout
from kvtier.tensors import as_numpy, copy_from

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8)
CHUNK = 16


def make_cache(tmp_path, disk=True, **overrides):
    spec = [{"type": "local_disk", "path": str(tmp_path / "disk")}] if disk else []
    cfg = build_config({"chunk_size": CHUNK, "l1_size_gb": "64MiB", "l2_adapters": spec, **overrides})
    return KVCache(cfg, "test-model", LAYOUT)


def kv_for(tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=gen)


def test_store_lookup_retrieve_exact(tmp_path):
    cache = make_cache(tmp_path)
    tokens = list(range(100, 164))  # 4 full chunks
    kv = kv_for(tokens)
    assert cache.lookup(tokens) == 0
    assert cache.store(tokens, kv) == 4
    assert cache.lookup(tokens) == 64
    out, n = cache.retrieve(tokens)
    assert n == 64 and torch.equal(out, kv)
    # a longer prompt sharing the prefix hits the prefix only
    longer = tokens + [1, 2, 3] * 10
    assert cache.lookup(longer) == 64
    out, n = cache.retrieve(longer)
    assert n == 64 and torch.equal(out, kv)
    # a different first token changes every prefix hash
    assert cache.lookup([99] + tokens[1:]) == 0
    cache.close()


@pytest.mark.parametrize("length", [5, 15, 17, 40])
def test_partial_chunks_cover_full_chunks_only(tmp_path, length):
    cache = make_cache(tmp_path)
    tokens = list(range(length))
    kv = kv_for(tokens)
    cache.store(tokens, kv)
    full = (length // CHUNK) * CHUNK
    assert cache.lookup(tokens) == full
    out, n = cache.retrieve(tokens)
    assert n == full and torch.equal(out, kv[:, :, :full])
    cache.close()


def test_save_unfull_chunk_stores_the_tail(tmp_path):
    cache = make_cache(tmp_path, save_unfull_chunk=True)
    tokens = list(range(40))
    kv = kv_for(tokens)
    cache.store(tokens, kv)
    assert cache.lookup(tokens) == 40
    out, n = cache.retrieve(tokens)
    assert n == 40 and torch.equal(out, kv)
    # extending the prompt does not extend the stored tail in place
    assert cache.lookup(tokens + [7]) == 32
    cache.close()


def test_storing_twice_leaves_usage_unchanged(tmp_path):
    cache = make_cache(tmp_path)
    tokens = list(range(48))
    kv = kv_for(tokens)
    assert cache.store(tokens, kv) == 3
    cache.flush()
    l1_used, l2_used = cache.l1.used_bytes, cache.l2.adapters[0].usage().used_bytes
    files = sorted(p.name for p in (tmp_path / "disk").rglob("*") if p.is_file())
    assert cache.store(tokens, kv) == 0
    cache.flush()
    assert cache.l1.used_bytes == l1_used
    assert cache.l2.adapters[0].usage().used_bytes == l2_used
    assert sorted(p.name for p in (tmp_path / "disk").rglob("*") if p.is_file()) == files
    cache.close()


def test_l2_hit_is_promoted_and_exact(tmp_path):
    cache = make_cache(tmp_path)
    tokens = list(range(64))
    kv = kv_for(tokens, seed=3)
    cache.store(tokens, kv)
    cache.flush()
    cache.clear("CPU")
    assert cache.l1.num_chunks == 0
    assert cache.lookup(tokens) == 64
    out, n = cache.retrieve(tokens)
    assert n == 64 and torch.equal(out, kv)
    assert cache.l1.num_chunks == 4
    assert cache.metrics.value("kvtier_l2_promoted_chunks_total") == 4
    cache.close()


def test_file_deleted_by_hand_is_a_miss(tmp_path):
    cache = make_cache(tmp_path)
    tokens = list(range(64))
    kv = kv_for(tokens)
    cache.store(tokens, kv)
    cache.flush()
    cache.clear("CPU")
    files = sorted(p for p in (tmp_path / "disk").rglob("*") if p.is_file())
    assert len(files) == 4
    victim = next(f for f in files if cache.chunk_refs(tokens)[1][2].key.name() in f.name)
    victim.unlink()
    out, n = cache.retrieve(tokens)  # chunks 0 and 1 only: prefix semantics stop at the hole
    assert n == 32 and torch.equal(out, kv[:, :, :32])
    cache.close()


def test_corrupt_file_is_a_counted_miss_and_deleted(tmp_path):
    cache = make_cache(tmp_path)
    tokens = list(range(32))
    kv = kv_for(tokens)
    cache.store(tokens, kv)
    cache.flush()
    cache.clear("CPU")
    name = cache.chunk_refs(tokens)[1][0].key.name()
    path = next(p for p in (tmp_path / "disk").rglob("*") if p.is_file() and name in p.name)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    out, n = cache.retrieve(tokens)
    assert n == 0 and out.shape[2] == 0
    assert not path.exists()
    assert sum(cache.metrics.samples("kvtier_corrupt_records_total").values()) == 1
    cache.close()


def test_new_process_hits_what_the_first_stored(tmp_path):
    cache = make_cache(tmp_path)
    tokens = list(range(48))
    kv = kv_for(tokens, seed=7)
    cache.store(tokens, kv)
    cache.close()
    script = textwrap.dedent(f"""
        import torch
        from kvtier.cache import KVCache
        from kvtier.config import build_config
        from kvtier.layout import KVLayout
        cfg = build_config({{"chunk_size": {CHUNK}, "l1_size_gb": "64MiB",
                             "l2_adapters": [{{"type": "local_disk", "path": {str(tmp_path / 'disk')!r}}}]}})
        cache = KVCache(cfg, "test-model", KVLayout(2, 2, 8))
        tokens = list(range(48))
        assert cache.lookup(tokens) == 48, cache.lookup(tokens)
        out, n = cache.retrieve(tokens)
        expected = torch.randn((2, 2, 48, 2, 8), generator=torch.Generator().manual_seed(7))
        assert n == 48 and torch.equal(out, expected)
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_full_write_queue_drops_and_counts_without_blocking(tmp_path):
    cache = make_cache(tmp_path, l2_write_queue_size=0)
    tokens = list(range(64))
    assert cache.store(tokens, kv_for(tokens)) == 4
    assert cache.metrics.value("kvtier_l2_write_dropped_total") == 4
    assert cache.l2.adapters[0].usage().num_records == 0
    assert cache.lookup(tokens) == 64  # L1 still serves it
    cache.close()


def test_bf16_round_trip(tmp_path):
    layout = KVLayout(2, 2, 8, "bfloat16")
    cfg = build_config({"chunk_size": CHUNK, "l1_size_gb": "16MiB"})
    cache = KVCache(cfg, "m", layout)
    tokens = list(range(32))
    kv = torch.randn(layout.chunk_shape(32)).to(torch.bfloat16)
    cache.store(tokens, kv)
    out, n = cache.retrieve(tokens)
    assert n == 32 and out.dtype == torch.bfloat16 and torch.equal(out, kv)
    cache.close()


def test_models_layouts_and_namespaces_never_mix(tmp_path):
    cfg = build_config({"chunk_size": CHUNK, "l1_size_gb": "64MiB"})
    a = KVCache(cfg, "model-a", LAYOUT)
    tokens = list(range(32))
    a.store(tokens, kv_for(tokens))
    b = KVCache(cfg, "model-b", LAYOUT, tiers=a.tiers)
    c = KVCache(cfg, "model-a", KVLayout(2, 2, 8, "bfloat16"), tiers=a.tiers)
    assert b.lookup(tokens) == 0 and c.lookup(tokens) == 0
    assert a.lookup(tokens, namespace="lora=x") == 0 and a.lookup(tokens) == 32
    a.close()


@pytest.mark.parametrize("tokens,kv_shape,dtype,needle", [
    ([[1, 2], [3, 4]], None, torch.float32, "1-D"),
    ([1, -2, 3], None, torch.float32, "non-negative"),
    ([1.5, 2.5], None, torch.float32, "ints"),
    (list(range(16)), (2, 2, 15, 2, 8), torch.float32, "shape"),
    (list(range(16)), (2, 2, 16, 2, 8), torch.float64, "dtype"),
])
def test_bad_input_is_a_clear_error(tmp_path, tokens, kv_shape, dtype, needle):
    cache = make_cache(tmp_path, disk=False)
    kv = torch.zeros(kv_shape or (2, 2, 2, 2, 8), dtype=dtype)
    with pytest.raises(InputError, match=needle):
        cache.store(tokens, kv)
    cache.close()


def test_bad_config_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="chunk_size"):
        build_config({"chunk_size": 0})
    with pytest.raises(ConfigError, match="S3FIFO"):
        build_config({"eviction_policy": "random"})
    with pytest.raises(ConfigError, match="xxhash"):
        build_config({"hash_algorithm": "crc32"})
    with pytest.raises(KVTierError, match="l1_size_gb"):
        KVCache(build_config({"l1_size_gb": 0}), "m", LAYOUT)


def test_unwritable_l2_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = build_config({"chunk_size": CHUNK, "l1_size_gb": "8MiB",
                        "l2_adapters": [{"type": "local_disk", "path": str(blocker / "sub")}]})
    with pytest.raises(ConfigError, match=str(blocker)):
        KVCache(cfg, "m", LAYOUT)


def test_the_lookup_memo_is_bounded_in_bytes(tmp_path):
    cache = make_cache(tmp_path, disk=False, lookup_memo_max_bytes=200_000)
    for i in range(50):  # distinct prompts of 64 chunks each, resolved as a store or a retrieve does (a lookup of a
        cache.chunk_refs(list(range(i * 10_000, i * 10_000 + 64 * CHUNK)))  # new prompt hashes its first chunk only)
    memo = cache.tiers.memo
    assert 0 < memo.nbytes <= 200_000 and len(memo) < 50
    cache.chunk_refs(list(range(10**6, 10**6 + 4096 * CHUNK)))  # one prompt costing more than the whole budget
    assert memo.nbytes <= 200_000
    tokens = list(range(49 * 10_000, 49 * 10_000 + 64 * CHUNK))
    kv = kv_for(tokens)
    assert cache.store(tokens, kv) == 64 and cache.lookup(tokens) == 64 * CHUNK
    out, n = cache.retrieve(tokens)
    assert n == 64 * CHUNK and torch.equal(out, kv)
    cache.close()


@pytest.mark.parametrize("hinted", [True, False])
def test_a_hinted_session_outlives_other_prompts_in_a_full_l2(tmp_path, hinted):
    """Issue 19 §1: the store's retention hint reaches L2 capacity eviction (local disk), not only L1."""
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    spec = [{"type": "local_disk", "path": str(tmp_path / "disk"), "size_gb": 16.5 * chunk_bytes / 1e9}]
    cfg = build_config({"chunk_size": CHUNK, "l1_size_gb": "1MiB", "l2_adapters": spec})
    with KVCache(cfg, "test-model", LAYOUT) as cache:
        session = list(range(1000, 1000 + 4 * CHUNK))  # 4 chunks: under half of the L2's 16
        hint = RetentionHint(priority=2, session_id="agent-1") if hinted else None
        assert cache.store(session, kv_for(session), hint=hint) == 4  # chunks
        assert cache.flush()
        for i in range(12):  # 48 more chunks through a 16-chunk L2
            other = [5000 + 100 * i + t for t in range(4 * CHUNK)]
            cache.store(other, kv_for(other, seed=i))
            assert cache.flush()
        cache.clear("CPU")
        assert cache.lookup(session) == (4 * CHUNK if hinted else 0)
        if hinted:
            kv, num_tokens = cache.retrieve(session)
            assert num_tokens == 4 * CHUNK and torch.equal(kv, kv_for(session))


def test_a_hinted_store_from_start_hints_the_chunks_before_it_too(tmp_path):
    """Issue 19 §1: a store with ``start`` (a sliding-window part, a client storing only a prompt's tail) puts every
    chunk of the prompt L1 holds under its hint, those before ``start`` included; the ones L1 lacks are skipped."""
    prompt = list(range(500, 500 + 4 * CHUNK))
    kv = kv_for(prompt)
    with make_cache(tmp_path, disk=False) as cache:
        assert cache.store(prompt[:2 * CHUNK], kv[:, :, :2 * CHUNK]) == 2  # earlier turn, stored without a hint
        stored = cache.store_chunks(prompt, copy_from(as_numpy(kv)), start=3 * CHUNK,
                                    hint=RetentionHint(priority=1, session_id="agent-1"))
        assert stored == 1  # chunk 2 is neither stored nor hinted: L1 does not hold it
        _, refs = cache.chunk_refs(prompt)
        assert sorted(cache.l1.session_keys("agent-1"), key=str) == sorted([refs[i].key for i in (0, 1, 3)], key=str)


def test_lookups_are_counted_by_medium_from_start(tmp_path):
    cache = make_cache(tmp_path, disk=False)
    tokens = list(range(3 * CHUNK))
    cache.store(tokens[:2 * CHUNK], kv_for(tokens[:2 * CHUNK]))
    assert cache.lookup(tokens, start=CHUNK) == 2 * CHUNK
    m = cache.metrics
    assert m.value("kvtier_lookup_requests_total") == 1 and m.value("kvtier_lookup_tokens_total") == 3 * CHUNK
    assert m.value("kvtier_lookup_hit_tokens_total", medium="CPU") == CHUNK  # from start's chunk on
    assert m.value("kvtier_lookup_hit_tokens_total", medium="STORAGE") == 0
    with pytest.raises(KeyError, match="medium"):  # counted together under one lock, checked all the same
        m.inc_many((("kvtier_lookup_hit_tokens_total", 1, ()),))
    cache.close()


def test_l2_writes_go_on_while_a_request_loop_never_waits(tmp_path):
    """A saturated server's loop is always busy: the writer and the disk's write threads wait at most
    kvtier.foreground.MAX_WAIT_SECONDS per item, and every write still lands."""
    from kvtier.foreground import FOREGROUND

    cache = make_cache(tmp_path)
    prompts = [list(range(1000 * i, 1000 * i + 4 * CHUNK)) for i in range(3)]
    FOREGROUND.busy()
    try:
        for i, tokens in enumerate(prompts):
            assert cache.store(tokens, kv_for(tokens, seed=i)) == 4
        assert cache.flush()
    finally:
        FOREGROUND.idle()
    cache.clear("CPU")
    for i, tokens in enumerate(prompts):
        out, n = cache.retrieve(tokens)  # promoted from the disk: every chunk was written
        assert n == 4 * CHUNK and torch.equal(out, kv_for(tokens, seed=i))
    cache.close()


def test_a_chunked_prefill_hashes_its_prompt_once(tmp_path):
    """Issue 38 finding 7: vLLM's connector asks about one request at several lengths: a lookup of the whole
    prompt, a store after each chunked-prefill step (2k, 4k, ... 32k tokens), a prefetch and a load. Keyed by the
    exact token array, that hashed 10x the prompt's tokens; keyed by whole-chunk prefixes, about once."""
    cache = make_cache(tmp_path, disk=False)
    prompt = list(range(7, 7 + 32768))
    kv = kv_for(prompt)
    assert cache.lookup(prompt) == 0
    for end in range(2048, len(prompt) + 1, 2048):
        assert cache.store(prompt[:end], kv[:, :, :end]) == 2048 // CHUNK
    assert cache.lookup(prompt) == len(prompt) and cache.prefetch(prompt) == len(prompt)
    with cache.retrieve_chunks(prompt[:16384]) as got:
        assert got.num_tokens == 16384
    hashed = cache.metrics.value("kvtier_hashed_tokens_total")
    assert len(prompt) <= hashed <= 1.1 * len(prompt)
    cache.close()
