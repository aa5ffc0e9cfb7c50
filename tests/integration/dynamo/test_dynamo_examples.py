"""The Dynamo launch scripts as a user runs them: ``examples/dynamo/agg.sh`` and ``disagg.sh`` (real vLLM; minutes).

Each test starts the script in its own process group on free ports with ``LOG_DIR`` in a temporary folder, waits
for its ``serving on`` line, runs ``examples/dynamo/check.py`` (one prompt: cold, warm, reload after every
worker's prefix cache was reset) with the Dynamo environment's python, and reads its JSON:

- aggregated: every step gives the cold step's greedy output; the reload step's prompt comes from kvtier (cached
  tokens after the reset); after one more reset Dynamo's router credits the prompt to the worker's host tier
  (kvtier's L1, announced in the worker's own event stream) and no longer to its device tier;
- disaggregated: the decode worker loads the prompt the prefill worker stored in kvtier (cached tokens on the
  cold step already) and gives the aggregated (single-instance, fp32) output.

Then SIGTERM to the script: it stops everything it started, by pid, so its process group ends up empty.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvtier_harness.service_proc import free_port
from kvtier_harness.vllm import document_tokens, model_dir, require_vllm
from support.server import metric_value
from support.dynamo_procs import DYNAMO_PYTHON, MODEL_NAME, Deployment, RouterProbe, require_dynamo

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples" / "dynamo"
BLOCK = 128  # vLLM CPU's block size (the scripts' BLOCK_SIZE)
CHUNK = 256  # the scripts' CHUNK_SIZE
NUM_TOKENS = 512  # the prompt: 4 vLLM blocks, 2 kvtier chunks
START_TIMEOUT_SECONDS = 300.0
STOP_TIMEOUT_SECONDS = 60.0  # the scripts SIGKILL what is left 30 s after SIGTERM
REFERENCE: dict[str, str] = {}  # agg's cold output (one instance, no kvtier data): disagg must match it


def log_tail(log_dir: Path, chars: int = 3000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in sorted(log_dir.glob("*.log")))


class Script:
    """A launch script running in its own process group (stdout and stderr in ``$LOG_DIR/script.log``)."""

    def __init__(self, name: str, log_dir: Path):
        self.log_dir = log_dir
        self.http_port = free_port()
        env = {**os.environ, "LOG_DIR": str(log_dir), "HTTP_PORT": str(self.http_port)}
        for var in ("KV_PORT", "KV_ADMIN_PORT", "KV_EVENTS_PORT", "KV_REPLAY_PORT"):
            env[var] = str(free_port())
        self.kvtier_admin = f"http://127.0.0.1:{env['KV_ADMIN_PORT']}"
        self.env = env
        self.log_path = log_dir / "script.log"
        with open(self.log_path, "w") as log:
            self.popen = subprocess.Popen(["bash", str(EXAMPLES / name)], stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=REPO, start_new_session=True)

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while "serving on" not in self.log_path.read_text():
            if self.popen.poll() is not None:
                raise AssertionError(f"the script exited with {self.popen.returncode}:\n{log_tail(self.log_dir)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no 'serving on' in {START_TIMEOUT_SECONDS:.0f} s:\n{log_tail(self.log_dir)}")
            time.sleep(1)

    def check(self, *extra: str) -> dict:
        """``check.py`` against this deployment; its JSON."""
        env = {**os.environ, "DYN_FILE_KV": str(self.log_dir / "discovery")}
        run = subprocess.run([str(DYNAMO_PYTHON), str(EXAMPLES / "check.py"), "--http-port", str(self.http_port),
                              "--model-dir", str(model_dir()), "--num-tokens", str(NUM_TOKENS), "--max-tokens", "8",
                              "--metrics", str(self.log_dir / "metrics-urls"), *extra],
                             capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, f"check.py failed:\n{run.stderr[-3000:]}\n{log_tail(self.log_dir)}"
        return json.loads(run.stdout)

    def retrieved_chunks(self) -> float:
        """Chunks the kvtier server has sent to the workers."""
        text = httpx.get(f"{self.kvtier_admin}/metrics", timeout=5).text
        return metric_value(text, "kvtier_retrieve_chunks_total") or 0.0

    def group_alive(self) -> bool:
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> None:
        """SIGTERM the script alone (its trap stops its children by pid); then the group must be empty."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        leftover = self.group_alive()
        if leftover:
            os.killpg(self.popen.pid, signal.SIGKILL)
        assert self.popen.returncode is not None, "the script did not exit after SIGTERM"
        assert not leftover, f"processes of the script outlived it:\n{self.log_path.read_text()[-2000:]}"


@pytest.fixture
def launch(tmp_path):
    require_vllm()
    require_dynamo()
    scripts = []

    def start(name: str) -> Script:
        script = Script(name, tmp_path / "logs")
        scripts.append(script)
        script.wait_serving()
        return script

    (tmp_path / "logs").mkdir()
    try:
        yield start
    finally:
        for script in scripts:
            if script.popen.poll() is None or script.group_alive():
                try:
                    script.stop()
                except AssertionError:
                    pass


def assert_same_output(result: dict) -> None:
    assert result["same_output_warm"] and result["same_output_reload"], json.dumps(result, indent=1)
    assert result["cold"]["text"], result


def reset_prefix_caches(script: Script, components: str) -> None:
    """check.py's own ``reset_prefix_caches`` (Dynamo's ``clear_kv_blocks``) once more."""
    code = ("import asyncio, sys; sys.path.insert(0, sys.argv[1]); from check import reset_prefix_caches; "
            "print(asyncio.run(reset_prefix_caches('dynamo', sys.argv[2].split(','))))")
    env = {**os.environ, "DYN_FILE_KV": str(script.log_dir / "discovery")}
    run = subprocess.run([str(DYNAMO_PYTHON), "-c", code, str(EXAMPLES), components], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0 and int(run.stdout.split()[-1]) >= 1, run.stderr[-3000:]


def test_agg_reloads_from_kvtier_and_the_router_sees_the_host_tier(launch):
    script = launch("agg.sh")
    probe = RouterProbe(Deployment(script.log_dir), BLOCK)  # before check.py: the router learns live events only
    try:
        result = script.check()
        assert_same_output(result)
        assert result["workers_reset"] == 1, result
        # all but the last block (vLLM computes the last prompt token itself) came from kvtier
        assert result["reload"]["cached_tokens"] == NUM_TOKENS - BLOCK, result
        REFERENCE["text"] = result["cold"]["text"]

        tokens = document_tokens(model_dir())[:NUM_TOKENS]
        blocks = NUM_TOKENS // BLOCK
        worker = dict(line.split("=", 1) for line in (script.log_dir / "worker-ids").read_text().split())["worker1"]
        reset_prefix_caches(script, "backend")
        # an engine step publishes the events vLLM queued
        poke = lambda: httpx.post(f"http://127.0.0.1:{script.http_port}/v1/completions", timeout=60,  # noqa: E731
                                  json={"model": MODEL_NAME, "prompt": [42, 43, 44], "max_tokens": 1})
        on_host_only = lambda v: (v["workers"].get(worker, {}).get("device") == 0  # noqa: E731
                                  and v["workers"][worker]["host"] == blocks)
        probe.until(tokens, on_host_only, "the prompt on the worker's host tier only", poke=poke)
    finally:
        probe.stop()
    script.stop()


def test_a_worker_added_later_is_credited_with_the_servers_chunks_before_its_first_request(launch):
    script = launch("agg.sh")
    probe = RouterProbe(Deployment(script.log_dir), BLOCK)
    late = None
    try:
        tokens = document_tokens(model_dir())[NUM_TOKENS:3 * NUM_TOKENS]  # a prompt no other test sends
        blocks = len(tokens) // BLOCK
        answer = httpx.post(f"http://127.0.0.1:{script.http_port}/v1/completions", timeout=300,
                            json={"model": MODEL_NAME, "prompt": tokens, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        stored = lambda: metric_value(httpx.get(f"{script.kvtier_admin}/metrics", timeout=5).text,  # noqa: E731
                                      "kvtier_store_chunks_total") or 0
        deadline = time.monotonic() + 60
        while stored() < len(tokens) // CHUNK and time.monotonic() < deadline:
            time.sleep(0.5)
        assert stored() >= len(tokens) // CHUNK, f"the kvtier server stored {stored()} chunks"
        # a second worker on the same kvtier server, started now (examples/dynamo/common.sh's start_worker)
        code = ('source examples/dynamo/common.sh; start_worker worker2 "$(kvtier_transfer_config kv_both)"; '
                'echo late-worker-ready; wait')
        with open(script.log_dir / "late-worker.log", "w") as log:
            late = subprocess.Popen(["bash", "-c", code], stdout=log, stderr=subprocess.STDOUT, env=script.env,
                                    cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while "late-worker-ready" not in (script.log_dir / "late-worker.log").read_text():
            assert late.poll() is None and time.monotonic() < deadline, log_tail(script.log_dir)
            time.sleep(1)
        ids = dict(line.split("=", 1) for line in (script.log_dir / "worker-ids").read_text().split())
        worker2 = ids["worker2"]
        # no request reaches worker2: the router learns kvtier's chunks from its resyncs alone
        probe.until(tokens, lambda v: v["workers"].get(worker2, {}).get("host") == blocks,
                    "the server's chunks on the late worker's host tier")
        urls = dict(line.split("=", 1) for line in (script.log_dir / "metrics-urls").read_text().split())
        counts = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(urls["worker2"], timeout=10).text.splitlines()
                  if line.startswith("vllm:prompt_tokens_total")]
        assert counts and sum(counts) == 0, f"the late worker computed prompts before the router credited it: {counts}"
    finally:
        probe.stop()
        if late is not None and late.poll() is None:
            late.send_signal(signal.SIGTERM)  # its trap stops the worker by pid
            late.wait(STOP_TIMEOUT_SECONDS)
    script.stop()


def test_disagg_decode_loads_from_kvtier(launch):
    script = launch("disagg.sh")
    result = script.check("--components", "prefill,backend")
    assert_same_output(result)
    assert result["workers_reset"] == 2, result
    # the decode worker loads what the prefill worker stored: cold, 2 chunks; warm, none (both prefix caches hold
    # the prompt); reload, 2 chunks for each worker (the usage the frontend reports is the prefill worker's)
    assert script.retrieved_chunks() == 3 * (NUM_TOKENS // CHUNK), result
    if "text" in REFERENCE:
        assert result["cold"]["text"] == REFERENCE["text"], (result["cold"]["text"], REFERENCE["text"])
    script.stop()
