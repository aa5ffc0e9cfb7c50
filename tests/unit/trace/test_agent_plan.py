"""The schedule of benchmarks/agent_sessions.py (``benchmarks/agent_plan.py``, loaded from its file: benchmarks are
scripts, not a package): same seed, same requests in the same order; every session's turns in order with pauses from
the distribution; documents between them; the hints; and the sizing arithmetic the script refuses configurations by."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "agent_plan.py"
_spec = importlib.util.spec_from_file_location("kvtier_bench_agent_plan", _PATH)
agent_plan = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = agent_plan  # dataclasses look their module up by name
_spec.loader.exec_module(agent_plan)

SHAPE = agent_plan.AgentShape(system_tokens=1500, task_tokens=200, tool_tokens=320, answer_tokens=24,
                              doc_tokens=2048, chunk_tokens=256)


def schedule(**kw):
    args = {"sessions": 16, "turns": 4, "live_sessions": 5.0, "pause_min_seconds": 24.0, "pause_max_seconds": 40.0,
            "doc_interval_seconds": 3.0, "seed": 0, **kw}
    return agent_plan.Schedule(**args)


def test_same_seed_same_plan_and_another_seed_other_pauses():
    assert agent_plan.plan(schedule()) == agent_plan.plan(schedule())
    assert agent_plan.plan(schedule()) != agent_plan.plan(schedule(seed=1))


def test_turns_in_order_with_pauses_from_the_distribution_and_documents_between():
    sched = schedule()
    reqs = agent_plan.plan(sched)
    assert reqs[0].kind == "system" and reqs[0].at_seconds == 0.0
    times = [r.at_seconds for r in reqs]
    assert times == sorted(times)
    for s in range(sched.sessions):
        turns = [r for r in reqs if r.kind == "turn" and r.session == s]
        assert [r.turn for r in turns] == list(range(sched.turns))
        assert turns[0].at_seconds == pytest.approx(sched.start_seconds + s * sched.arrival_seconds, abs=1e-3)
        for a, b in zip(turns, turns[1:]):
            assert sched.pause_min_seconds - 1e-3 <= b.at_seconds - a.at_seconds <= sched.pause_max_seconds + 1e-3
        # the sessions' pauses are where one-shot documents arrive: several between two turns of a session
        assert all(sum(a.at_seconds < r.at_seconds < b.at_seconds for r in reqs if r.kind == "doc") >= 7
                   for a, b in zip(turns, turns[1:]))
    docs = [r for r in reqs if r.kind == "doc"]
    assert [d.doc for d in docs] == list(range(len(docs)))
    assert docs[-1].at_seconds < max(r.at_seconds for r in reqs if r.kind == "turn")
    # sessions overlap about as planned: mean number of sessions between their first and last turn
    spans = [(min(r.at_seconds for r in reqs if r.session == s), max(r.at_seconds for r in reqs if r.session == s))
             for s in range(sched.sessions)]
    middle = range(int(spans[4][0]), int(spans[-4][0]))  # past the ramp-up, before the ramp-down
    live = [sum(a <= t <= b for a, b in spans) for t in middle]
    assert 4 <= sum(live) / len(live) <= 6


def test_hints_per_kind():
    sys_req, turn, doc = agent_plan.PlannedRequest(0.0, "system"), agent_plan.PlannedRequest(5.0, "turn", 3, 1), \
        agent_plan.PlannedRequest(6.0, "doc", doc=0)
    assert agent_plan.hint_for(sys_req, 55.0) == {"kvtier.priority": 3}
    assert agent_plan.hint_for(turn, 55.0) == {"kvtier.session_id": "agent-3", "kvtier.priority": 1,
                                               "kvtier.ttl_seconds": 55.0}
    assert agent_plan.hint_for(doc, 55.0) is None


def test_chunk_counts_of_a_growing_session():
    assert [SHAPE.prompt_tokens(k) for k in range(4)] == [1716, 2076, 2436, 2796]
    assert SHAPE.system_chunks == 5 and SHAPE.doc_chunks == 8
    assert [SHAPE.session_chunks(k) for k in range(4)] == [1, 3, 4, 5]
    assert agent_plan.all_sessions_chunks(SHAPE, schedule()) == 5 + 16 * 5


def test_protected_peak_counts_sessions_until_their_ttl_runs_out():
    reqs = [agent_plan.PlannedRequest(0.0, "system"),
            agent_plan.PlannedRequest(1.0, "turn", 0, 0), agent_plan.PlannedRequest(31.0, "turn", 0, 1),
            agent_plan.PlannedRequest(40.0, "turn", 1, 0), agent_plan.PlannedRequest(70.0, "turn", 1, 1)]
    # session 0 (3 chunks at its last turn) is still protected when session 1 starts with a TTL of 10 s, not of 5 s
    assert agent_plan.protected_peak_chunks(reqs, SHAPE, ttl_seconds=10.0) == 5 + 3 + 1
    assert agent_plan.protected_peak_chunks(reqs, SHAPE, ttl_seconds=5.0) == 5 + 3
    # the whole plan: more sessions overlap with a longer TTL, never more than all sessions together
    full = agent_plan.plan(schedule())
    short, long = (agent_plan.protected_peak_chunks(full, SHAPE, ttl) for ttl in (41.0, 120.0))
    assert short < long <= agent_plan.all_sessions_chunks(SHAPE, schedule())


def test_horizons_prefill_and_bad_schedules():
    assert agent_plan.flood_horizon_seconds(58, SHAPE, schedule()) == pytest.approx(58 * 3.0 / 8)
    reqs = [agent_plan.PlannedRequest(0.0, "system"), agent_plan.PlannedRequest(1.0, "turn", 0, 0),
            agent_plan.PlannedRequest(5.0, "doc", doc=0), agent_plan.PlannedRequest(10.0, "turn", 0, 3)]
    # stored in 10 s: 1 + 8 + 5 chunks; an LRU of 28 chunks keeps one for 20 s
    assert agent_plan.lru_horizon_seconds(28, reqs, SHAPE) == pytest.approx(20.0)
    assert agent_plan.prefill_tokens(reqs, SHAPE) == 1500 + 1716 + 2048 + 2796
    # the sessions' own stores shorten the LRU's memory below what the documents alone give
    full = agent_plan.plan(schedule())
    assert agent_plan.lru_horizon_seconds(58, full, SHAPE) < agent_plan.flood_horizon_seconds(58, SHAPE, schedule())
    with pytest.raises(ValueError, match="2 turns"):
        schedule(turns=1)
    with pytest.raises(ValueError, match="min <= max"):
        schedule(pause_min_seconds=50.0)
