"""A context collected together with its sockets (a reference cycle) must not block the collecting thread."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import gc, sys, zmq
    from kvtier.zmq_context import Context
    make = Context if sys.argv[1] == "kvtier" else zmq.Context
    gc.disable()
    class Holder:  # context and socket reachable only through a cycle, as through an exception's traceback
        pass
    h = Holder()
    h.me, h.ctx = h, make()
    h.sock = h.ctx.socket(zmq.DEALER)
    h.sock.setsockopt(zmq.LINGER, -1)  # even a socket that would wait for its queued message forever
    h.sock.connect("tcp://127.0.0.1:9")  # nobody listens: the message stays queued
    h.sock.send(b"queued", zmq.NOBLOCK)
    del h
    gc.collect()
    print("collected", flush=True)
""")


def _collect(kind: str, timeout_seconds: float) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, kind], capture_output=True, text=True, timeout=timeout_seconds)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_collected_kvtier_context_never_blocks_the_collecting_thread():
    assert _collect("kvtier", 30).strip() == "collected"


def test_a_collected_plain_pyzmq_context_blocks_which_is_why_kvtier_has_its_own():
    with pytest.raises(subprocess.TimeoutExpired):
        _collect("plain", 3)
