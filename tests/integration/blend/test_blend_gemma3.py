"""Blending a model with sliding-window layers and two rotary bases (Gemma-3, issue 18 §2): each layer's K is
re-rotated by its own frequencies and each sliding layer's recompute is masked to its window. A Gemma-3 built from
a real config (random weights, 16-token window: fast) and the real Gemma-3-270M (512-token window)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from kvtier.blend import RopeRotator, segments_from_lengths
from kvtier.blend.assemble import KVAssembly
from kvtier.blend.recompute import blend_prefill
from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_kv import dynamic_cache_to_kv
from kvtier.layout import KVLayout

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _gemma(attn: str = "sdpa"):
    config = Gemma3TextConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              layer_types=LAYER_TYPES, max_position_embeddings=4096)
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return Gemma3ForCausalLM(config).eval()


def _ids(n, seed, high=1000):
    return torch.randint(3, high, (1, n), generator=torch.Generator().manual_seed(seed))


def _full(model, ids):
    out = model(ids, past_key_values=DynamicCache(), use_cache=True)
    return out.logits[:, -1], dynamic_cache_to_kv(out.past_key_values, ids.shape[1])


def _exact_assembly(kv):
    L, _, T, H, D = kv.shape
    asm = KVAssembly(L, H, D, T, kv.dtype)
    asm.put(0, kv)
    asm.reused[:] = True
    return asm


@torch.inference_mode()
def test_rotator_reads_each_layers_frequencies_and_window():
    model = _gemma()
    rotator = RopeRotator.for_model(model)
    assert rotator.layer_types == LAYER_TYPES
    assert rotator.windows == [WINDOW, WINDOW, None, WINDOW]
    doc = _ids(40, 1)
    alone = dynamic_cache_to_kv(model(doc, past_key_values=DynamicCache(), use_cache=True).past_key_values, 40)
    moved = dynamic_cache_to_kv(model(doc, past_key_values=DynamicCache(), position_ids=torch.arange(90, 130)[None],
                                      use_cache=True).past_key_values, 40)
    torch.testing.assert_close(rotator.rotate(alone[:, 0], 90), moved[:, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(alone[:, 1], moved[:, 1], atol=1e-4, rtol=1e-4)  # V carries no position
    one_base = RopeRotator(rotator.inv_freq[2])  # the full layers' base for every layer: wrong for sliding layers
    assert (one_base.rotate(alone[:, 0], 90)[0] - moved[0, 0]).abs().max() > 1e-2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.inference_mode()
def test_exact_kv_with_no_recompute_equals_full_prefill_past_the_window(attn):
    model = _gemma(attn)
    ids = _ids(6 * WINDOW, 2)
    ref, kv = _full(model, ids)
    asm = _exact_assembly(kv)
    logits, past, num = blend_prefill(model, ids, asm.keys, asm.values, asm.reused, asm.forced, 0.0)
    assert num == 1
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    rotator = RopeRotator.for_model(model)
    rotator.windows = [None] * 4  # the sliding layers unmasked: the last token sees what the model never lets it
    asm = _exact_assembly(kv)
    unmasked, _, _ = blend_prefill(model, ids, asm.keys, asm.values, asm.reused, asm.forced, 0.0, rotator=rotator)
    assert (unmasked - ref).abs().max() > 1e-3


@torch.inference_mode()
def test_full_recompute_over_wrong_kv_equals_full_prefill():
    model = _gemma()
    ids = _ids(5 * WINDOW, 4)
    ref, kv = _full(model, ids)
    asm = _exact_assembly(torch.randn_like(kv))
    logits, past, num = blend_prefill(model, ids, asm.keys, asm.values, asm.reused, asm.forced, 1.0)
    assert num == ids.shape[1]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dynamic_cache_to_kv(past, ids.shape[1]), kv, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def gemma3():
    from kvtier.demo.models import load_gemma3

    model, _ = load_gemma3(progress=False)
    return model


def _cache(model, chunk=64):
    return KVCache(build_config({"chunk_size": chunk, "l1_size_gb": "512MiB"}), "gemma3", KVLayout.from_model(model))


@pytest.mark.model
@torch.inference_mode()
def test_real_gemma3_prefix_reuse_matches_a_full_prefill(gemma3):
    ids = _ids(700, 5, high=30000)  # past the 512-token window
    ref, _ = _full(gemma3, ids)
    conn = HFConnector(gemma3, _cache(gemma3, chunk=256))
    conn.prefill(ids)
    logits, past, stats = conn.prefill(ids)
    assert stats["num_hit_tokens"] == 512
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    reference = gemma3.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(conn.generate(ids, 6)[0], reference)


@pytest.mark.model
@torch.inference_mode()
def test_real_gemma3_blends_documents_wherever_they_stand(gemma3):
    p, a, b, q = _ids(40, 6, 30000), _ids(300, 7, 30000), _ids(280, 8, 30000), _ids(12, 9, 30000)
    conn = HFConnector(gemma3, _cache(gemma3))
    ab = torch.cat([p, a, b, q], dim=1)
    _, _, stats = conn.prefill_segments(ab, segments_from_lengths([40, 300, 280, 12], ["prefix", "doc", "doc", "text"]))
    assert stats["blended"] and stats["num_segment_stored"] == 2
    ba = torch.cat([p, b, a, q], dim=1)
    segs = segments_from_lengths([40, 280, 300, 12], ["prefix", "doc", "doc", "text"])
    ref, _ = _full(gemma3, ba)
    logits, _, stats = conn.prefill_segments(ba, segs, fraction=0.2)
    assert stats["num_segment_hit_tokens"] == 580 and stats["num_segment_stored"] == 0
    # the prefix (shorter than a chunk), the question, a's first token and 20 % of a (b, right after the prefix
    # it was computed after, is exact)
    assert stats["num_recomputed_tokens"] == 40 + 12 + 1 + round(0.2 * 299)
    assert int(logits.argmax()) == int(ref.argmax())
    logits, _, _ = conn.prefill_segments(ba, segs, fraction=1.0)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
