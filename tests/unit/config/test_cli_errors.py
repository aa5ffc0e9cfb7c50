"""The ``kvtier`` command line reports bad input and failed file operations as one line and exit 2.

Each test runs the real console entry point in a subprocess (``python -m kvtier``) with this checkout's
``src`` first on the path, so what is asserted is what a user sees.
"""

import os
import subprocess
import sys
from pathlib import Path

import yaml

SRC = str(Path(__file__).resolve().parents[3] / "src")


def kvtier(*args: str, env: dict | None = None, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = SRC + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


def one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_server_malformed_env_json_is_one_line():
    res = kvtier("server", "--l1-size-gb", "0.01", env={"KVTIER_L2_ADAPTERS": '[{"type": '})
    assert "KVTIER_L2_ADAPTERS" in one_line_error(res)


def test_auth_tenant_missing_out_folder_changes_nothing(tmp_path):
    secret = tmp_path / "server.secret"
    assert kvtier("auth", "tenant", "alice", "--out", str(tmp_path / "a.cred"), "--secret-file", str(secret)).returncode == 0
    before = secret.read_text()
    res = kvtier("auth", "tenant", "carol", "--out", str(tmp_path / "nope" / "c.cred"), "--secret-file", str(secret))
    line = one_line_error(res)
    assert str(tmp_path / "nope") in line and "does not exist" in line
    assert secret.read_text() == before  # carol was not added
    assert "carol" not in yaml.safe_load(secret.read_text())["tenants"]


def test_os_error_names_the_path(tmp_path):
    # the secret file's folder would have to be created under a regular file: mkdir fails with an OSError
    blocker = tmp_path / "afile"
    blocker.write_text("")
    res = kvtier("auth", "tenant", "carol", "--out", str(tmp_path / "c.cred"), "--secret-file", str(blocker / "s.secret"))
    assert str(blocker) in one_line_error(res)


def test_server_section_not_a_mapping_is_reported(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("l1_size_gb: 0.01\neviction_policy: LRU\nserver: 5\n")
    line = one_line_error(kvtier("server", "--config", str(f), "--port", "0", "--admin-port", "0", timeout=30))
    assert "'server'" in line


def usage_error(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and needle in res.stderr, res.stderr


def test_events_from_seq_needs_a_replay_endpoint():
    usage_error(kvtier("events", "subscribe", "--from-seq", "3", "--timeout-seconds", "0.1"),
                "--from-seq needs --replay-endpoint")


def test_auth_tenant_port_out_of_range(tmp_path):
    usage_error(kvtier("auth", "tenant", "carol", "--port", "99999", "--out", str(tmp_path / "c.cred")), "--port")
    assert not (tmp_path / "c.cred").exists()


def test_status_timeout_must_be_positive():
    usage_error(kvtier("status", "--admin-url", "http://127.0.0.1:1", "--timeout-seconds", "-1"), "--timeout-seconds")


def test_simulate_a_truncated_trace_is_one_line_naming_it(tmp_path):
    trace = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "traces" / "multi_user.trace"
    cut = tmp_path / "cut.trace"
    data = trace.read_bytes()
    cut.write_bytes(data[: data.index(b"\n", data.index(b"\n") + 1) + 30])  # the header, a record, a piece
    line = one_line_error(kvtier("simulate", "--trace", str(cut), "--l1-size-gb", "1"))
    assert str(cut) in line and "line 3 is cut short" in line


def test_server_trace_file_in_a_missing_folder_is_one_line(tmp_path):
    res = kvtier("server", "--l1-size-gb", "0.001", "--eviction-policy", "LRU", "--port", "0", "--admin-port", "0",
                 "--trace-file", str(tmp_path / "nope" / "x.trace"))
    line = one_line_error(res)
    assert "--trace-file" in line and str(tmp_path / "nope" / "x.trace") in line
