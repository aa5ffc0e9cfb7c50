"""The schedule of benchmarks/agent_sessions.py: which request is sent when, its retention hint, and the sizes
that make the benchmark mean what it says.

Pure arithmetic on nominal token counts: no tokenizer, no engine, no imports from the other benchmark modules, so
``tests/unit/trace/test_agent_plan.py`` checks it on its own. Times are seconds from the start of the run ("planned
seconds"); the runner sends the requests one at a time in this order, each at its time or as soon as the one before
it has finished.

Requests, in the order of their planned time (ties: the order they were planned in):
  system  the shared system / tool prompt alone, once, first (an agent platform warms it)
  turn    turn ``turn`` of session ``session``: the system prompt, the session's task, and for every earlier turn the
          model's answer and a tool's output. A session starts ``arrival_seconds`` after the one before it; after
          each turn its tool runs for a pause drawn uniformly from [pause_min_seconds, pause_max_seconds]
  doc     a one-shot request (a long document nobody sends again, no hint), every ``doc_interval_seconds``
          from the start until the last turn
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("system", "turn", "doc")
SYSTEM_PRIORITY = 3  # the shared system prompt: kept before any session
SESSION_PRIORITY = 1


@dataclass(frozen=True)
class AgentShape:
    """Nominal token counts of the workload's parts (the script measures the real ones with the tokenizer).

    ``framing_tokens``: the headers around each appended part (``### Tool output`` and the like).
    """

    system_tokens: int
    task_tokens: int
    tool_tokens: int
    answer_tokens: int
    doc_tokens: int
    chunk_tokens: int
    framing_tokens: int = 16

    def prompt_tokens(self, turn: int) -> int:
        """Tokens of a session's prompt at ``turn`` (0: the first)."""
        return self.system_tokens + self.task_tokens + self.framing_tokens + turn * (
            self.answer_tokens + self.tool_tokens + self.framing_tokens)

    @property
    def system_chunks(self) -> int:
        """Whole chunks of the shared system prompt (the chunk it ends in also holds a session's first tokens)."""
        return self.system_tokens // self.chunk_tokens

    def session_chunks(self, turn: int) -> int:
        """Whole chunks of a session's prompt at ``turn`` that no other session shares."""
        return self.prompt_tokens(turn) // self.chunk_tokens - self.system_chunks

    @property
    def doc_chunks(self) -> int:
        return self.doc_tokens // self.chunk_tokens


@dataclass(frozen=True)
class Schedule:
    """When sessions start, how long their tools run and how often a one-shot document arrives (planned seconds).

    ``live_sessions``: how many sessions overlap on average; sessions start ``arrival_seconds`` apart, the mean
    length of a session (its pauses) divided by it.
    """

    sessions: int
    turns: int
    live_sessions: float
    pause_min_seconds: float
    pause_max_seconds: float
    doc_interval_seconds: float
    seed: int = 0
    start_seconds: float = 1.0  # the first session's first turn, after the system prompt

    def __post_init__(self):
        if self.sessions < 1 or self.turns < 2:
            raise ValueError(f"need at least 1 session and 2 turns (turns after the first are measured), got "
                             f"{self.sessions} sessions, {self.turns} turns")
        if not 0 < self.pause_min_seconds <= self.pause_max_seconds:
            raise ValueError(f"pauses must satisfy 0 < min <= max, got [{self.pause_min_seconds}, "
                             f"{self.pause_max_seconds}] s")
        if self.live_sessions <= 0 or self.doc_interval_seconds <= 0:
            raise ValueError("live_sessions and doc_interval_seconds must be > 0")

    @property
    def arrival_seconds(self) -> float:
        mean_pause = (self.pause_min_seconds + self.pause_max_seconds) / 2
        return (self.turns - 1) * mean_pause / self.live_sessions


@dataclass(frozen=True)
class PlannedRequest:
    """One request: its planned time, kind (``KINDS``), and which session and turn, or which document, it is."""

    at_seconds: float
    kind: str
    session: int = -1
    turn: int = -1
    doc: int = -1


def plan(schedule: Schedule) -> list[PlannedRequest]:
    """Every request of the run in the order it is sent; the same ``schedule`` (seed included) gives the same list."""
    rng = random.Random(schedule.seed)
    out = [PlannedRequest(0.0, "system")]
    last = 0.0
    for s in range(schedule.sessions):
        at = schedule.start_seconds + s * schedule.arrival_seconds
        for k in range(schedule.turns):
            out.append(PlannedRequest(round(at, 3), "turn", session=s, turn=k))
            last = max(last, at)
            at += rng.uniform(schedule.pause_min_seconds, schedule.pause_max_seconds)
    i = 0
    while (at := schedule.start_seconds + (i + 0.5) * schedule.doc_interval_seconds) < last:
        out.append(PlannedRequest(round(at, 3), "doc", doc=i))
        i += 1
    return sorted(out, key=lambda r: r.at_seconds)  # stable: ties keep the order above


def hint_for(request: PlannedRequest, ttl_seconds: float) -> dict | None:
    """The ``kv_transfer_params`` the hinted system sends with ``request``: the system prompt a high priority and no
    TTL; a session's turns its ``session_id``, a priority above ordinary chunks and a TTL covering the tool's pause;
    a one-shot document none."""
    if request.kind == "system":
        return {"kvtier.priority": SYSTEM_PRIORITY}
    if request.kind == "turn":
        return {"kvtier.session_id": f"agent-{request.session}", "kvtier.priority": SESSION_PRIORITY,
                "kvtier.ttl_seconds": ttl_seconds}
    return None


def protected_peak_chunks(requests: list[PlannedRequest], shape: AgentShape, ttl_seconds: float) -> int:
    """The most chunks the hints protect at once in planned time: the system prompt's whole chunks, and each session's
    own chunks from its first turn until ``ttl_seconds`` after its last (a turn's hint reaches every chunk of its
    prompt). Compare with ``l1_retention_max_share`` of L1: past it, hints are refused."""
    turns = [r for r in requests if r.kind == "turn"]
    last_at = {r.session: r.at_seconds for r in turns}  # turns are in time order: the last one wins
    held: dict[int, int] = {}
    peak = shape.system_chunks
    for r in turns:
        held = {s: n for s, n in held.items() if last_at[s] + ttl_seconds > r.at_seconds}
        held[r.session] = shape.session_chunks(r.turn)
        peak = max(peak, shape.system_chunks + sum(held.values()))
    return peak


def all_sessions_chunks(shape: AgentShape, schedule: Schedule) -> int:
    """Chunks of every session's last prompt together, the shared system prompt once."""
    return shape.system_chunks + schedule.sessions * shape.session_chunks(schedule.turns - 1)


def flood_horizon_seconds(cache_chunks: float, shape: AgentShape, schedule: Schedule) -> float:
    """Planned seconds until the one-shot documents alone have pushed ``cache_chunks`` new chunks through a cache:
    an upper bound on how long an LRU of that size keeps a chunk nobody touches (the sessions' own stores only
    shorten it)."""
    return cache_chunks * schedule.doc_interval_seconds / shape.doc_chunks


def lru_horizon_seconds(cache_chunks: float, requests: list[PlannedRequest], shape: AgentShape) -> float:
    """Planned seconds an LRU of ``cache_chunks`` keeps a chunk nobody touches, on average over the run: its size over
    the chunks stored per second when nothing of a session survives its pause (each document's whole chunks, each
    turn's own chunks)."""
    stored = sum(shape.doc_chunks if r.kind == "doc" else shape.session_chunks(r.turn) if r.kind == "turn" else 0
                 for r in requests)
    return cache_chunks * requests[-1].at_seconds / stored


def prefill_tokens(requests: list[PlannedRequest], shape: AgentShape) -> int:
    """Prompt tokens of every request together: what an engine that reuses nothing computes."""
    per = {"system": lambda r: shape.system_tokens, "doc": lambda r: shape.doc_tokens,
           "turn": lambda r: shape.prompt_tokens(r.turn)}
    return sum(per[r.kind](r) for r in requests)
