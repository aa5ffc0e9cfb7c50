"""Run a benchmark script with another tree's kvtier in the processes it starts: a before/after of any benchmark.

    .venv/bin/python benchmarks/with_src.py OTHER/src benchmarks/reuse_ttft.py --systems kvtier_256 --out F

The script itself and the harness (``kvtier_harness``, which finds the models and starts the servers) run from this
tree; the processes they start, the kvtier server and vLLM with kvtier's connector, get ``OTHER/src`` first on
their ``PYTHONPATH`` and so run the other tree's kvtier (``git archive <commit> src | tar -x -C DIR`` makes one). The
other tree must accept the server flags and connector keys this harness passes (``benchmarks/vllm_bench.py
--baseline-src`` does the same for one system inside a run).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    if len(sys.argv) < 3 or not Path(sys.argv[1], "kvtier").is_dir():
        sys.exit("usage: with_src.py OTHER_SRC SCRIPT [ARGS...]; OTHER_SRC must hold kvtier/ (e.g. from git archive)")
    other, script = Path(sys.argv[1]).resolve(), sys.argv[2]
    sys.path[:0] = [str(REPO / "src"), str(REPO), str(Path(script).resolve().parent)]
    import kvtier.demo.models  # noqa: F401 -- this tree's model paths, imported before the switch
    import kvtier_harness.vllm  # noqa: F401

    os.environ["PYTHONPATH"] = f"{other}:{REPO}"
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
