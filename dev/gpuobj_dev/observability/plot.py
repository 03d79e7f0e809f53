"""A PNG of stored, NIXL-registered and leaked bytes over time, read back from Prometheus.

Why: the demo and reports show that memory goes back to zero; a picture of the series
Prometheus actually scraped is the evidence, with no Grafana needed. matplotlib's
object API with the Agg canvas: no display, no pyplot global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gpuobj_contract import metric_names as m
from gpuobj_dev.observability import queries as q

MIB = 1024 * 1024

# (legend, PromQL, colour): one line each.
SERIES: tuple[tuple[str, str, str], ...] = (
    ("stored (agents)", f"sum({m.AGENT_STORE_BYTES})", "tab:blue"),
    ("NIXL-registered (agents)", f"sum({m.AGENT_NIXL_REGISTERED_BYTES})", "tab:green"),
    ("leaked (operator audit)", f"sum({q.LEAKED_BY_POD})", "tab:red"),
)

# Alternating shades of the phase spans: warm greys no line, grid or text of the plot uses.
PHASE_COLOURS = ("#f5f2e6", "#e6e0c8")


class RangeQuerier(Protocol):
    """What the plot needs from Prometheus (gpuobj_dev.testing.prometheus.Prometheus fits)."""

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]: ...


def plot_bytes(
    prom: RangeQuerier,
    start: float,
    end: float,
    path: Path | str,
    step: float | None = None,
    title: str = "gpuobj: bytes held by agents",
    phases: Sequence[tuple[str, float, float]] = (),
) -> Path:
    """Range-query SERIES over [start, end] (unix seconds) and write a PNG to ``path``; returns the path.

    ``phases``: (label, start, end) spans shaded and labelled under the lines, so a reader sees which
    step of a run each rise and fall of the bytes belongs to.
    """
    step = step or max(1.0, (end - start) / 500)
    fig = Figure(figsize=(9, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (label, phase_start, phase_end) in enumerate(phases):
        left, right = phase_start - start, phase_end - start
        ax.axvspan(left, right, color=PHASE_COLOURS[i % 2], zorder=0, linewidth=0)
        ax.text(
            (left + right) / 2, 0.98, label, transform=ax.get_xaxis_transform(),
            ha="center", va="top", fontsize=8, color="0.3", rotation=90 if right - left < (end - start) / 12 else 0,
        )  # fmt: skip
    plotted = 0
    for label, expr, colour in SERIES:
        for series in prom.query_range(expr, start, end, step):
            xs = [float(t) - start for t, _ in series["values"]]
            ys = [float(v) / MIB for _, v in series["values"]]
            # Registered normally equals stored: dashed over a wider stored line keeps both visible.
            dashed = label.startswith("NIXL")
            ax.plot(
                xs,
                ys,
                "--" if dashed else "-",
                color=colour,
                label=label,
                linewidth=1.6 if dashed else 2.6,
                drawstyle="steps-post",
            )
            plotted += 1
    if not plotted:
        ax.text(0.5, 0.5, "no data in range", transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_title(title)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("MiB")
    ax.set_xlim(0, max(end - start, step))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if plotted:  # under the axes: the phase labels run along the top
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=len(SERIES), frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
