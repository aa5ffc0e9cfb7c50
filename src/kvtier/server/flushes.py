"""Deferred ``Flush`` replies: a ``Flush`` the L2 write queue cannot answer at once waits here, so a slow L2 never
blocks the request loop, and is answered when the queue drains or at the request's deadline, whichever is first."""

from __future__ import annotations

import time

from kvtier import protocol as P


class Flushes:
    """The ``Flush`` requests waiting for L2 (``l2``: the server's ``L2Tier``; ``send(identity, reply)``: the
    request loop's reply function). Each waiting request counts one in flight against its session's principal."""

    def __init__(self, l2, send):
        self.l2, self.send = l2, send
        self._waiting: list[tuple] = []  # (identity, request id, deadline (monotonic seconds), session)

    def on_flush(self, identity, session, msg, payload):
        """The ``Flush`` handler: ``FlushReply`` at once when nothing waits for L2, else (None, []) and later."""
        if self.l2.flush(0):
            return P.FlushReply(id=msg.id, done=session.flushed(True)), []
        self._waiting.append((identity, msg.id, time.monotonic() + msg.timeout_seconds, session))
        session.usage.add(inflight=1)
        return None, []

    def answer(self, now: float) -> None:
        """Answer the waiting requests whose L2 writes are done (all of them, once the queue drained) or whose
        deadline passed (``done`` False). Call with the server's lock held."""
        if not self._waiting:
            return
        done = self.l2.flush(0)
        for entry in [f for f in self._waiting if done or f[2] <= now]:
            self._waiting.remove(entry)
            entry[3].usage.add(inflight=-1)  # also when the session is gone: its principal's count must drop
            self.send(entry[0], P.FlushReply(id=entry[1], done=entry[3].flushed(done)))
