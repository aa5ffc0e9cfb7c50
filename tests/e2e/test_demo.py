"""``kvtier demo`` end to end: the real model, a real second process, the JSON summary."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kvtier.blend import DEFAULT_FRACTION
from kvtier.demo.rag import RAG_QUESTIONS
from kvtier.demo.run import find_document
from kvtier.errors import KVTierError

FIELDS = ("cold_ttft_seconds", "warm_ttft_seconds", "cross_process_ttft_seconds", "num_prompt_tokens", "num_hit_tokens",
          "outputs_identical")


@pytest.mark.model
def test_demo_json_reuses_the_document_in_process_and_across_processes():
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--json", "--rounds", "2", "--max-new-tokens", "8"],
                          check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == set(FIELDS)
    assert summary["outputs_identical"] is True
    assert summary["num_prompt_tokens"] >= 2000
    # every full chunk of the shared document prefix is reused (chunk size 256)
    assert 0 < summary["num_hit_tokens"] <= summary["num_prompt_tokens"] - 1
    assert summary["num_hit_tokens"] % 256 == 0 and summary["num_hit_tokens"] >= summary["num_prompt_tokens"] - 256
    for key in ("cold_ttft_seconds", "warm_ttft_seconds", "cross_process_ttft_seconds"):
        assert isinstance(summary[key], float) and summary[key] > 0


def test_demo_with_a_missing_document_says_what_to_do(tmp_path):
    missing = tmp_path / "nothing.txt"
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--document", str(missing)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--document" in proc.stderr and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_default_document_is_a_clear_error(tmp_path):
    with pytest.raises(KVTierError, match="pass --document"):
        find_document(None, defaults=[tmp_path / "GPL-3"])
    empty = tmp_path / "empty.txt"
    empty.write_text("x")
    assert find_document(str(empty)) == empty


def test_events_need_the_in_process_cache():
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--events", "--server", "tcp://127.0.0.1:1"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--server off" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("size, said", [("0", "must be positive"), ("abc", "cannot parse size")])
def test_a_bad_l1_size_stops_the_demo_before_the_model_loads(size, said):
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--server", "off", f"--l1-size-gb={size}"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr
    assert "SmolLM2" not in proc.stderr and "round 1" not in proc.stderr  # nothing was loaded or run


RAG_FIELDS = ("num_documents", "num_questions", "fraction", "cold_ttft_seconds", "prefix_ttft_seconds",
              "blend_ttft_seconds", "prefix_hit_rate", "blend_hit_rate", "blend_recomputed_share",
              "prefix_answers_identical", "blend_answers_identical", "blend_first_tokens_same", "blend_forced_top1",
              "blended")


@pytest.mark.model
def test_demo_rag_json_answers_cold_prefix_only_and_blended():
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--rag", "--json", "--documents", "3", "--questions",
                           "2", "--max-document-tokens", "96", "--chunk-size", "32", "--max-new-tokens", "4",
                           "--server", "off"], check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == set(RAG_FIELDS)
    assert summary["blended"] is True and summary["num_questions"] == 2 and summary["fraction"] == DEFAULT_FRACTION
    assert summary["prefix_answers_identical"] == 2  # prefix reuse is exact
    # every document is reused wherever it stands, not only the prompt's leading chunks
    assert summary["blend_hit_rate"] > summary["prefix_hit_rate"] > 0
    assert 0 < summary["blend_recomputed_share"] < 0.5
    assert 0 <= summary["blend_first_tokens_same"] <= 2 and 0 < summary["blend_forced_top1"] <= 1
    for key in ("cold_ttft_seconds", "prefix_ttft_seconds", "blend_ttft_seconds"):
        assert isinstance(summary[key], float) and summary[key] > 0


@pytest.mark.parametrize("args, said", [
    (["--document", "/usr/share/common-licenses/GPL-3"], "--rag picks its own documents"),
    (["--documents", "100000"], "only"),
    (["--fraction", "1.5"], "1.5"),
])
def test_demo_rag_bad_input_stops_before_the_model_loads(args, said):
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--rag", "--server", "off", *args],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "SmolLM2" not in proc.stderr and "ingesting" not in proc.stderr


@pytest.mark.model
def test_demo_rag_prints_each_question_with_its_answers_and_what_blending_trades_in_100_columns():
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--rag", "--documents", "3", "--questions", "2",
                           "--max-document-tokens", "96", "--chunk-size", "32", "--max-new-tokens", "6",
                           "--server", "off"], check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 100
    for i, question in enumerate(RAG_QUESTIONS[:2]):
        at = next(n for n, line in enumerate(lines) if line.startswith(f"Q{i + 1} (documents ") and question in line)
        assert [line.split(":")[0].strip() for line in lines[at + 1:at + 4]] == ["cold", "prefix-only", "blended"]
    trade = " ".join(lines[next(n for n, line in enumerate(lines) if line.startswith("Blending trades")):])
    assert "teacher-forced top-1" in trade and "identical" in trade and re.search(r"matched cold in \d/2", trade)
