"""The kvtier server dies while a vLLM OpenAI server uses it: requests keep completing, with the same answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest
from test_vllm_support import (
    REPO,
    KVTierServer,
    document_tokens,
    free_port,
    model_dir,
    require_vllm,
    stop_process,
)

pytestmark = pytest.mark.model


class OpenAIServer:
    """``python -m vllm.entrypoints.openai.api_server`` with the kvtier connector; stopped by pid."""

    def __init__(self, work, kvtier_url: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cfg = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"kvtier.server_url": kvtier_url, "kvtier.timeout_s": 2}}
        argv = [require_vllm(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir()),
                "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port), "--dtype",
                "float32", "--enforce-eager", "--max-model-len", "4096", "--no-enable-prefix-caching",
                "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(cfg)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        self.log_path = work / f"openai-{self.port}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vLLM exited:\n{self.log_path.read_text()[-4000:]}"
            try:
                if httpx.get(self.base + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError("vLLM not ready after 600 s")

    def complete(self, prompt: list[int]) -> dict:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "logprobs": 3}
        resp = httpx.post(self.base + "/v1/completions", json=body, timeout=120)  # a hang fails the test
        resp.raise_for_status()
        return resp.json()

    def stop(self) -> None:
        stop_process(self.proc, 60)


def _answer(reply: dict):
    choice = reply["choices"][0]
    return choice["text"], choice["logprobs"]["top_logprobs"]


def test_kvtier_server_killed_mid_run(tmp_path):
    ids = document_tokens(model_dir())
    prompt = ids[:700]
    kv = KVTierServer(tmp_path, chunk_size=256)
    vllm = OpenAIServer(tmp_path, kv.url)
    try:
        cold = vllm.complete(prompt)
        warm = vllm.complete(prompt)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 512  # from kvtier (vLLM's cache is off)
        os.kill(kv.proc.pid, signal.SIGKILL)  # no goodbye, no cleanup
        kv.proc.wait(10)
        after = [vllm.complete(prompt), vllm.complete(ids[2000:2300])]
        assert after[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for reply in (warm, after[0]):
            text, top = _answer(reply)
            want_text, want_top = _answer(cold)
            assert text == want_text
            for got, want in zip(top, want_top):
                assert got.keys() == want.keys()
                assert all(abs(got[k] - want[k]) <= 1e-4 for k in want)
        assert after[1]["choices"][0]["finish_reason"] == "length"
        assert vllm.proc.poll() is None, "vLLM must keep serving without kvtier"
    finally:
        vllm.stop()
        kv.stop()
