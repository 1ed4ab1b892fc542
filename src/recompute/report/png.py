"""``write_pngs``: the report's main charts as PNG files (matplotlib), for READMEs and papers.

Draws the chosen model under the report's attention mode from the same ``Report`` the page embeds. Uses
matplotlib's object API (``Figure`` with the Agg canvas), so no global backend is switched and no window opens.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recompute.core.errors import ConfigError
from recompute.core.table import GiB
from recompute.report.data import Report

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["COLORS", "write_pngs"]

COLORS = {
    "parameters": "#8da0cb",
    "gradients": "#a6b8de",
    "optimizer": "#c7d3ec",
    "outside": "#b3b3b3",
    "checkpoints": "#ffd92f",
    "norms": "#fc8d62",
    "mlp": "#66c2a5",
    "attention": "#2f6fde",
}
"""Component colours, the same as the page's."""
POLICY_COLORS = {
    "none": "#444444",
    "core_attn": "#1b9e77",
    "attn": "#2f6fde",
    "mlp": "#66a61e",
    "attn+mlp": "#7570b3",
    "block": "#d95f02",
}


def _seq_label(s: int) -> str:
    return f"{s // 1024}K" if s >= 1024 else str(s)


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=120, layout="constrained")


def _memory(report: Report, attention: str) -> Figure:
    series = report.models[report.model]
    fig = _figure(15, 8)
    axes = fig.subplots(2, 3).ravel()
    x = range(len(series.seq_lens))
    for ax, (policy, mem) in zip(axes, series.memory[attention].items()):
        bottom = [0.0] * len(series.seq_lens)
        for key, label in report.components.items():
            values = [v / GiB for v in mem.components[key]]
            ax.bar(x, values, bottom=bottom, color=COLORS[key], label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.scatter(x, [p / GiB for p in mem.peak], marker="D", color="#111", s=18, label="predicted peak", zorder=3)
        ax.axhline(report.gpu.memory / GiB, color="#c0392b", ls="--", lw=1.2, label=f"{report.gpu.name} memory")
        ax.axhline(report.gpu.usable / GiB, color="#c0392b", ls=":", lw=1.2, label="usable")
        _axes(ax, f"policy {policy}", series.seq_lens, "GiB per GPU")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=6, fontsize=9)
    fig.suptitle(f"Training memory by component: {series.name}, {attention} attention")
    return fig


def _axes(ax: Axes, title: str, seq_lens: list[int], ylabel: str) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xticks(range(len(seq_lens)), [_seq_label(s) for s in seq_lens])
    ax.set_xlabel("sequence length")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def _overhead(report: Report) -> Figure:
    series = report.models[report.model]
    fig = _figure(8, 5)
    ax = fig.subplots()
    for policy, values in series.overhead.items():
        ax.plot([100 * v for v in values], marker="o", color=POLICY_COLORS.get(policy), label=policy)
    _axes(ax, f"Compute overhead of recomputation: {series.name}", series.seq_lens, "recompute / model FLOPs (%)")
    ax.legend(fontsize=9)
    return fig


def _attention(report: Report) -> Figure:
    series = report.models[report.model]
    fig = _figure(8, 5)
    ax = fig.subplots()
    for attention, color in (("eager", "#e7298a"), ("flash", "#1b9e77")):
        values = series.memory[attention]["none"].components["attention"]
        ax.plot([v / GiB for v in values], marker="o", color=color, label=f"{attention} attention")
    mlp = series.memory["eager"]["none"].components["mlp"]
    ax.plot([v / GiB for v in mlp], ls=":", color="#999", label="MLP term (either)")
    ax.set_yscale("log")
    _axes(ax, f"Attention activations of all layers: {series.name}", series.seq_lens, "GiB (log)")
    ax.legend(fontsize=9)
    return fig


def _frontier(plan: dict[str, Any]) -> Figure:
    fig = _figure(8, 5)
    ax = fig.subplots()
    points = plan["frontier"]
    ax.step([p["peak"] / GiB for p in points], [100 * p["overhead"] for p in points], where="post", marker=".")
    for name, p in plan["uniform"].items():
        ax.annotate(name, (p["peak"] / GiB, 100 * p["overhead"]), fontsize=8, color="#555")
        ax.scatter([p["peak"] / GiB], [100 * p["overhead"]], color="#999", s=16)
    chosen = plan["chosen"]
    ax.scatter([chosen["peak"] / GiB], [100 * chosen["overhead"]], marker="*", s=180, color="#d95f02", label="the plan")
    if plan["budget"] > 0:
        ax.axvline(plan["budget"] / GiB, color="#c0392b", ls="--", label="budget")
    ax.set(xlabel="predicted peak (GiB)", ylabel="recompute overhead (%)", title=f"Plan frontier: {plan['model']}")
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    return fig


def write_pngs(report: Report, directory: Path, *, attention: str | None = None) -> list[Path]:
    """Write ``memory-MODEL.png``, ``overhead-MODEL.png``, ``attention-MODEL.png`` (and ``plan-MODEL.png``
    with a plan section) into ``directory``, creating it; return the paths written.

    Raises:
        ConfigError: the directory cannot be created or written.
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    name = re.sub(r"[^A-Za-z0-9._-]+", "_", report.model)
    figures = {
        "memory": _memory(report, attention or str(report.workload["attention"])),
        "overhead": _overhead(report),
        "attention": _attention(report),
    }
    if "plan" in report.sections:
        figures["plan"] = _frontier(report.sections["plan"])
    written = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for kind, fig in figures.items():
            path = directory / f"{kind}-{name}.png"
            FigureCanvasAgg(fig).print_png(str(path))
            written.append(path)
    except OSError as e:
        raise ConfigError(
            f"cannot write PNGs into {str(directory)!r}: {e.strerror}; pass --png a writable folder"
        ) from e
    return written
