"""``--plot``: a per-role timeline (Gantt) of the phases over steps and a histogram of response lengths.

matplotlib with the Agg backend (no display needed); the PNG is ``WIDTH_PX`` x ``HEIGHT_PX``.
"""

from __future__ import annotations

import os
from typing import Sequence

from rlplacement.telemetry import quantile

WIDTH_PX, HEIGHT_PX, DPI = 1200, 800, 100
PHASE_COLORS = {"rollout": "tab:blue", "sync": "tab:orange", "train": "tab:green"}
ROLE_ROWS = ("trainer", "rollout")


def plot(rows: Sequence[dict], path: str | os.PathLike, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (gantt, hist) = plt.subplots(2, 1, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI,
                                      gridspec_kw={"height_ratios": [1, 1.3]})
    try:
        _gantt(gantt, rows)
        _histogram(hist, rows)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": it would change the promised size
    finally:
        plt.close(fig)


def _gantt(ax, rows: Sequence[dict]) -> None:
    seen = set()
    for row in rows:
        timeline = row.get("timeline") or {}
        for role, phase, start, end in timeline.get("intervals", []):
            y = ROLE_ROWS.index(role)
            label = phase if phase not in seen else None
            seen.add(phase)
            ax.broken_barh([(start, end - start)], (y - 0.35, 0.7), color=PHASE_COLORS.get(phase, "grey"),
                           label=label, edgecolor="black", linewidth=0.3)
        if "step_end" in timeline:
            ax.axvline(timeline["step_end"], color="black", linestyle=":", linewidth=0.8)
    if not seen:
        ax.text(0.5, 0.5, "no timeline in the telemetry", ha="center", va="center", transform=ax.transAxes)
    ax.set_yticks(range(len(ROLE_ROWS)), ROLE_ROWS)
    ax.set_xlabel("seconds since the first step began (dotted: step ends)")
    ax.set_title("phases per role over steps (gaps are waits)", loc="left")
    if seen:
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize="small", frameon=False)


def _histogram(ax, rows: Sequence[dict]) -> None:
    lengths = [int(x) for r in rows for x in (r.get("rollout/response_lengths") or [])]
    if not lengths:
        ax.text(0.5, 0.5, "no response lengths in the telemetry", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(lengths, bins=min(50, max(5, len(set(lengths)))), color="tab:blue", alpha=0.8)
    for q, style in ((0.5, "--"), (0.99, "-")):
        v = quantile(lengths, q)
        ax.axvline(v, color="red", linestyle=style, label=f"p{int(q * 100)} = {v:.0f}")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(f"response lengths over {len(rows)} step(s), {len(lengths)} samples")
    ax.legend(loc="upper right")
