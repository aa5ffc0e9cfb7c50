"""benchmarks/multi_round_qa.py refuses, with exit status 2 and a reason, a configuration it cannot run honestly.

Runs the script as a command (``--plan``: sizes the workload with the real SmolLM2 tokenizer, starts no vLLM).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "multi_round_qa.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--plan", *args], capture_output=True, text=True, timeout=300)


def write_corpus(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def paragraphs(tag: str, n: int) -> str:
    """``n`` distinct paragraphs of real-looking text (about 25 tokens each)."""
    return "\n\n".join(f"Paragraph {i} of {tag}: the licensee may copy and distribute verbatim copies of the "
                       f"program's source code, item {i * 7 + len(tag)}." for i in range(n))


def test_plan_sizes_both_regimes_from_the_working_set():
    proc = run()
    assert proc.returncode == 0, proc.stderr
    ratios = dict(re.findall(r"regime (\w+): .* working set / capacity ([\d.]+)", proc.stdout))
    assert float(ratios["fits"]) <= 1.0
    assert 2.0 <= float(ratios["overflow"]) <= 4.0
    assert re.search(r"working set \d+ tokens", proc.stdout)


def test_refuses_more_text_than_the_corpus_holds(tmp_path):
    corpus = write_corpus(tmp_path / "docs", {"a.txt": paragraphs("a", 10), "b.txt": paragraphs("b", 10)})
    proc = run("--corpus", str(corpus), "--users", "6", "--context-tokens", "200", "--system-tokens", "16")
    assert proc.returncode == 2
    assert "ran out of distinct text" in proc.stderr


def test_copies_of_a_document_add_no_distinct_text(tmp_path):
    # three copies would fill the system prompt and two users; distinct text fills the system prompt and one user
    text = paragraphs("a", 12)
    corpus = write_corpus(tmp_path / "docs", {"a.txt": text, "b.txt": text, "c.txt": text})
    proc = run("--corpus", str(corpus), "--users", "2", "--context-tokens", "250", "--system-tokens", "16")
    assert proc.returncode == 2
    assert "ran out of distinct text" in proc.stderr


def test_refuses_an_overflow_ratio_outside_2_to_4():
    proc = run("--overflow-ratio", "5")
    assert proc.returncode == 2
    assert "outside 2-4" in proc.stderr


def test_refuses_an_overflow_cache_smaller_than_one_request():
    proc = run("--users", "2")
    assert proc.returncode == 2
    assert "less than its longest request needs" in proc.stderr


def test_refuses_a_working_set_larger_than_the_cache_servers_l1():
    proc = run("--users", "40", "--l1-size-gb", "1", "--regimes", "overflow")
    assert proc.returncode == 2
    assert "raise --l1-size-gb" in proc.stderr
