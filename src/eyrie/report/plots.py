"""The page's plots: matplotlib figures of the collected numbers, returned as inline SVG markup.

Each plot is drawn from the plain dict the collectors return (nothing is read from disk here)
and is None when there is nothing to draw. Figures are bound to the Agg canvas directly, with
no pyplot and no global backend switch, and saved as SVG whose text stays text, so the page
stays one self-contained file that needs no network.
"""

from __future__ import annotations

import io
import re
from typing import Any

import matplotlib
import numpy as np
from markupsafe import Markup
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def draw(figures: dict[str, Any]) -> dict[str, Markup | None]:
    """Every plot the template places, by name, from the figures `collect` returned."""
    regeneration = figures["regeneration"]
    drafter = figures["drafter"] or {}
    measured = [b for b in figures["bench"]["rows"] if b["built"] and b["measured"]]
    return {
        "tokens_per_second": _tokens_per_second_plot(regeneration["shards"]),
        "turn_lengths": _turn_length_plot(regeneration["datasets"]),
        "vocab_coverage": _coverage_plot(figures["vocab"]),
        "training": _training_plot(drafter.get("log")),
        "bench_acceptance": _acceptance_plot(measured),
        "bench_positions": _positions_plot(measured),
        "bench_throughput": _throughput_plot(measured),
        "bench_concurrency": {b["anchor"]: _concurrency_plot(b["concurrency"]) for b in figures["bench"]["rows"] if b.get("concurrency")},
    }


def _coverage_plot(vocab: dict | None) -> Markup | None:
    curve = (vocab or {}).get("curve")
    if not curve:
        return None
    fig = _figure(6.0, 2.8)
    ax = fig.add_subplot()
    ax.plot(curve["sizes"], [c * 100 for c in curve["coverage"]], color="C0")
    size, coverage = vocab["draft_vocab_size"], vocab["coverage"]
    if isinstance(size, int) and coverage is not None:
        ax.axvline(size, color="#b00", linestyle="--", linewidth=1)
        ax.plot([size], [coverage * 100], "o", color="#b00")
        ax.text(0.98, 0.06, f"draft vocabulary {size:,}: {coverage * 100:.1f}% covered", transform=ax.transAxes,
                ha="right", va="bottom", fontsize=8, color="#b00", bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    log_scale = curve["distinct"] > 10
    if log_scale:
        ax.set_xscale("log")
    ax.set_xlim(1, max(curve["distinct"], 2) * (1.3 if log_scale else 1.05))  # room to see the line at the last size
    ax.set_ylim(0, 101)
    ax.set_xlabel("draft vocabulary size (most frequent assistant tokens)")
    ax.set_ylabel("assistant tokens covered (%)")
    ax.grid(alpha=0.3)
    return _svg(fig)


def _training_plot(log: dict | None) -> Markup | None:
    if not log or not log["step"]:
        return None
    marker = "o" if log["shown"] <= 12 else None
    steps = log["step"]
    n = len(log["loss_per_step"])
    colours = [matplotlib.colormaps["viridis"](j / max(n - 1, 1) * 0.9) for j in range(n)]
    fig = _figure(10.5, 3.4)
    loss_ax, acc_ax = fig.subplots(1, 2)
    for j, values in enumerate(log["loss_per_step"]):
        loss_ax.plot(steps, _nan(values), color=colours[j], linewidth=1, marker=marker, markersize=3, label=f"step {j}")
    loss_ax.plot(steps, _nan(log["loss"]), color="#222", linewidth=2, marker=marker, markersize=3, label="total (weighted)")
    finite = [v for v in log["loss"] + [x for values in log["loss_per_step"] for x in values] if v is not None and v > 0]
    if finite and max(finite) / min(finite) > 20:  # early losses dwarf the rest: a log scale keeps the tail readable
        loss_ax.set_yscale("log")
    loss_ax.set_title("loss", fontsize=10, loc="left")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.grid(alpha=0.3)
    for j, values in enumerate(log["acc_per_step"]):
        acc_ax.plot(steps, [v * 100 if v is not None else np.nan for v in values], color=colours[j], linewidth=1, marker=marker, markersize=3, label=f"step {j}")
    acc_ax.set_title("accuracy per TTT step (%)", fontsize=10, loc="left")
    acc_ax.set_xlabel("optimizer step")
    acc_ax.set_ylim(0, 100)
    acc_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=7, ncol=2)
    for ax in (loss_ax, acc_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _svg(fig)


def _bench_labels(rows: list[dict]) -> list[str]:
    return [f"{r['name']}\n(error)" if r["error"] else r["name"] for r in rows]


def _acceptance_plot(rows: list[dict]) -> Markup | None:
    if not rows:
        return None
    fig = _figure(min(max(3.6, 0.9 * len(rows) + 1.6), 7.0), 2.9)
    ax = fig.add_subplot()
    values = [r["mean_acceptance_length"] for r in rows]
    bars = ax.bar(range(len(rows)), values, color=["#c62828" if r["error"] else "C0" for r in rows], width=0.6)
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8, padding=2)
    ax.axhline(1.0, color="#666", linestyle=":", linewidth=1)
    top = max(max(values), max(1 + (r["draft_tokens"] or 0) for r in rows))
    ax.set_ylim(0, top * 1.08)
    ax.set_xticks(range(len(rows)), _bench_labels(rows), fontsize=8)
    ax.set_ylabel("mean acceptance length\n(tokens per target forward)", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)


def _positions_plot(rows: list[dict]) -> Markup | None:
    drawn = [r for r in rows if r["acceptance_rate_per_position"]]
    if not drawn:
        return None
    fig = _figure(3.8, 2.9)
    ax = fig.add_subplot()
    for i, row in enumerate(drawn):
        rates = row["acceptance_rate_per_position"]
        ax.plot(range(1, len(rates) + 1), [r * 100 if r is not None else np.nan for r in rates], marker="o", markersize=4,
                color=f"C{i % 10}", linestyle="--" if row["error"] else "-", label=row["name"] + (" (error)" if row["error"] else ""))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted (% of rounds)", fontsize=8)
    ax.set_ylim(0, 100)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _svg(fig)


def _throughput_plot(rows: list[dict]) -> Markup | None:
    if not rows:
        return None
    fig = _figure(min(max(3.8, 1.2 * len(rows) + 1.6), 7.0), 2.9)
    ax = fig.add_subplot()
    x = np.arange(len(rows))
    greedy = [r["greedy_tokens_per_s"] or 0.0 for r in rows]
    spec = [r["spec_tokens_per_s"] or 0.0 for r in rows]
    ax.bar(x - 0.2, greedy, width=0.4, color="#9e9e9e", label="plain greedy")
    bars = ax.bar(x + 0.2, spec, width=0.4, color="C0", label="speculative")
    ax.bar_label(bars, labels=[f"{r['speedup']:.2f}×" if r["speedup"] is not None else "" for r in rows], fontsize=8, padding=2)
    ax.set_ylim(0, max(greedy + spec + [1e-9]) * 1.18)
    ax.set_xticks(x, _bench_labels(rows), fontsize=8)
    ax.set_ylabel("new tokens / s", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)


def _concurrency_plot(concurrency: dict) -> Markup | None:
    """Speedup over batched greedy against B (log x), one line per setting; hollow markers where it was not lossless."""
    curves = [c for c in concurrency["curves"] if any(p["speedup"] is not None for p in c["points"])]
    if not curves:
        return None
    fig = _figure(5.2, 3.0)
    ax = fig.add_subplot()
    for i, curve in enumerate(curves):
        points = [p for p in curve["points"] if p["speedup"] is not None]
        colour = f"C{i % 10}"
        ax.plot([p["batch"] for p in points], [p["speedup"] for p in points], color=colour, marker="o", markersize=4, label=curve["label"])
        lossy = [p for p in points if p["lossless"] is False]
        if lossy:
            ax.plot([p["batch"] for p in lossy], [p["speedup"] for p in lossy], "o", markersize=8, markerfacecolor="white", color=colour)
    ax.axhline(1.0, color="#666", linestyle=":", linewidth=1, label="batched greedy")
    ax.set_xscale("log", base=2)
    batches = concurrency["batches"]
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests B")
    ax.set_ylabel("speedup over batched greedy", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _svg(fig)


def _nan(values: list) -> list[float]:
    return [np.nan if v is None else v for v in values]


def _tokens_per_second_plot(shards: list[dict]) -> Markup | None:
    if not shards:
        return None
    names = sorted({s["dataset"] for s in shards}, key=[s["dataset"] for s in shards].index)
    colours = {n: f"C{i % 10}" for i, n in enumerate(names)}
    fig = _figure(min(max(4.0, 0.45 * len(shards) + 2.0), 11.0), 2.8)
    ax = fig.add_subplot()
    heights = [s["tokens_per_second"] or 0.0 for s in shards]
    ax.bar(range(len(shards)), heights, color=[colours[s["dataset"]] for s in shards])
    for x, shard in enumerate(shards):
        if shard["tokens_per_second"] is None:
            ax.annotate("empty", (x, 0), ha="center", va="bottom", fontsize=8, color="#666")
    ax.set_xticks(range(len(shards)), [f"{s['dataset']}/{s['shard']}" for s in shards], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("completion tokens / s")
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)


def _turn_length_plot(datasets: list[dict]) -> Markup | None:
    drawn = [d for d in datasets if d["histogram"]["counts"]]
    if not drawn:
        return None
    fig = _figure(7.0, 1.2 + 1.6 * len(drawn))
    for i, dataset in enumerate(drawn):
        ax = fig.add_subplot(len(drawn), 1, i + 1)
        histogram = dataset["histogram"]
        ax.stairs(histogram["counts"], histogram["edges"], fill=True, color=f"C{i % 10}", alpha=0.8)
        if isinstance(histogram["cap"], int):
            ax.axvline(histogram["cap"], color="#b00", linestyle="--", linewidth=1, label="max_new_tokens")
            ax.legend(fontsize=7, loc="upper center")
        ax.set_title(dataset["name"], fontsize=9, loc="left")
        ax.set_ylabel("turns", fontsize=8)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of turns are whole numbers
    ax.set_xlabel("completion tokens per turn")
    return _svg(fig)


def _figure(width: float, height: float) -> Figure:
    """A figure bound to the Agg canvas directly: no pyplot, no global backend switch, no display."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _svg(fig: Figure) -> Markup:
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: smaller, and uses the page font
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and DOCTYPE, invalid inside HTML
    return Markup(re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S))
