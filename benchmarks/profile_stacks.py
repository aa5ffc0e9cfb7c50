"""Sum py-spy's raw collapsed stacks (``py-spy record --format raw``, as ``vllm_bench.py --py-spy`` writes them) by
process, by thread and by the kvtier function a sample is in.

Each line of a raw file is ``frame;frame;...;frame COUNT`` (outermost first; with ``--subprocesses`` the first
frames name the processes). A sample is "in kvtier" when a frame's file is under ``kvtier/``; it is counted once
under its outermost kvtier frame (who called into kvtier) and once under its innermost (where the time went).

    .venv/bin/python benchmarks/profile_stacks.py /tmp/prof/kvtier-prefix_large-vllm.txt [--top 15]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def frames_of(line: str) -> tuple[list[str], int]:
    """``(frames without the process names, samples)`` of one raw line; ``([], 0)`` for a line that is not one."""
    stack, _, count = line.rstrip().rpartition(" ")
    if not count.isdigit():
        return [], 0
    frames = stack.split(";")
    return [f for f in frames if not f.startswith("process ")], int(count)


def summarise(path: Path) -> dict[str, Counter]:
    """Counters of samples: ``process`` (the innermost process name), ``thread`` (a thread's first frame),
    ``kvtier_outer`` / ``kvtier_inner`` (outermost / innermost kvtier frame), ``leaf`` (the frame sampled), and
    ``total`` under the key ``samples`` and ``kvtier``."""
    out = {key: Counter() for key in ("process", "thread", "kvtier_outer", "kvtier_inner", "leaf", "total")}
    for line in path.read_text(errors="replace").splitlines():
        frames, n = frames_of(line)
        if not n:
            continue
        processes = [f for f in line.rpartition(" ")[0].split(";") if f.startswith("process ")]
        out["process"][processes[-1][:80] if processes else "?"] += n
        out["thread"][frames[0][:80] if frames else "?"] += n
        out["leaf"][frames[-1][:100] if frames else "?"] += n
        out["total"]["samples"] += n
        ours = [f for f in frames if "kvtier/" in f]
        if ours:
            out["total"]["kvtier"] += n
            out["kvtier_outer"][ours[0][:100]] += n
            out["kvtier_inner"][ours[-1][:100]] += n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12, help="lines per table")
    args = ap.parse_args()
    for path in args.files:
        got = summarise(path)
        samples = got["total"]["samples"] or 1
        print(f"== {path}: {samples} samples, {got['total']['kvtier']} in kvtier code "
              f"({got['total']['kvtier'] / samples:.1%})")
        for key in ("process", "thread", "kvtier_outer", "kvtier_inner", "leaf"):
            print(f"-- {key}")
            for name, n in got[key].most_common(args.top):
                print(f"{n:8d} {n / samples:6.1%}  {name}")


if __name__ == "__main__":
    main()
