"""Blending (issue 18) with the real SmolLM2 and a real KVCache: re-rotation, 100 % recompute, segment keys, bad input."""

from __future__ import annotations

import pytest
import torch

from kvtier.blend import RopeRotator, Segment, segments_from_lengths
from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_kv import dynamic_cache_to_kv
from kvtier.errors import InputError
from kvtier.keys import segment_namespace
from kvtier.demo.models import load_smollm2
from kvtier.layout import KVLayout

CHUNK = 64
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smol():
    model, _ = load_smollm2(progress=False)
    return model


def _cache(model, model_id="smol"):
    return KVCache(build_config({"chunk_size": CHUNK, "l1_size_gb": "256MiB"}), model_id, KVLayout.from_model(model))


def _ids(n, seed):
    return torch.randint(3, 40000, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_rerotated_k_equals_k_at_new_position(smol):
    doc = _ids(100, 1)
    alone = dynamic_cache_to_kv(smol(doc, use_cache=True).past_key_values, 100)
    moved = dynamic_cache_to_kv(smol(doc, position_ids=torch.arange(300, 400)[None], use_cache=True).past_key_values,
                                100)
    k = RopeRotator.for_model(smol).rotate(alone[:, 0], 300)
    assert (k - alone[:, 0]).abs().max() > 1e-2  # the rotation did something
    torch.testing.assert_close(k, moved[:, 0], atol=2e-4, rtol=0)


@torch.inference_mode()
def test_full_recompute_equals_full_prefill_and_blend_reuses(smol):
    conn = HFConnector(smol, _cache(smol))
    a, b, q = _ids(80, 2), _ids(70, 3), _ids(10, 4)
    ids = torch.cat([a, b, q], dim=1)
    segs = segments_from_lengths([80, 70, 10], ["doc", "doc", "text"])
    full = smol(ids, use_cache=True, logits_to_keep=1).logits[:, -1]
    logits, _, stats = conn.prefill_segments(ids, segs, fraction=1.0)
    assert torch.equal(logits, full)
    conn.prefill_segments(torch.cat([b, a, q], dim=1), segments_from_lengths([70, 80, 10], ["doc", "doc", "text"]))
    logits, _, stats = conn.prefill_segments(ids, segs, fraction=0.15)
    assert stats["blended"] and stats["num_segment_hit_tokens"] == 150 and stats["num_segment_stored"] == 0
    assert stats["num_recomputed_tokens"] < 60
    assert int(logits.argmax()) == int(full.argmax())


@torch.inference_mode()
def test_document_after_the_prefix_with_no_recompute_equals_prefix_reuse(smol):
    p, d, q = _ids(70, 7), _ids(100, 8), _ids(9, 9)
    ids = torch.cat([p, d, q], dim=1)
    segs = segments_from_lengths([70, 100, 9], ["prefix", "doc", "text"])
    conn = HFConnector(smol, _cache(smol))
    conn.prefill_segments(ids, segs)  # stores the document (computed after the prefix) and the prefix's chunk
    logits, past, stats = conn.prefill_segments(ids, segs, fraction=0.0)
    assert stats["num_segment_hit_tokens"] == 100 and stats["num_segment_stored"] == 0
    assert stats["num_hit_tokens"] == CHUNK + 100 and stats["num_recomputed_tokens"] == 70 - CHUNK + 9

    prefix_conn = HFConnector(smol, _cache(smol))
    prefix_conn.prefill(ids)
    ref_logits, ref_past, ref_stats = prefix_conn.prefill(ids)  # prefix reuse of the same prompt
    assert ref_stats["num_hit_tokens"] == 2 * CHUNK
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(dynamic_cache_to_kv(past, 179), dynamic_cache_to_kv(ref_past, 179), atol=1e-4, rtol=0)


@torch.inference_mode()
def test_a_document_computed_after_another_prefix_is_a_miss(smol):
    p1, p2, d, q = _ids(20, 10), _ids(20, 11), _ids(90, 12), _ids(5, 13)
    segs = segments_from_lengths([20, 90, 5], ["prefix", "doc", "text"])
    conn = HFConnector(smol, _cache(smol))
    _, _, stats = conn.prefill_segments(torch.cat([p1, d, q], dim=1), segs)
    assert stats["num_segment_stored"] == 1
    _, _, stats = conn.prefill_segments(torch.cat([p2, d, q], dim=1), segs)
    assert stats["num_segment_stored"] == 1 and stats["num_segment_hit_tokens"] == 0  # its KV depends on the prefix
    _, _, stats = conn.prefill_segments(torch.cat([p1, d, q], dim=1), segs)
    assert stats["num_segment_stored"] == 0 and stats["num_segment_hit_tokens"] == 90
    names = {segment_namespace("", p1[0]), segment_namespace("", p2[0]), segment_namespace(""), segment_namespace("x", p1[0])}
    assert len(names) == 4


def test_segment_keys_differ_from_prefix_keys_and_by_model(smol):
    cache = _cache(smol)
    tokens = _ids(CHUNK * 2, 5)[0]
    _, prefix = cache.chunk_refs(tokens)
    _, seg = cache.chunk_refs(tokens, segment_namespace(""))
    assert {r.key for r in prefix}.isdisjoint({r.key for r in seg})
    assert {r.key.prefix_hash for r in prefix}.isdisjoint({r.key.prefix_hash for r in seg})
    kv = torch.zeros(KVLayout.from_model(smol).chunk_shape(len(tokens)))
    cache.store(tokens, kv, segment_namespace(""))
    assert cache.lookup(tokens, segment_namespace("")) == len(tokens)
    assert cache.lookup(tokens) == 0
    other = KVCache(build_config({"chunk_size": CHUNK}), "other-model", KVLayout.from_model(smol), tiers=cache.tiers)
    assert other.lookup(tokens, segment_namespace("")) == 0


def test_bad_segments_and_fraction(smol):
    conn = HFConnector(smol, _cache(smol))
    ids = _ids(150, 6)
    with pytest.raises(InputError, match="tile"):
        conn.prefill_segments(ids, [Segment(0, 80), Segment(90, 150, "text")])
    with pytest.raises(InputError, match="shorter than one chunk"):
        conn.prefill_segments(ids, segments_from_lengths([30, 120], ["doc", "text"]))
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        conn.prefill_segments(ids, segments_from_lengths([80, 70], ["doc", "text"]), fraction=1.5)
