"""The blend math on real transformers models built from real configs (random weights, fast): the recompute writes
every recomputed token's K/V in every layer, leaves the others as assembled, selects by deviation, narrows the
selection with gradual filtering; re-rotation into strided buffers; the assembly buffer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier.blend import RopeRotator
from kvtier.blend.assemble import KVAssembly
from kvtier.blend.recompute import blend_prefill
from kvtier.connectors.hf_kv import dynamic_cache_to_kv
from kvtier.errors import BlendUnsupportedError
from kvtier.demo.models import tiny_model


def _llama(num_layers=4, attn="sdpa"):
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return LlamaForCausalLM(config).eval()


def _ids(n, seed):
    return torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


def _assembly(kv):
    L, _, T, H, D = kv.shape
    asm = KVAssembly(L, H, D, T, kv.dtype)
    asm.put(0, kv)
    return asm


@torch.inference_mode()
def _full(model, ids):
    out = model(ids, use_cache=True)
    return out.logits[:, -1], dynamic_cache_to_kv(out.past_key_values, ids.shape[1])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.inference_mode()
def test_recomputing_every_candidate_replaces_corrupt_kv_in_every_layer(attn):
    model = _llama(attn=attn)
    ids = _ids(150, 1)
    logits, exact = _full(model, ids)
    corrupt = exact.clone()
    corrupt[:, :, 40:] = torch.randn_like(corrupt[:, :, 40:])  # tokens 40.. hold garbage "reused" KV
    asm = _assembly(corrupt)
    asm.reused[:] = True
    asm.exact[:40] = True
    got_logits, past, n = blend_prefill(model, ids, asm.keys, asm.values, asm.reused, asm.forced, 1.0,
                                        exact=asm.exact, attention_blocks=3)
    assert n == 110
    torch.testing.assert_close(dynamic_cache_to_kv(past, 150), exact, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_zero_fraction_keeps_reused_kv_after_the_check_layer():
    model = _llama()
    ids = _ids(120, 2)
    _, exact = _full(model, ids)
    noisy = exact + 0.01 * torch.randn_like(exact)
    asm = _assembly(noisy)
    asm.reused[:] = True
    _, past, n = blend_prefill(model, ids, asm.keys, asm.values, asm.reused, asm.forced, 0.0)
    got = dynamic_cache_to_kv(past, 120)
    assert n == 1  # the last token only
    torch.testing.assert_close(got[0], exact[0], atol=2e-5, rtol=1e-4)  # layer 0 runs for every token
    assert torch.equal(got[1:, :, :-1], noisy[1:, :, :-1])  # later layers: the reused KV as it was put
    assert not torch.equal(got[1:, :, -1], noisy[1:, :, -1])


@torch.inference_mode()
def test_selection_picks_the_tokens_whose_kv_deviates():
    model = _llama()
    ids = _ids(200, 3)
    _, exact = _full(model, ids)
    bad = exact.clone()
    bad[1:, :, 50:60] += 3.0  # ten tokens' reused KV is far off from layer 1 on
    asm = _assembly(bad)
    asm.reused[:] = True
    _, past, n = blend_prefill(model, ids, asm.keys, asm.values, asm.reused, asm.forced, 10 / 199)
    got = dynamic_cache_to_kv(past, 200)
    assert n == 11
    torch.testing.assert_close(got[:, :, 50:60], exact[:, :, 50:60], atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_gradual_filtering_narrows_to_the_fraction():
    model = _llama(num_layers=6)
    ids = _ids(200, 4)
    _, exact = _full(model, ids)
    bad = exact + 0.05 * torch.randn_like(exact)
    counts = {}
    for refine in (0, 2):
        asm = _assembly(bad)
        asm.reused[:] = True
        _, past, counts[refine] = blend_prefill(model, ids, asm.keys, asm.values, asm.reused, asm.forced, 0.2,
                                                refine_layers=refine, widen=3.0)
        got = dynamic_cache_to_kv(past, 200)
        changed = (got[1] != bad[1]).any(dim=(0, 2, 3)).sum()  # layer 1: the check layer's selection
        assert int(changed) == (1 + round(0.2 * 199) * (3 if refine else 1))
    assert counts[0] == counts[2] == 1 + round(0.2 * 199)


def test_other_attention_implementations_are_refused():
    model = _llama(num_layers=2)
    model.config._attn_implementation = "flex_attention"
    ids = _ids(20, 5)
    asm = KVAssembly(2, 2, 16, 20, torch.float32)
    with pytest.raises(BlendUnsupportedError, match="flex_attention"):
        blend_prefill(model, ids, asm.keys, asm.values, asm.reused, asm.forced, 0.1)


@torch.inference_mode()
def test_rotate_into_a_strided_buffer_equals_rotate():
    model = tiny_model(seed=2)
    rotator = RopeRotator.for_model(model)
    kv = torch.randn(2, 2, 30, 2, 16)
    asm = KVAssembly(2, 2, 16, 100, torch.float32)
    asm.put(50, kv, rotator, 37)
    k = torch.stack(asm.keys)[:, 0, :, 50:80].transpose(1, 2)  # (L, n, H, D)
    torch.testing.assert_close(k, rotator.rotate(kv[:, 0], 37), atol=1e-6, rtol=0)
    torch.testing.assert_close(rotator.rotate(rotator.rotate(kv[:, 0], 37), -37), kv[:, 0], atol=1e-5, rtol=0)
    v = torch.stack(asm.values)[:, 0, :, 50:80].transpose(1, 2)
    assert torch.equal(v, kv[:, 1])
    bf = KVAssembly(2, 2, 16, 30, torch.bfloat16)
    bf.put(0, kv.bfloat16(), rotator, 5)
    torch.testing.assert_close(torch.stack(bf.keys)[:, 0].transpose(1, 2).float(),
                               rotator.rotate(kv[:, 0], 5), atol=3e-2, rtol=2e-2)
