"""``kvtier server`` startup refusals (one line naming the problem, exit 2, no traceback) and clean
shutdown on SIGINT (queued L2 writes finished, shared memory unlinked, exit 0)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess

import pytest
import torch
from support.server import CHUNK, LAYOUT, ServerProc, free_port, kvtier_cmd

from kvtier.client import Client
from kvtier.proc import pid_alive


def refused(*args: str) -> str:
    base = ["server", "--port", str(free_port()), "--admin-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    out = subprocess.run(kvtier_cmd(*base, *args), capture_output=True, text=True, timeout=120, env=env, check=False)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]


GOOD = ("--l1-size-gb", "0.01", "--eviction-policy", "LRU")


@pytest.mark.parametrize("args, expected", [
    (("--l1-size-gb", "0", "--eviction-policy", "LRU"), "--l1-size-gb must be > 0"),
    (("--eviction-policy", "LRU"), "--l1-size-gb is required"),
    (("--l1-size-gb", "1"), "--eviction-policy is required"),
    ((*GOOD, "--l2-adapter", '{"type": "floppy_disk", "path": "/tmp/x"}'), "unknown L2 adapter type 'floppy_disk'"),
    ((*GOOD, "--l2-adapter", '{"type": "local_disk"}'), "missing required field 'path'"),
    ((*GOOD, "--l2-adapter", '{"type": "local_disk", "path": "/tmp/x", "colour": 1}'), "unknown field 'colour'"),
    ((*GOOD, "--l2-adapter", '{"type": "local_disk",'), "is not valid JSON"),
    ((*GOOD, "--l2-adapter", '["local_disk"]'), "must be a JSON object"),
    ((*GOOD, "--event-block-size", "16"), "--event-block-size was removed: use --block-size"),
    ((*GOOD, "--chunk-size", "256", "--block-size", "100"), "block_size (100) must divide chunk_size (256)"),
])
def test_bad_startup_is_refused_with_one_line(args, expected):
    line = refused(*args)
    assert line.startswith("error: ") and expected in line


def test_ports_in_use_are_refused_and_leave_no_shared_memory():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        before = set(os.listdir("/dev/shm"))
        line = refused(*GOOD, "--port", str(port))
        assert f"cannot listen on 127.0.0.1:{port} (--host/--port)" in line and "in use" in line
        line = refused(*GOOD, "--admin-port", str(port))
        assert f"cannot listen on 127.0.0.1:{port} (--admin-host/--admin-port)" in line
        # an arena of the refused (exited) server: a kvtier-<pid>-* name whose process is gone (other test
        # workers' live servers may add theirs meanwhile)
        left = [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("kvtier-")]
        assert not [n for n in left if not (m := re.match(r"kvtier-(\d+)-", n)) or not pid_alive(int(m.group(1)))]


def test_sigint_finishes_queued_l2_writes_and_exits_0(tmp_path):
    disk = tmp_path / "disk"
    # each L2 batch takes 500 ms more, so writes are still queued when SIGINT arrives (4 s of them: at 200 ms each, a
    # test slower than 1.6 s to store and ask found them all written); the shutdown may take all it needs
    slow_disk = {"type": "faulty", "inner": {"type": "local_disk", "path": str(disk)}, "latency_seconds": 0.5, "ops": ["put"]}
    server = ServerProc(tmp_path, config={"l2_adapters": [slow_disk], "l2_write_queue_size": 1024,
                                          "server": {"shutdown_timeout_seconds": 120}})
    shm_name = server.status()["l1"]["shm_name"]
    assert os.path.exists(f"/dev/shm/{shm_name}")
    with Client(server.url, model="m", layout=LAYOUT) as client:
        stored = 0
        for i in range(8):
            tokens = list(range(i * 100_000, i * 100_000 + 8 * CHUNK))
            stored += client.store(tokens, torch.randn(LAYOUT.chunk_shape(len(tokens))))
    assert stored == 64
    assert server.status()["l2"][0]["num_records"] < 64  # not all written yet
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=60) == 0
    server.stop()
    records = [p for p in disk.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(records) == 64  # every queued write reached the disk before exit
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    assert "stopped" in server.log() and "Traceback" not in server.log()


def test_startup_removes_the_shared_l1_of_a_killed_server(tmp_path):
    first = ServerProc(tmp_path)
    shm_name = first.status()["l1"]["shm_name"]
    first.proc.kill()  # SIGKILL: no chance to unlink its shared memory
    first.proc.wait()
    first.stop()
    assert os.path.exists(f"/dev/shm/{shm_name}")
    with ServerProc(tmp_path) as second:
        assert not os.path.exists(f"/dev/shm/{shm_name}")
        assert second.status()["l1"]["shm_name"] != shm_name


def test_startup_keeps_a_shared_l1_that_a_live_server_holds(tmp_path):
    import fcntl

    fake = "/dev/shm/kvtier-999999-0badf00d"  # a pid that is not running here, as in another pid namespace
    with open(fake, "wb") as f:
        f.write(b"\0" * 4096)
    holder = os.open(fake, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)
        with ServerProc(tmp_path):
            assert os.path.exists(fake)  # in use: kept
    finally:
        os.close(holder)
        os.unlink(fake)


def _in_small_shm(size: str, *cmd: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a user and mount namespace whose /dev/shm is a fresh tmpfs of ``size``."""
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *cmd], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture
def small_shm_available():
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs in a user namespace here: {probe.stderr.decode().strip()}")


def test_the_arena_reserves_its_pages_so_a_full_dev_shm_is_a_startup_error_not_sigbus(small_shm_available):
    import json
    import sys

    from support import small_shm

    # /dev/shm of 1 MiB: a 600 kB arena fits once; a second one, or a 600 kB file written after, does not
    out = _in_small_shm("1m", sys.executable, small_shm.__file__, "600000", "600000")
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)  # -7 would be SIGBUS
    result = json.loads(out.stdout.splitlines()[-1])
    assert "/dev/shm has" in result["second"] and "l1_size_gb" in result["second"]
    assert result["filler"] == "No space left on device"  # the other writer fails, not the server
    assert result["arena"] == "written"
    env_args = ("server", "--port", str(free_port()), "--admin-port", str(free_port()), "--l1-size-gb", "2MB",
                "--eviction-policy", "LRU")
    server = _in_small_shm("1m", *kvtier_cmd(*env_args))
    assert server.returncode == 2 and "/dev/shm has" in server.stderr and "Traceback" not in server.stderr
