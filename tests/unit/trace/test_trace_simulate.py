"""``kvtier simulate`` over hand-made traces: the hit rates a workload implies, tiers sized past the machine, retention
hints replayed, and bad traces and flags refused naming the line or the choices (issue 19 §3)."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from support.traces import CHUNK_BYTES, common, cycle, header, turn, write_trace

from kvtier.errors import InputError
from kvtier.trace.cli import simulate_cmd
from kvtier.trace.format import TraceError, TraceRecord, encode_line, read_trace
from kvtier.trace.simulate import SimConfig, simulate

POLICIES = ("LRU", "ARC", "S3FIFO")


def prompts(n: int, chunks_each: int) -> list[list[int]]:
    return [[1000 * i + j for j in range(chunks_each)] for i in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_working_set_that_fits_hits_everything_after_the_first_pass(tmp_path, policy):
    trace = write_trace(tmp_path / "fits.trace", cycle(prompts(4, 2), passes=5))
    sim = simulate(trace, [SimConfig(8 * CHUNK_BYTES, policy)])  # exactly the 8 chunks
    out = sim.results[0][1]
    assert out.lookups == 20
    assert out.hit_rate == pytest.approx(16 / 20)  # passes 2..5 hit every token, pass 1 none
    assert out.l1_evicted_chunks == 0 and out.l2_hit_tokens == 0
    assert out.stored_bytes == 8 * CHUNK_BYTES  # stored once


def test_a_cycle_larger_than_l1_never_hits_under_lru(tmp_path):
    trace = write_trace(tmp_path / "cycle.trace", cycle(prompts(5, 1), passes=6))
    out = simulate(trace, [SimConfig(4 * CHUNK_BYTES, "LRU")]).results[0][1]
    assert out.hit_rate == 0.0
    assert out.l1_evicted_chunks == 5 * 6 - 4  # every store but the first four evicts one chunk


def test_an_l2_holds_what_l1_evicts(tmp_path):
    trace = write_trace(tmp_path / "cycle.trace", cycle(prompts(5, 1), passes=6))
    out = simulate(trace, [SimConfig(4 * CHUNK_BYTES, "LRU", 100 * CHUNK_BYTES)]).results[0][1]
    assert out.l1_hit_rate == 0.0  # lookups come before the retrieve that promotes the chunk back
    assert out.l2_hit_rate == pytest.approx(25 / 30)
    assert out.l2_written_bytes == 5 * CHUNK_BYTES and out.promoted_bytes == 25 * CHUNK_BYTES


def test_an_l2_smaller_than_the_cycle_is_evicted_lru(tmp_path):
    trace = write_trace(tmp_path / "cycle.trace", cycle(prompts(5, 1), passes=3))
    out = simulate(trace, [SimConfig(2 * CHUNK_BYTES, "LRU", 3 * CHUNK_BYTES)]).results[0][1]
    assert out.hit_rate == 0.0 and out.l2_evicted_chunks > 0


def test_sizes_larger_than_the_machine_cost_only_bookkeeping(tmp_path):
    trace = write_trace(tmp_path / "fits.trace", cycle(prompts(3, 2), passes=2))
    sim = simulate(trace, [SimConfig(10**15, policy, 10**16) for policy in POLICIES])  # 1 PB of L1, 10 PB of L2
    assert [out.hit_rate for _, out, _ in sim.results] == [pytest.approx(0.5)] * 3


def test_retention_hints_are_replayed(tmp_path):
    # L1 of 4 chunks; the session's chunk is stored with a hint, then 4 others stream through
    records = turn(1.0, [1], session="s:agent", priority=2)
    for i, key in enumerate((11, 12, 13, 14)):
        records += turn(2.0 + i, [key])
    records += turn(10.0, [1])
    plain = turn(1.0, [1]) + records[3:]
    hinted = simulate(write_trace(tmp_path / "h.trace", records), [SimConfig(4 * CHUNK_BYTES, "LRU")]).results[0][1]
    unhinted = simulate(write_trace(tmp_path / "p.trace", plain), [SimConfig(4 * CHUNK_BYTES, "LRU")]).results[0][1]
    assert hinted.l1_hit_tokens == 16 and unhinted.l1_hit_tokens == 0
    # an expired TTL makes the chunk ordinary again: the same stream, with a 0.5 s TTL, loses it
    expired = turn(1.0, [1], session="s:agent", priority=2, ttl_seconds=0.5) + records[3:]
    out = simulate(write_trace(tmp_path / "e.trace", expired), [SimConfig(4 * CHUNK_BYTES, "LRU")]).results[0][1]
    assert out.l1_hit_tokens == 0


def test_leases_hold_slots_until_their_end(tmp_path):
    # a store under a lease is invisible until its end; a retrieve's pins keep a chunk through the pressure of
    # another client's store (LRU would evict it); an aborted store leaves nothing
    records = [*turn(1.0, [1])[:2], TraceRecord(t=1.0, op="store", ticket=1, **common([1]))]
    records += [TraceRecord(t=1.5, op="lookup", hits=[0, 0], **common([1])),
                TraceRecord(t=2.0, op="end", ticket=1),
                TraceRecord(t=2.5, op="retrieve", ticket=2, **common([1])),
                *turn(3.0, [2, 3]),  # a 2-chunk L1: chunk 1 is the LRU victim, but pinned
                TraceRecord(t=4.0, op="end", ticket=2),
                TraceRecord(t=4.5, op="lookup", hits=[0, 0], **common([1])),
                TraceRecord(t=5.0, op="store", ticket=3, **common([9])),
                TraceRecord(t=5.5, op="end", ticket=3, ok=False),
                TraceRecord(t=6.0, op="lookup", hits=[0, 0], **common([9]))]
    out = simulate(write_trace(tmp_path / "leases.trace", records), [SimConfig(2 * CHUNK_BYTES, "LRU")]).results[0][1]
    # lookups: t=1 miss, t=1.5 miss (not committed), t=3 miss ([2, 3]), t=4.5 hit (chunk 1 survived), t=6 miss
    assert out.lookups == 5 and out.l1_hit_tokens == 16
    assert out.stored_bytes == 2 * CHUNK_BYTES  # chunk 1, and chunk 2 of [2, 3] (3 found no unpinned room)


@pytest.mark.parametrize(("medium", "l1_hits", "l2_hits"), [("CPU", 0, 16), ("STORAGE", 16, 0), (None, 0, 0)])
def test_a_clear_is_replayed(tmp_path, medium, l1_hits, l2_hits):
    records = turn(1.0, [1]) + [TraceRecord(t=2.0, op="clear", medium=medium), turn(3.0, [1])[0]]
    out = simulate(write_trace(tmp_path / "c.trace", records), [SimConfig(4 * CHUNK_BYTES, "LRU", 8 * CHUNK_BYTES)])
    assert (out.results[0][1].l1_hit_tokens, out.results[0][1].l2_hit_tokens) == (l1_hits, l2_hits)


def test_a_truncated_trace_names_the_line(tmp_path):
    path = write_trace(tmp_path / "cut.trace", cycle(prompts(2, 2), passes=1))
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # the last record loses its end
    lines = data.count(b"\n")
    with pytest.raises(TraceError, match=f"line {lines} is cut short"):
        simulate(path, [SimConfig(CHUNK_BYTES * 8, "LRU")])


def test_a_damaged_record_names_the_line(tmp_path):
    path = write_trace(tmp_path / "bad.trace", cycle(prompts(2, 2), passes=1))
    lines = path.read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b'"tokens":32', b'"tokens":"many"')
    path.write_bytes(b"\n".join(lines))
    header_, records = read_trace(path)
    with pytest.raises(TraceError, match="line 4: bad record.*tokens"):
        list(records)
    lines = path.read_bytes().split(b"\n")
    lines[3] = re.sub(rb'"t":[0-9.e-]+', b'"t":-5', lines[3])  # before the trace started: damaged
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(TraceError, match="line 4: bad record.*>= 0.*t"):
        list(read_trace(path)[1])


def test_another_version_or_format_is_refused_at_line_1(tmp_path):
    path = tmp_path / "v2.trace"
    h = header()
    h.version = 2
    path.write_bytes(encode_line(h))
    with pytest.raises(TraceError, match="line 1: trace format version 2, this kvtier reads version 1"):
        read_trace(path)
    path.write_text('{"hello": "world"}\n')
    with pytest.raises(TraceError, match="line 1 is not a kvtier trace header"):
        read_trace(path)
    assert issubclass(TraceError, InputError)


def test_cli_prints_a_table_json_and_a_chart(tmp_path):
    trace = write_trace(tmp_path / "fits.trace", cycle(prompts(4, 2), passes=5))
    runner = CliRunner()
    res = runner.invoke(simulate_cmd, ["--trace", str(trace), "--l1-size-gb", "4KB,16KiB,1TB",
                                       "--policy", "lru,ARC,s3-fifo", "--l2-size-gb", "1",
                                       "--chart", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    assert "LRU (traced)" in res.output and "S3FIFO" in res.output and "80.0%" in res.output
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    res = runner.invoke(simulate_cmd, ["--trace", str(trace), "--l1-size-gb", "16KiB", "--json"])
    body = json.loads(res.output)
    assert body["results"][0]["policy"] == "LRU" and body["results"][0]["hit_rate"] == pytest.approx(0.8)
    assert body["trace"]["records"] == 60


def test_cli_refuses_an_unknown_policy_listing_the_choices(tmp_path):
    trace = write_trace(tmp_path / "t.trace", cycle(prompts(1, 1), passes=1))
    res = CliRunner().invoke(simulate_cmd, ["--trace", str(trace), "--policy", "LRU,MRU"])
    assert isinstance(res.exception, InputError)
    assert "'MRU'" in str(res.exception) and "LRU, ARC, S3FIFO" in str(res.exception)
    res = CliRunner().invoke(simulate_cmd, ["--trace", str(trace), "--l1-size-gb", "0"])
    assert isinstance(res.exception, InputError) and "--l1-size-gb" in str(res.exception)


def test_cli_refuses_a_chart_it_could_not_write_before_replaying(tmp_path):
    trace = write_trace(tmp_path / "t.trace", cycle(prompts(1, 1), passes=1))
    for chart, says in ((tmp_path / "c.txt", "ending in .png"), (tmp_path / "none" / "c.png", "does not exist")):
        res = CliRunner().invoke(simulate_cmd, ["--trace", str(trace), "--chart", str(chart)])
        assert res.exit_code == 2 and "--chart" in res.output and says in res.output, res.output
        assert "requests" not in res.output  # refused before the replay, no table printed
