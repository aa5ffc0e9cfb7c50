"""Foreground: background threads wait while a request loop is busy, never for good; their OS priority is lowered."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from kvtier.foreground import BACKGROUND_NICENESS, SWITCH_INTERVAL_SECONDS, Foreground, background_thread


def test_nothing_busy_means_no_wait():
    fg = Foreground()
    assert fg.wait_idle(0) is True


def test_a_busy_loop_holds_background_threads_until_it_waits_for_input():
    fg = Foreground()
    fg.busy()
    assert fg.wait_idle(0.01) is False  # busy: the background item starts after the bound, not before
    started = threading.Event()
    released = []

    def background():
        started.set()
        released.append(fg.wait_idle(30))

    thread = threading.Thread(target=background)
    thread.start()
    started.wait()
    assert not released
    with fg.waiting():  # the loop waits for input: the background thread runs
        thread.join(30)
        assert released == [True]
    assert fg.wait_idle(0) is False  # busy again after the wait


def test_busy_counts_every_loop_and_an_exception_in_the_wait_keeps_the_count():
    fg = Foreground()
    fg.busy()
    fg.busy()
    fg.idle()
    assert fg.wait_idle(0) is False  # the other loop is still busy
    with pytest.raises(RuntimeError), fg.waiting():
        assert fg.wait_idle(0) is True  # inside the wait: idle
        raise RuntimeError("poll failed")
    assert fg.wait_idle(0) is False  # waiting() restored its busy mark after the exception
    fg.idle()
    assert fg.wait_idle(0) is True
    fg.idle()  # an extra idle never makes the count negative
    fg.busy()
    assert fg.wait_idle(0) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_background_thread_lowers_only_its_own_priority():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []

    def background():
        background_thread()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=background)
    thread.start()
    thread.join(30)
    assert seen == [min(19, before + BACKGROUND_NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the caller's is untouched


def test_a_poll_that_does_not_wait_stays_busy_and_a_loop_start_caps_the_switch_interval(monkeypatch):
    fg = Foreground()
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)  # the default
    set_to = []
    monkeypatch.setattr(sys, "setswitchinterval", set_to.append)
    fg.loop_started()
    assert set_to == [SWITCH_INTERVAL_SECONDS] and fg.wait_idle(0) is False
    with fg.waiting(False):  # requests queued: the poll does not wait, background threads stay held
        assert fg.wait_idle(0) is False
    with fg.waiting():
        assert fg.wait_idle(0) is True
    fg.idle()
    assert fg.wait_idle(0) is True
