"""The oracle: kvtier's hashes for LoRA, salted and multimodal requests equal vLLM 0.32's own
(``vllm.v1.core.kv_cache_utils``), at vLLM CPU's block size 128 and GPU vLLM's 16, for sha256 and sha256_cbor.

Runs ``vllm_identity_oracle.py`` with the vLLM environment's python (real ``Request`` objects, no engine start)
and checks what it found: vLLM's ``request.block_hashes`` equal kvtier's digests through the connector's identity
module and through the server's Lookup decode path; chunk keys are last-block digests; event ids, event extra keys
and ``lora_name`` equal vLLM's; kvtier's vLLM-free ``block_extra_keys`` builds vLLM's keys; defaults agree.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvtier_harness.vllm import model_dir, require_vllm

ORACLE = Path(__file__).with_name("vllm_identity_oracle.py")


def test_kvtier_hashes_equal_vllms_for_lora_salt_and_multimodal_requests(tmp_path):
    adapter = tmp_path / "sql-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (adapter / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "PYTHONHASHSEED"}
    proc = subprocess.run([require_vllm(), str(ORACLE), str(model_dir()), str(adapter)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ORACLE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("ORACLE "):])
    defaults = result["defaults"]
    assert defaults["kvtier_algorithm"] == defaults["vllm_algorithm"] == "sha256"
    assert defaults["kvtier_seed"] == defaults["vllm_seed"] == "vllm-none-hash"
    assert sorted(result["runs"]) == ["128/sha256", "128/sha256_cbor", "16/sha256", "16/sha256_cbor"]
    for run, found in result["runs"].items():
        block_size, algorithm = run.split("/")
        assert found["settings"] == {"block_size": int(block_size), "hash_algorithm": algorithm,
                                     "hash_seed": "vllm-none-hash"}
        reqs = found["requests"]
        for name, req in reqs.items():
            assert req["num_vllm_blocks"] == 700 // int(block_size), (run, name)
            for check in ("identity_module_equal", "server_path_equal", "chunk_keys_are_last_blocks",
                          "event_ids_equal", "event_extra_keys_equal", "no_vllm_helper_equal"):
                assert req[check] is True, (run, name, check)
        assert reqs["lora+salt+mm"]["event_lora_name"] == "sql-lora"
        assert reqs["plain"]["event_lora_name"] is None and not reqs["plain"]["has_extra_keys"]
        assert reqs["plain"]["namespace"] == "" and reqs["other-images"]["namespace"] == ""
        assert len({reqs["salt"]["namespace"], reqs["lora+salt+mm"]["namespace"], ""}) == 3
        # the images start at token 130: block 0 of the image request is a plain block; the salt changes block 0
        assert reqs["plain"]["first_hash"] == reqs["other-images"]["first_hash"]
        assert len({reqs["plain"]["first_hash"], reqs["salt"]["first_hash"], reqs["lora+salt+mm"]["first_hash"]}) == 3
    assert result["model_id"].startswith("smollm2-135m-instruct@") and result["model_override"] == "my-model-v3"
