"""What the end-to-end benchmarks share: where their data goes, their refusal, their statistics and their report.

``RESULTS_DIR`` (``benchmarks/results/``) holds the CSV, JSON and trace files the benchmarks write and the
charts read (``charts.py``); charts for the docs go to ``docs/img/``. ``Refused`` is a configuration that would not
measure what a benchmark is about (exit status 2). ``finish`` writes a run's CSV rows and chart, prints the ratios
and what could not be measured, and returns the exit status.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = RESULTS_DIR.parent.parent


class Refused(ValueError):
    """The configuration would not measure what the benchmark is about (exit status 2)."""


def mean(values) -> float | str:
    """The mean rounded to 4 places, or "" for no values (an empty CSV cell)."""
    values = list(values)
    return round(statistics.mean(values), 4) if values else ""


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``sorted_values`` by the nearest-rank method, rounded to 4 places."""
    return round(sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)], 4)


def positive(text: str) -> int:
    """An argparse type: a positive int."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def commit_line() -> str:
    """This tree's commit, and whether ``src/`` has changes, for a run's first line."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return f"commit {git('log', '-1', '--format=%h')}{' (src/ modified)' if git('status', '--porcelain', '--', 'src') else ''}"


def finish(rows: list[dict], absent: dict[str, str], csv_path: Path, chart_path: Path, chart: Callable,
           print_ratios: Callable, started: float) -> int:
    """Write ``rows`` to ``csv_path`` and ``chart(rows, chart_path)``, print the ratios, each system that could
    not be measured (``absent``: name -> why) and the wall time. Returns the exit status: 1 when a system is
    absent or nothing was measured."""
    if rows:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), restval="")
            writer.writeheader()
            writer.writerows(rows)
        chart_path.parent.mkdir(parents=True, exist_ok=True)
        chart(rows, chart_path)
        print_ratios(rows)
        print(f"wrote {csv_path} and {chart_path}")
    for name, why in absent.items():
        print(f"ABSENT: {name}: {why}")
    print(f"wall time {time.monotonic() - started:.0f} s; load average at the end {os.getloadavg()}")
    return 1 if absent or not rows else 0
