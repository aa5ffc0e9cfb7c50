"""Blending's refusals (issues 18, 43; bad input): a model kvtier cannot blend (its position encoding, its attention)
raises BlendUnsupportedError, or with allow_fallback=True gets prefix reuse, counted and logged once; a document
stored under another KV layout (dtype) is a miss, never wrong KV. Real transformers models (Llama built from a real
config), a real KVCache."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from kvtier.blend import RopeRotator, segments_from_lengths
from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.hf import HFConnector
from kvtier.errors import BlendUnsupportedError
from kvtier.demo.models import tiny_model
from kvtier.layout import KVLayout

CHUNK = 16


def _cache(model, model_id="tiny", tiers=None):
    return KVCache(build_config({"chunk_size": CHUNK, "l1_size_gb": "64MiB"}), model_id, KVLayout.from_model(model),
                   tiers=tiers)


def _ids(n, seed):
    return torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


def _dynamic_rope_llama():
    """A Llama whose RoPE is NTK "dynamic" (its frequencies depend on the sequence length), from a real config."""
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def test_sliding_window_without_layer_types_is_refused():
    """Mistral's config names a window but not which layers use it: blending cannot mask them as the model does."""
    config = MistralConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16)
    with pytest.raises(BlendUnsupportedError, match=r"'mistral'.*sliding-window"):
        RopeRotator.for_model(MistralForCausalLM(config))


@torch.inference_mode()
def test_unrotatable_rope_raises_unless_fallback_is_allowed_then_prefix_reuse_is_counted_and_logged_once(caplog):
    model = _dynamic_rope_llama()
    with pytest.raises(BlendUnsupportedError, match=r"'llama'.*'dynamic'"):
        RopeRotator.for_model(model)
    conn = HFConnector(model, _cache(model))
    ids = torch.cat([_ids(8, 1), _ids(40, 2), _ids(40, 3), _ids(5, 4)], dim=1)
    segs = segments_from_lengths([8, 40, 40, 5], ["prefix", "doc", "doc", "text"])
    with pytest.raises(BlendUnsupportedError, match="dynamic"):  # blending is explicit: no silent fallback
        conn.prefill_segments(ids, segs)
    with pytest.raises(BlendUnsupportedError, match="dynamic"):
        conn.store_document(ids[0, 8:48], ids[0, :8])
    assert conn.metrics.value("kvtier_blend_fallbacks_total") == 0 and conn.metrics is conn.cache.metrics
    full = model(ids, use_cache=True).logits[:, -1]
    with caplog.at_level(logging.WARNING, logger="kvtier.blend"):
        logits, _, stats = conn.prefill_segments(ids, segs, allow_fallback=True)
        assert stats["blended"] is False and "dynamic" in stats["blend_refused"]
        assert stats["num_hit_tokens"] == 0 and stats["num_stored_chunks"] == 93 // CHUNK
        torch.testing.assert_close(logits, full)
        logits, _, stats = conn.prefill_segments(ids, segs, allow_fallback=True)  # prefix chunks reused, exactly
        assert stats["blended"] is False and stats["num_hit_tokens"] == CHUNK * (93 // CHUNK)
        torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)
        stats = conn.store_document(ids[0, 8:48], ids[0, :8], allow_fallback=True)
        assert stats["stored"] is False and "dynamic" in stats["blend_refused"]
    assert conn.metrics.value("kvtier_blend_fallbacks_total") == 3
    said = [r for r in caplog.records if r.name == "kvtier.blend" and "dynamic" in r.getMessage()]
    assert len(said) <= 1  # once per process for this model type and reason (an earlier test may have said it)


def test_an_attention_blending_cannot_mask_is_refused_up_front():
    model = tiny_model(seed=3)
    model.config._attn_implementation = "flex_attention"
    conn = HFConnector(model, _cache(model))
    with pytest.raises(BlendUnsupportedError, match="flex_attention"):
        conn.prefill_segments(_ids(40, 1), segments_from_lengths([34, 6], ["doc", "text"]))
    with pytest.raises(BlendUnsupportedError, match="attn_implementation='sdpa'"):
        conn.store_document(_ids(40, 1))


@torch.inference_mode()
def test_document_stored_under_another_dtype_is_a_miss():
    fp32, bf16 = tiny_model(seed=3), tiny_model(seed=3, dtype=torch.bfloat16)
    a, b, q = _ids(40, 5), _ids(33, 6), _ids(6, 7)
    ids = torch.cat([a, b, q], dim=1)
    segs = segments_from_lengths([40, 33, 6], ["doc", "doc", "text"])
    cache32 = _cache(fp32)
    conn32 = HFConnector(fp32, cache32)
    conn32.prefill_segments(ids, segs)
    _, _, stats = conn32.prefill_segments(ids, segs)
    assert stats["num_segment_hit_tokens"] == 73  # stored for float32, found again for float32

    conn16 = HFConnector(bf16, _cache(bf16, tiers=cache32.tiers))  # same model id, same tiers, other dtype
    logits, _, stats = conn16.prefill_segments(ids, segs, fraction=0.0)
    assert stats["blended"] and stats["num_segment_hit_tokens"] == 0 and stats["num_segment_stored"] == 2
    # what bf16 gets equals its own computation over an empty cache: no float32 KV came in
    alone, _, _ = HFConnector(bf16, _cache(bf16)).prefill_segments(ids, segs, fraction=0.0)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, alone)
    _, _, stats = conn32.prefill_segments(ids, segs)
    assert stats["num_segment_hit_tokens"] == 73 and stats["num_segment_stored"] == 0


@torch.inference_mode()
def test_document_stored_by_another_model_is_a_miss():
    model_a, model_b = tiny_model(seed=3), tiny_model(seed=4)  # same architecture and layout, other weights
    ids = torch.cat([_ids(40, 5), _ids(33, 6), _ids(6, 7)], dim=1)
    segs = segments_from_lengths([40, 33, 6], ["doc", "doc", "text"])
    cache_a = _cache(model_a, "model-a")
    HFConnector(model_a, cache_a).prefill_segments(ids, segs)
    conn_b = HFConnector(model_b, _cache(model_b, "model-b", tiers=cache_a.tiers))
    logits, _, stats = conn_b.prefill_segments(ids, segs, fraction=0.0)
    assert stats["num_segment_hit_tokens"] == 0 and stats["num_segment_stored"] == 2
    alone, _, _ = HFConnector(model_b, _cache(model_b, "model-b")).prefill_segments(ids, segs, fraction=0.0)
    assert torch.equal(logits, alone)  # model b's own KV only


@pytest.mark.parametrize("knobs, said", [
    ({"head_tokens": -1}, "head_tokens"), ({"check_layer": 0}, r"check_layer must be an int in \[1, 1\]"),
    ({"check_layer": 2}, "check_layer"), ({"refine_layers": -1}, "refine_layers"), ({"widen": 0.5}, "widen"),
    ({"fraction": -0.5}, r"\[0, 1\]"),
])
def test_bad_blending_knobs_are_refused(knobs, said):
    from kvtier.errors import InputError

    model = tiny_model(seed=3)
    conn = HFConnector(model, _cache(model))
    with pytest.raises(InputError, match=said):
        conn.prefill_segments(_ids(40, 1), segments_from_lengths([34, 6], ["doc", "text"]), **knobs)
