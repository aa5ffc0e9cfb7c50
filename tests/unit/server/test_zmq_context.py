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


EXIT_SCRIPT = textwrap.dedent("""
    import zmq
    from kvtier.zmq_context import Context
    class Holder:  # a context left in a cycle until the interpreter shuts down
        pass
    h = Holder()
    h.me, h.ctx = h, Context()
    h.sock = h.ctx.socket(zmq.DEALER)
    h.sock.connect("tcp://127.0.0.1:9")
    del h
    print("exiting", flush=True)
""")


def test_a_kvtier_context_still_in_a_cycle_at_exit_lets_the_process_exit():
    """At shutdown the collector finalizes the context, and a thread started then never runs: the finalizer used
    to wait for it forever (a pytest process hung at its end this way)."""
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (0, "exiting"), done.stderr
