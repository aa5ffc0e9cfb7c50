"""Run by ``test_vllm_identity.py`` with the vLLM environment's python (no engine is started).

Builds real ``vllm.v1.request.Request`` objects (a LoRA request, a salt, multimodal items given by identifier and
placeholder range, and a plain one), lets vLLM 0.32 hash them (``get_request_block_hasher`` ->
``request.block_hashes``) and compares kvtier's digests for the same requests: through the connector's identity
module, through the server's Lookup decode path (msgpack extra keys rebuilt as tuples) into ``KVCache.chunk_refs``,
and in the published events. Prints one JSON object of findings; the test asserts on it.

    .venv-vllm/bin/python tests/integration/vllm/vllm_identity_oracle.py MODEL_DIR ADAPTER_DIR
"""

from __future__ import annotations

import json
import sys

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.vllm_identity import VLLMIdentity
from kvtier.events import BlockStored, EventEmitter
from kvtier.hashing import DEFAULT_ALGORITHM, DEFAULT_SEED, prefix_hashes
from kvtier.extra_keys import block_extra_keys
from kvtier.layout import KVLayout
from kvtier import protocol as P

NUM_TOKENS = 700  # five 128-token blocks and a partial one; 43 16-token blocks and a partial one


def requests(adapter: str, block_size: int, hasher) -> dict[str, Request]:
    tokens = [(i * 7919) % 49000 for i in range(NUM_TOKENS)]
    images = [("image-a-sha", 130, 200), ("image-b-sha", 400, 64)]
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=offset, length=length))
                for ident, offset, length in images]

    def make(name, **kw):
        return Request(name, list(tokens), SamplingParams(max_tokens=1), None, block_hasher=hasher, **kw)

    other = [(ident + "-other", offset, length) for ident, offset, length in images]
    return {
        "plain": make("plain"),
        "lora+salt+mm": make("full", lora_request=LoRARequest("sql-lora", 1, adapter), cache_salt="tenant-salt",
                             mm_features=features),
        "salt": make("salt", cache_salt="tenant-salt"),
        "other-images": make("other", mm_features=[MultiModalFeatureSpec(
            data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset, length))
            for ident, offset, length in other]),
    }, {"lora+salt+mm": images, "other-images": other}


def check(vllm_config, adapter: str, algorithm: str) -> dict:
    vllm_config.cache_config.prefix_caching_hash_algo = algorithm
    identity = VLLMIdentity(vllm_config)
    bs = identity.block_size
    hash_fn = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(hash_fn)
    reqs, images = requests(adapter, bs, kv_cache_utils.get_request_block_hasher(bs, hash_fn))
    settings = identity.hash_settings()
    cfg = build_config({"chunk_size": 2 * bs, "l1_size_gb": "1MiB", **settings})
    cache = KVCache(cfg, identity.model_id, KVLayout(1, 1, 4))
    out = {"settings": settings, "requests": {}}
    for name, req in reqs.items():
        namespace, extra = identity.request_keys(req)
        vllm_hashes = list(req.block_hashes)
        n = len(vllm_hashes)
        ours = prefix_hashes(req.prompt_token_ids, bs, settings["hash_algorithm"], settings["hash_seed"], extra)
        # the server's path: extra keys through msgpack, rebuilt as tuples, hashed by KVCache
        msg = P.decode_request(P.encode(P.Lookup(id=1, tokens=P.pack_tokens(req.prompt_token_ids), extra_keys=extra)))
        _, refs = cache.chunk_refs(P.unpack_tokens(msg.tokens), namespace, extra_keys=msg.extra_keys)
        via_server = refs[0].blocks.digests if refs else []
        emitter = EventEmitter(cfg)  # a fresh one: requests sharing leading chunks would be announced once
        emitter.stored(req.prompt_token_ids, refs, "CPU")
        events = [e for e in emitter.take_events() if isinstance(e, BlockStored)]
        event_ids = [h for e in events for h in e.block_hashes]
        vllm_event_extra = kv_cache_utils.to_event_extra_keys(
            [kv_cache_utils.generate_block_hash_extra_keys(req, i * bs, (i + 1) * bs, 0)[0] for i in range(n)])
        no_vllm = block_extra_keys(NUM_TOKENS, bs, cache_salt=req.cache_salt,
                                   lora=(req.lora_request.lora_name, req.lora_request.lora_path) if req.lora_request else None,
                                   mm_items=images.get(name, ()))
        out["requests"][name] = {
            "num_vllm_blocks": n,
            "identity_module_equal": ours[:n] == vllm_hashes,
            "server_path_equal": via_server[:len(refs) * 2] == vllm_hashes[:len(refs) * 2] and len(refs) >= 1,
            "chunk_keys_are_last_blocks": [r.key.prefix_hash for r in refs] == vllm_hashes[1:2 * len(refs):2],
            "event_ids_equal": event_ids == [kv_cache_utils.maybe_convert_block_hash(h) for h in vllm_hashes[:len(event_ids)]]
            and len(event_ids) == 2 * len(refs),
            "event_extra_keys_equal": [k for e in events for k in e.extra_keys] == (vllm_event_extra or [None] * n)[:len(event_ids)],
            "event_lora_name": events[0].lora_name if events else None,
            "no_vllm_helper_equal": no_vllm == extra,
            "namespace": namespace,
            "has_extra_keys": extra is not None,
            "first_hash": vllm_hashes[0].hex(),
        }
    cache.close()
    return out


def main() -> None:
    model_dir, adapter = sys.argv[1], sys.argv[2]
    config = VllmConfig(model_config=ModelConfig(model=model_dir), cache_config=CacheConfig(block_size=16))
    result = {"defaults": {"kvtier_algorithm": DEFAULT_ALGORITHM, "kvtier_seed": DEFAULT_SEED,
                           "vllm_algorithm": CacheConfig.__dataclass_fields__["prefix_caching_hash_algo"].default,
                           "vllm_seed": kv_cache_utils.DEFAULT_NONE_HASH_SEED}, "runs": {}}
    for block_size in (128, 16):  # vLLM CPU's block size, and GPU vLLM's
        config.cache_config.block_size = block_size
        for algorithm in ("sha256", "sha256_cbor"):
            result["runs"][f"{block_size}/{algorithm}"] = check(config, adapter, algorithm)
    result["model_id"] = VLLMIdentity(config).model_id
    result["model_override"] = VLLMIdentity(config, "my-model-v3").model_id
    print("ORACLE " + json.dumps(result))


if __name__ == "__main__":
    main()
