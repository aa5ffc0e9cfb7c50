"""The server's hashing child process (``kvtier.server.hashproc``): the same digests as hashing in process, bad
input answered as the same error, a dead child replaced, a lower CPU priority. A real child process each time."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from kvtier.errors import InputError
from kvtier.extra_keys import check_extra_keys, refreeze_extra_keys
from kvtier.foreground import BACKGROUND_NICENESS
from kvtier.hashing import prefix_hashes
from kvtier.server import hashproc
from kvtier.server.hashproc import HashProcess, HashProcessError


@pytest.fixture
def proc():
    p = HashProcess()
    yield p
    p.close()


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor", "xxhash", "sha256_cbor_64bit"])
def test_same_digests_as_in_process(proc, algorithm):
    rng = np.random.default_rng(3)
    for high in (300, 2**31, 2**62):
        tokens = rng.integers(0, high, 1000)
        blocks = 1000 // 16 + 1
        extra = tuple(None if i % 3 else (("lora", "a", "/p"), b"\x00img", 7) for i in range(blocks))
        for keys in (None, extra):
            want = prefix_hashes(tokens, 16, algorithm, "seed", keys, include_partial=True)
            assert proc.prefix_hashes(tokens, 16, algorithm, "seed", keys, include_partial=True) == want
    assert proc.prefix_hashes(np.zeros(0, np.int64), 16, algorithm, "seed") == []


@pytest.mark.parametrize("algorithm", ["sha256", "xxhash"])
def test_shared_keys_hash_as_in_process(proc, algorithm):
    """``check_extra_keys`` makes equal flat keys one object and pickle writes a repeated object as a reference:
    the child, which gets copies over msgpack, must hash that same form (a repeated key within a block, a key
    repeated inside a nested one)."""
    mm = ("mm", "imghash", 0)
    raw = [[list(mm), list(mm)], None, [["x", ["a", "b"]], ["y", ["a", "b"]]], [mm, ("cache_salt", "s")]]
    keys = check_extra_keys(raw, 4)
    tokens = np.arange(64)
    want = prefix_hashes(tokens, 16, algorithm, "seed", keys)
    assert proc.prefix_hashes(tokens, 16, algorithm, "seed", keys) == want
    assert prefix_hashes(tokens, 16, algorithm, "seed", refreeze_extra_keys(raw)) == want


def test_bad_input_is_the_in_process_error(proc):
    with pytest.raises(InputError) as here:
        prefix_hashes(np.arange(32), 16, "sha256", "s", (None,))
    with pytest.raises(InputError) as child:
        proc.prefix_hashes(np.arange(32), 16, "sha256", "s", (None,))
    assert str(child.value) == str(here.value)
    assert proc.prefix_hashes(np.arange(32), 16, "sha256", "s") == prefix_hashes(np.arange(32), 16, "sha256", "s")


def test_runs_at_a_lower_priority_and_stops_on_close(proc):
    proc.prefix_hashes(np.arange(32), 16, "sha256", "s")
    child = proc._proc
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICENESS)
    proc.close()
    assert child.poll() is not None


def test_a_dead_child_is_replaced_after_the_backoff(proc):
    now = [100.0]
    proc.clock = lambda: now[0]  # the test's time: the backoff does not run out while this process waits
    tokens = np.arange(64)
    want = prefix_hashes(tokens, 16, "sha256", "s")
    assert proc.prefix_hashes(tokens, 16, "sha256", "s") == want
    first = proc._proc
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    with pytest.raises(HashProcessError):
        proc.prefix_hashes(tokens, 16, "sha256", "s")
    now[0] += hashproc.RESTART_BACKOFF_SECONDS - 0.01
    with pytest.raises(HashProcessError, match="failed recently"):  # within the backoff: no restart storm
        proc.prefix_hashes(tokens, 16, "sha256", "s")
    now[0] += 0.01
    assert proc.prefix_hashes(tokens, 16, "sha256", "s") == want
    assert proc._proc.pid != first.pid


def test_a_stopped_child_is_killed_and_replaced(monkeypatch):
    proc = HashProcess(reply_timeout_seconds=30.0)  # a child starts Python first: on a loaded machine that takes > 0.5 s
    try:
        tokens = np.arange(1 << 16)  # a 512 KiB job, more than a pipe holds: the write must give up too
        want = prefix_hashes(tokens, 16, "sha256", "s")
        assert proc.prefix_hashes(tokens, 16, "sha256", "s") == want
        first = proc._proc
        proc.reply_timeout_seconds = 0.5
        os.kill(first.pid, signal.SIGSTOP)
        with pytest.raises(HashProcessError, match="no answer within 0.5 s"):
            proc.prefix_hashes(tokens, 16, "sha256", "s")
        assert first.wait(5) == -signal.SIGKILL
        monkeypatch.setattr(hashproc, "RESTART_BACKOFF_SECONDS", 0.0)
        proc.reply_timeout_seconds = 30.0
        assert proc.prefix_hashes(tokens, 16, "sha256", "s") == want and proc._proc.pid != first.pid
    finally:
        proc.close()


def test_a_child_still_starting_is_not_waited_for(monkeypatch):
    """A child that takes seconds to import (a busy machine, its lower priority) must not hold the first long
    prompts: with ``startup_wait_seconds=0`` they raise HashProcessError (the server hashes them in process) until
    the child says it is ready; the child is kept meanwhile, not restarted."""
    slow = ("sh", "-c", f"sleep 1.5; exec {hashproc.sys.executable} -m kvtier.server.hashproc")
    monkeypatch.setattr(hashproc, "CHILD_COMMAND", slow)
    proc = HashProcess(reply_timeout_seconds=30.0, startup_wait_seconds=0.0)
    try:
        proc.start()
        child = proc._proc
        tokens = np.arange(64)
        with pytest.raises(HashProcessError, match="still starting"):
            proc.prefix_hashes(tokens, 16, "sha256", "s")
        assert proc._proc is child and child.poll() is None
        proc.startup_wait_seconds = 30.0
        assert proc.prefix_hashes(tokens, 16, "sha256", "s") == prefix_hashes(tokens, 16, "sha256", "s")
        assert proc._proc is child
    finally:
        proc.close()
