"""``kvtier simulate``: replay a server's trace at other L1 / L2 sizes and policies; a table, a chart, JSON.

Bad input (a size that does not parse, an unknown policy, a trace that is truncated or of another version) raises
an InputError / ConfigError naming what was wrong; ``kvtier.cli.main`` prints it as one ``error: ...`` line, exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvtier.errors import ConfigError, InputError
from kvtier.l1.policies import POLICIES, make_policy
from kvtier.trace.format import read_trace
from kvtier.trace.simulate import SimConfig, Simulation, simulate
from kvtier.units import GB, parse_size


MIN_SIZE_BYTES = 64


def _sizes(value: str, flag: str) -> list[float]:
    """Comma-separated sizes (GB unless a unit is given: '512MiB'); every one > 0."""
    out = []
    for part in value.split(","):
        part = part.strip()
        try:
            size = parse_size(part)
        except ConfigError as exc:
            raise InputError(f"{flag}: {exc}") from None
        if size <= 0:
            hint = " (leave --l2-size-gb out for no L2)" if flag == "--l2-size-gb" else ""
            raise InputError(f"{flag}: sizes must be > 0, got {part!r}{hint}")
        if round(size * GB) < MIN_SIZE_BYTES:  # the arena's floor; a chunk is far larger anyway
            raise InputError(f"{flag}: {part!r} is {round(size * GB)} bytes; give at least {MIN_SIZE_BYTES} bytes "
                             "(e.g. 64KB, 1GB)")
        out.append(size)
    return out


def _policies(value: str) -> list[str]:
    out = []
    for part in value.split(","):
        try:
            out.append(make_policy(part.strip()).name)
        except ConfigError:
            raise InputError(f"--policy: unknown eviction policy {part.strip()!r}; valid: {', '.join(POLICIES)}") \
                from None
    return out


@click.command()
@click.option("--trace", "trace_path", required=True, type=click.Path(dir_okay=False),
              help="A trace recorded by kvtier server --trace-file.")
@click.option("--l1-size-gb", default=None,
              help="L1 sizes to simulate, comma-separated, e.g. 1,2,4,8 or 512MiB,1GiB [default: the traced server's].")
@click.option("--policy", default=None,
              help=f"L1 eviction policies, comma-separated, of {', '.join(POLICIES)} [default: the traced server's].")
@click.option("--l2-size-gb", default=None,
              help="L2 (local-disk LRU) sizes, comma-separated [default: no L2].")
@click.option("--chart", type=click.Path(dir_okay=False), default=None,
              help="Write a chart (hit rate vs L1 size, one line per policy and L2 size) to this PNG (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
def simulate_cmd(trace_path, l1_size_gb, policy, l2_size_gb, chart, as_json) -> None:
    """Replay a trace through kvtier's own L1 and L2 eviction code at every combination of the sizes and policies
    given, and print the hit rate and bytes per tier of each (sizes larger than this machine are fine)."""
    if chart:
        _check_chart(chart)  # before a replay that may take minutes
    header, _ = read_trace(trace_path)  # a bad header is reported before anything else is parsed
    l1_sizes = _sizes(l1_size_gb, "--l1-size-gb") if l1_size_gb else [header.l1_size_bytes / GB]
    policies = _policies(policy) if policy else [header.eviction_policy]
    l2_sizes = _sizes(l2_size_gb, "--l2-size-gb") if l2_size_gb else [None]
    configs = [SimConfig(round(l1 * GB), p, None if l2 is None else round(l2 * GB))
               for p in policies for l2 in l2_sizes for l1 in l1_sizes]
    sim = simulate(trace_path, configs)
    if as_json:
        json.dump(sim.as_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _table(sim)
    if chart:
        write_chart(sim, chart)
        if not as_json:
            click.echo(f"chart: {chart}")


CHART_SUFFIXES = (".png", ".svg", ".pdf")


def _check_chart(path: str) -> None:
    """Raise click.BadParameter when matplotlib could not write ``path``: another format, no such folder."""
    target = Path(path)
    if target.suffix.lower() not in CHART_SUFFIXES:
        raise click.BadParameter(f"{path!r}: the chart is written as PNG (or SVG, PDF); name a file ending in "
                                 f"{', '.join(CHART_SUFFIXES)}", param_hint="--chart")
    if not target.absolute().parent.is_dir():
        raise click.BadParameter(f"{path!r}: the folder {str(target.absolute().parent)!r} does not exist",
                                 param_hint="--chart")


def _gb(nbytes: int | None) -> str:
    """A byte count in decimal units (``1.5 GB``, ``64 KB``); "-" for None."""
    if nbytes is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def _table(sim: Simulation) -> None:
    from rich.console import Console
    from rich.table import Table

    h = sim.header
    table = Table(title=f"kvtier simulate: {sim.requests:,} requests ({sim.records:,} records), chunk {h.chunk_size} "
                        f"tokens ({sim.seconds:.1f} s, {sim.requests * len(sim.results) / max(sim.seconds, 1e-9):,.0f} "
                        "requests/s over all configurations)")
    for col in ("policy", "L1", "L2", "hit rate", "L1 hit", "L2 hit", "L1 hit bytes", "L2 hit bytes", "stored",
                "L2 written", "L1 evicted", "L2 evicted"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    traced = sim.traced
    l2_cap = h.l2[0].get("capacity_bytes") if h.l2 else None
    table.add_row(f"{h.eviction_policy} (traced)", _gb(h.l1_size_bytes), _gb(l2_cap) if h.l2 else "-",
                  f"{traced.hit_rate:.1%}", f"{traced.l1_hit_rate:.1%}", f"{traced.l2_hit_rate:.1%}",
                  _gb(traced.l1_hit_bytes), _gb(traced.l2_hit_bytes), "", "", "", "", end_section=True)
    for cfg, out, _ in sim.results:
        table.add_row(cfg.policy, _gb(cfg.l1_size_bytes), _gb(cfg.l2_size_bytes), f"{out.hit_rate:.1%}",
                      f"{out.l1_hit_rate:.1%}", f"{out.l2_hit_rate:.1%}", _gb(out.l1_hit_bytes), _gb(out.l2_hit_bytes),
                      _gb(out.stored_bytes), _gb(out.l2_written_bytes) if cfg.l2_size_bytes else "-",
                      f"{out.l1_evicted_chunks:,}", f"{out.l2_evicted_chunks:,}" if cfg.l2_size_bytes else "-")
    Console(width=160).print(table)


def write_chart(sim: Simulation, path: str) -> None:
    """Hit rate (L1 + L2, %) against L1 size, one line per policy (and L2 size), to the PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--chart needs matplotlib: pip install matplotlib") from None
    lines: dict[tuple, list[tuple[float, float]]] = {}
    for cfg, out, _ in sim.results:
        lines.setdefault((cfg.policy, cfg.l2_size_bytes), []).append((cfg.l1_size_bytes / GB, 100 * out.hit_rate))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (policy, l2), points in lines.items():
        points.sort()
        label = policy if l2 is None else f"{policy}, L2 {l2 / GB:g} GB"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if len({p[0] for pts in lines.values() for p in pts}) > 2:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("L1 size (GB)")
    ax.set_ylabel("hit rate (% of looked-up tokens)")
    ax.set_ylim(0, 100)
    ax.set_title(f"kvtier simulate: {sim.requests:,} requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
