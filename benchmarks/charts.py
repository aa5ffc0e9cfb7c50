"""Render the charts in docs/img/ from benchmarks/results.json (the figures recorded in RESULTS.md).

    .venv/bin/python benchmarks/charts.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE.parent / "docs" / "img"


def bars(data: dict, title: str, xlabel: str, path: Path, line: float | None = None) -> None:
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(data) + 1.2))
    names, values = list(data), list(data.values())
    ax.barh(names[::-1], values[::-1], color="#4477aa")
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:g}", va="center", fontsize=8)
    if line is not None:
        ax.axvline(line, color="#cc3311", linestyle="--", linewidth=1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    results = json.loads((HERE / "results.json").read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    bars(results["demo_ttft_s"], "SmolLM2-135M on CPU, 2,077-token prompt: time to first token", "seconds",
         OUT / "demo_ttft.png")
    bars(results["l2_restart_retrieve_s"], "2,048-token prefix (90 MiB) into an empty L1 vs cold prefill",
         "seconds", OUT / "l2_restart.png")
    bars(results["ratios_vs_baseline"], "kvtier vs baseline measured in the same run (higher is better)",
         "ratio", OUT / "ratios.png", line=1.0)
    print(f"wrote {OUT}/demo_ttft.png, l2_restart.png, ratios.png")


if __name__ == "__main__":
    main()
