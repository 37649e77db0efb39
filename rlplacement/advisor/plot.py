"""``--plot``: a per-role timeline (Gantt) of the phases over steps and a histogram of response lengths.

matplotlib with the Agg backend (no display needed); the PNG is ``WIDTH_PX`` x ``HEIGHT_PX``. Both
panels draw the steps the advice is measured on: the ``skip_steps`` warm-up steps are left out (a
first step that loads the model and compiles can take most of the time axis and squeeze the steady
steps into a sliver), unless only warm-up steps exist, as :func:`~rlplacement.advisor.measure.measure`
does. The time axis starts where the first drawn step began; a phase that began earlier (a one-step-off
rollout dispatched during the step before) is drawn from the axis' start.
"""

from __future__ import annotations

import os
from typing import Sequence

from rlplacement.telemetry import quantile

WIDTH_PX, HEIGHT_PX, DPI = 1200, 800, 100
PHASE_COLORS = {"rollout": "tab:blue", "sync": "tab:orange", "train": "tab:green"}
ROLE_ROWS = ("trainer", "rollout")


def drawn_rows(rows: Sequence[dict], skip_steps: int) -> list[dict]:
    """The rows drawn: after the warm-up, or every row when nothing follows it (the measurement's rule)."""
    return list(rows[skip_steps:]) if len(rows) > skip_steps else list(rows)


def figure(rows: Sequence[dict], title: str = "", skip_steps: int = 1):
    """The figure (caller closes it): ``rows`` less the first ``skip_steps`` (0: every step)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    drawn = drawn_rows(rows, skip_steps)
    fig, (gantt, hist) = plt.subplots(2, 1, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI,
                                      gridspec_kw={"height_ratios": [1, 1.3]})
    try:
        _gantt(gantt, drawn, left_out=len(rows) - len(drawn))
        _histogram(hist, drawn)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig


def plot(rows: Sequence[dict], path: str | os.PathLike, title: str = "", skip_steps: int = 1) -> None:
    import matplotlib.pyplot as plt

    fig = figure(rows, title, skip_steps)
    try:
        fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": it would change the promised size
    finally:
        plt.close(fig)


def _gantt(ax, rows: Sequence[dict], left_out: int = 0) -> None:
    seen = set()
    timelines = [r["timeline"] for r in rows if r.get("timeline")]
    origin = timelines[0].get("step_start", 0.0) if timelines else 0.0
    for timeline in timelines:
        for role, phase, start, end in timeline.get("intervals", []):
            y = ROLE_ROWS.index(role)
            label = phase if phase not in seen else None
            seen.add(phase)
            ax.broken_barh([(start - origin, end - start)], (y - 0.35, 0.7), color=PHASE_COLORS.get(phase, "grey"),
                           label=label, edgecolor="black", linewidth=0.3)
        if "step_end" in timeline:
            ax.axvline(timeline["step_end"] - origin, color="black", linestyle=":", linewidth=0.8)
    if not seen:
        ax.text(0.5, 0.5, "no timeline in the telemetry", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.set_xlim(0.0, max(t.get("step_end", 0.0) for t in timelines) - origin)
    ax.set_yticks(range(len(ROLE_ROWS)), ROLE_ROWS)
    first = rows[0].get("step", 0) if rows else 0
    ax.set_xlabel(f"seconds since step {first} began (dotted: step ends)")
    skipped = f"; {left_out} warm-up step(s) left out, --plot-warmup draws them" if left_out else ""
    ax.set_title(f"phases per role over steps (gaps are waits{skipped})", loc="left")
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


def plot_modes(timelines: dict[str, dict[str, list]], path: str | os.PathLike, title: str = "") -> None:
    """One predicted timeline per mode (``advisor.asynchrony.timeline``): the trainer's train and update
    bars and the rollout's generating groups, so each mode's idle gaps (its bubbles) show side by side."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, sharex=True)
    try:
        for ax, (mode, roles) in zip(axes, timelines.items()):
            for y, role in enumerate(ROLE_ROWS):
                for phase, start, end in roles[role]:
                    ax.broken_barh([(start, end - start)], (y - 0.35, 0.7), color=PHASE_COLORS[phase], alpha=0.45
                                   if role == "rollout" else 0.9)
            ax.set_yticks(range(len(ROLE_ROWS)), ROLE_ROWS)
            ax.set_title(f"{mode} (predicted)", fontsize=10)
        axes[-1].set_xlabel("seconds")
        fig.suptitle(title or "predicted timelines: gaps are idle time")
        fig.tight_layout()
        fig.savefig(os.fspath(path))
    finally:
        plt.close(fig)
