"""A ``zmq.Context`` that cannot hang the process that drops it.

pyzmq's ``Context.__del__`` closes the sockets it still tracks and then calls ``term()``, which waits until
libzmq has closed every socket of the context. When a context and its sockets become garbage together (an
object holding both caught in a reference cycle, e.g. through the traceback of an exception), the garbage
collector clears the weak references through which the context tracks its sockets *before* any finalizer
runs: the context sees no socket to close, ``term()`` waits for sockets whose own finalizers have not run yet,
and the thread that happened to trigger the collection blocks forever. A client dropped without ``close()``
on an error path hung pytest this way.

``Context`` here terminates a context that is collected while still open on a daemon thread instead: the
sockets' finalizers run right after, ``term()`` returns, and the thread ends. Every kvtier class that owns a
context (client, server, event publisher and subscriber) uses it; ``close()`` on those classes still closes
their sockets and terminates the context at once. A context still open when the interpreter shuts down is left
to the process's exit: a thread started then never runs, and the finalizer would wait for it forever.
"""

from __future__ import annotations

import sys
import threading

import zmq


class Context(zmq.Context):
    """``zmq.Context`` whose finalizer never blocks (see the module docstring). Sockets made from it have
    ``LINGER`` 0 unless set otherwise, so a terminated context never waits for undelivered messages."""

    def __init__(self, io_threads: int = 1) -> None:
        super().__init__(io_threads)
        self.setsockopt(zmq.LINGER, 0)

    def __del__(self) -> None:
        if self._shadow or self.closed or sys.is_finalizing():  # at exit no new thread runs: start() would wait forever
            return
        # resurrected by the thread until term() returns (PEP 442: a finalizer runs once)
        threading.Thread(target=self.term, name="kvtier-zmq-term", daemon=True).start()
