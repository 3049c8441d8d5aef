"""The report's figures: PNGs drawn with matplotlib's Agg backend (no display needed).

Each `*_figure` function draws one PNG into `out` and returns a `Figure` that says what it shows
(its series and its marks), so that what a reader sees can be checked without looking.
Text that comes from the run (the marks' labels: node names, from the nodes) is drawn as it is,
with matplotlib's mathtext off (`parse_math=False`): a name with a `$` or a backslash in it is
text, not a formula.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: before pyplot
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

from optimus.report.runlog import Run  # noqa: E402
from optimus.report.timeline import (  # noqa: E402
    AT_A_STEP,
    STYLE,
    Mark,
    marks,
    progress_marks,
    rewind_text,
    stability_marks,
)

DPI = 110
MAX_POINTS = 10_000  # per line drawn
MAX_BARS = 40  # checkpoint saves drawn as bars; more, as points
ROLLING = 9  # logged steps in the throughput's rolling mean
WIDE = (11, 5.6)
HALF = (11, 3.6)
SEGMENT_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass
class Figure:
    file: str  # the PNG's name, beside the page
    title: str
    caption: str
    series: dict[str, tuple[list, list]] = field(default_factory=dict)  # name -> (x, y)
    marks: list[Mark] = field(default_factory=list)


def draw_all(run: Run, out: Path) -> list[Figure]:
    drawers: list[Callable[[Run, Path], Figure | None]] = [
        timeline_figure, loss_figure, optimizer_figure, checkpoint_figure]
    return [f for f in (draw(run, out) for draw in drawers) if f is not None]


def _clock(run: Run) -> tuple[float, float, str]:
    """Origin, divisor and axis label of the wall-clock axis (seconds, minutes or hours)."""
    start, end = run.start or 0.0, run.end or 0.0
    span = end - start
    if span > 3 * 3600:
        return start, 3600.0, "hours since the start"
    if span > 180:
        return start, 60.0, "minutes since the start"
    return start, 1.0, "seconds since the start"


def timeline_figure(run: Run, out: Path) -> Figure:
    """Progress and throughput against the wall clock, with the control plane's marks, and
    the checkpoints and validations on the progress line."""
    origin, unit, xlabel = _clock(run)
    x = lambda t: (t - origin) / unit
    fig, (progress, speed) = plt.subplots(2, 1, figsize=WIDE, sharex=True,
                                          gridspec_kw={"height_ratios": [3, 2]})
    segments = sorted({segment for _, _, segment in run.trace})
    figure = Figure("timeline.png", "Timeline: progress, throughput and the control plane",
                    f"Throughput: each logged step (thin), and its mean over {ROLLING} logged "
                    "steps (thick).")
    if len(segments) > 1:
        figure.caption += (" Each colour is one start of training (a generation); after a "
                           "restart the steps since the checkpoint it resumed from are trained "
                           "again.")
    has_mfu = any(s.mfu is not None for s in run.logged)
    mfu_axis = speed.twinx() if has_mfu else None
    drawn, smooth = [], []
    for segment in segments:
        colour = SEGMENT_COLOURS[segment % len(SEGMENT_COLOURS)]
        points = [(t, step) for t, step, k in run.trace if k == segment]
        progress.plot([x(t) for t, _ in points], [step for _, step in points], "-",
                      color=colour, lw=1.4)
        rows = _thin([s for s in run.logged if s.segment == segment])
        drawn += rows
        times = [x(s.time) for s in rows]
        rate = [s.tokens_per_s for s in rows]
        mean = _rolling(rate)
        smooth += mean
        speed.plot(times, rate, "-", color=colour, lw=0.7, alpha=0.45)
        speed.plot(times, mean, "-", color=colour, lw=2)
        if mfu_axis is not None:
            mfu_axis.plot(times, [100 * s.mfu if s.mfu is not None else None for s in rows],
                          ":", color=colour, lw=1, alpha=0.8)
    figure.series["step"] = ([t for t, _, _ in run.trace], [step for _, step, _ in run.trace])
    figure.series["tokens/s"] = ([s.time for s in drawn], [s.tokens_per_s for s in drawn])
    figure.series["tokens/s, rolling mean"] = ([s.time for s in drawn], smooth)
    progress.set_ylabel("step")
    progress.yaxis.set_major_locator(MaxNLocator(integer=True))
    progress.yaxis.set_major_formatter(EngFormatter())
    speed.set_ylabel("tokens/s")
    speed.yaxis.set_major_formatter(EngFormatter())
    speed.set_ylim(bottom=0)  # a dip reads as large as it is
    if mfu_axis is not None:
        mfu_axis.set_ylabel("MFU % (dotted)")
        top = max(100 * s.mfu for s in run.logged if s.mfu is not None)
        mfu_axis.set_ylim(0, 1.15 * top if top > 0 else 1)
    speed.set_xlabel(xlabel)
    moments, at_steps = marks(run), progress_marks(run)
    figure.marks = sorted(moments + at_steps, key=lambda m: m.time)
    for ax in (progress, speed):
        _mark_lines(ax, moments, x)
        ax.grid(alpha=0.3)
    for kind in AT_A_STEP:
        on = [m for m in at_steps if m.kind == kind]
        if on:
            progress.plot([x(m.time) for m in on], [m.step for m in on], **_marker(kind),
                          ls="none", zorder=3)
    kinds = sorted({m.kind for m in figure.marks}, key=list(STYLE).index)
    if kinds:
        fig.legend([_handle(k) for k in kinds], [_LEGEND.get(k, k.replace("_", " "))
                                                 for k in kinds],
                   loc="lower center", ncol=len(kinds), frameon=False, fontsize=8.5)
    fig.tight_layout(rect=(0, 0.05 if kinds else 0, 1, 1))
    rows = _mark_labels(progress, moments, x)  # once the layout is final: they avoid each other
    _headroom(progress, rows, max((step for _, step, _ in run.trace), default=0))
    _save(fig, out / figure.file)
    return figure


_LEGEND = {"checkpoint": "checkpoint committed", "validation": "validation",
           "spike": "loss spike", "skipped": "step skipped"}


def _marker(kind: str) -> dict:
    """How a mark at a step is drawn: a skipped step hollow, around its spike's cross."""
    colour, marker = STYLE[kind]
    if kind == "skipped":
        return {"marker": marker, "color": colour, "ms": 10, "mfc": "none", "mew": 1.4}
    return {"marker": marker, "color": colour, "ms": 7 if kind == "spike" else 6}


def _handle(kind: str) -> Line2D:
    colour, style = STYLE[kind]
    if kind in AT_A_STEP:
        return Line2D([], [], ls="none", **_marker(kind))
    if kind == "pause":
        return Line2D([], [], color=colour, lw=6, alpha=0.25)
    return Line2D([], [], color=colour, ls=style, lw=1.5)


def _rolling(values: list, window: int = ROLLING) -> list:
    """Each value's centred mean over `window` values (fewer at the ends; gaps skipped)."""
    half = window // 2
    out = []
    for i in range(len(values)):
        near = [v for v in values[max(0, i - half):i + half + 1] if v is not None]
        out.append(sum(near) / len(near) if near else None)
    return out


def _headroom(ax, rows: int, top: float) -> None:
    """Raise the axis' top so that the labels' rows sit above the data, not on it."""
    if not rows:
        return
    height = ax.get_window_extent().height * 72 / ax.figure.dpi  # in points
    taken = min((8 + 11 * rows) / height, 0.6)  # the rows' share of the axis
    lo = ax.get_ylim()[0]
    if top > lo:
        ax.set_ylim(lo, lo + (top - lo) / (1 - taken - 0.02))


def _mark_lines(ax, found: list[Mark], x) -> None:
    """A vertical line per moment, a shaded span per pause."""
    for m in found:
        colour, style = STYLE[m.kind]
        if m.end is not None:
            ax.axvspan(x(m.time), x(m.end), color=colour, alpha=0.15, lw=0)
        else:
            ax.axvline(x(m.time), color=colour, ls=style, lw=1.1, alpha=0.9)


def _mark_labels(ax, found: list[Mark], x) -> int:
    """Each mark's label at the top of `ax`, in the highest row where it overlaps no label
    placed before it; how many rows that took."""
    lo, hi = ax.get_xlim()
    renderer = ax.figure.canvas.get_renderer()
    rows: list[list] = []  # per row, the display boxes of the labels in it
    for m in found:
        colour = STYLE[m.kind][0]
        right = x(m.time) > lo + 0.8 * (hi - lo)  # near the right edge: the label goes left
        text = ax.annotate(m.label, (x(m.time), 1.0), xycoords=("data", "axes fraction"),
                           xytext=(-3 if right else 3, -4), textcoords="offset points",
                           parse_math=False,
                           fontsize=7.5, color=colour, va="top", ha="right" if right else "left",
                           bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                                 "alpha": 0.85})
        for row, boxes in enumerate([*rows, []]):
            text.xyann = (text.xyann[0], -4 - 11 * row)
            box = text.get_window_extent(renderer).padded(8)  # the text's white box, and air
            if not any(box.overlaps(other) for other in boxes):
                break
        if row == len(rows):
            rows.append([])
        rows[row].append(box)
    return len(rows)


def loss_figure(run: Run, out: Path) -> Figure:
    fig, ax = plt.subplots(figsize=HALF)
    steps = _thin(run.steps)
    tokens = [s.tokens for s in steps]
    loss = [s.loss for s in steps]
    figure = Figure("loss.png", "Loss against tokens",
                    "Training loss of the steps that count (a step trained again after a "
                    "restart shows its last value)"
                    + ("; validation loss on held-out data." if run.evals else
                       "; no validation was logged."))
    ax.plot(tokens, loss, "-", color=SEGMENT_COLOURS[0], lw=1.2, label="train")
    figure.series["train loss"] = (tokens, loss)
    if run.evals:
        vx = [e.tokens if e.tokens is not None else _tokens_at(run, e.step) for e in run.evals]
        vy = [e.loss for e in run.evals]
        ax.plot(vx, vy, "o-", color="#d62728", ms=4, lw=1.2, label="validation")
        figure.series["validation loss"] = (vx, vy)
    _stability_on_loss(run, ax, figure)
    ax.set_xlabel("tokens")
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    _save(fig, out / figure.file)
    return figure


def _stability_on_loss(run: Run, ax, figure: Figure) -> None:
    """The stability rules' verdicts and the skipped steps at their step's tokens and loss
    (a spike by the loss at its value), and each rewind: a line where its line ended, the
    steps it trained again shaded back to the checkpoint it resumed from."""
    at = _along(run)
    found = stability_marks(run)
    if not found and not run.rewinds:
        return
    heights = {}
    for v in run.verdicts:
        point = at(v.step)
        by_loss = v.rule in ("loss", "trend") and v.value is not None and math.isfinite(v.value)
        if point is not None:
            heights[v.step] = (point[0], v.value if by_loss else point[1])
    for kind, name in (("spike", "spikes"), ("divergence", "divergences"),
                       ("skipped", "skipped steps")):
        points = [heights.get(m.step) or at(m.step) for m in found if m.kind == kind]
        points = [p for p in points if p is not None]
        if points:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, ls="none", zorder=3, label=_LEGEND.get(kind, kind), **_marker(kind))
            figure.series[name] = (xs, ys)
    lines = []
    for r in run.rewinds:
        point = at(r.step) if r.step is not None else None
        if point is None:
            continue
        colour = STYLE["rewind"][0]
        ax.axvline(point[0], color=colour, ls=STYLE["rewind"][1], lw=1.2,
                   label=None if lines else "rewind")
        resumed = r.resume_step if r.resume_step is not None else r.to  # at or before
        back = at(resumed) if resumed is not None else None
        if back is not None:
            ax.axvspan(back[0], point[0], color=colour, alpha=0.08, lw=0)
        lines.append(point)
    if lines:
        figure.series["rewinds"] = ([p[0] for p in lines], [p[1] for p in lines])
    figure.marks = found + [Mark(r.time, "rewind", rewind_text(r), step=r.step)
                            for r in run.rewinds]
    figure.caption += (" Marks: the stability rules' verdicts (crosses: loss spikes, at the "
                       "loss judged; triangles: divergences), steps whose update was skipped "
                       "(squares), and rewinds (dashed lines, where a line ended; shaded back "
                       "to the checkpoint it resumed from, the steps trained again).")


def _along(run: Run) -> Callable[[int], tuple[float, float] | None]:
    """(tokens, training loss) at a step, read between the logged steps that count around it;
    None without any."""
    keys = [s.step for s in run.steps]

    def at(step: int) -> tuple[float, float] | None:
        if not keys:
            return None
        i = bisect.bisect_left(keys, step)
        if i < len(keys) and keys[i] == step or i in (0, len(keys)):
            s = run.steps[min(i, len(keys) - 1)]
            return float(s.tokens), s.loss
        a, b = run.steps[i - 1], run.steps[i]
        f = (step - a.step) / (b.step - a.step)
        return a.tokens + f * (b.tokens - a.tokens), a.loss + f * (b.loss - a.loss)
    return at


def _tokens_at(run: Run, step: int) -> int | None:
    return next((s.tokens for s in run.steps if s.step >= step), None)


def optimizer_figure(run: Run, out: Path) -> Figure | None:
    steps = _thin([s for s in run.steps if s.grad_norm is not None or s.lr is not None])
    if not steps:
        return None
    fig, (norm, lr) = plt.subplots(1, 2, figsize=HALF)
    figure = Figure("optimizer.png", "Gradient norm and learning rate",
                    "The global gradient norm before clipping, and the learning rate, per "
                    "step that counts.")
    xs = [s.step for s in steps]
    for ax, name, ys in ((norm, "gradient norm", [s.grad_norm for s in steps]),
                         (lr, "learning rate", [s.lr for s in steps])):
        ax.plot(xs, ys, "-", color=SEGMENT_COLOURS[0], lw=1.1)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        figure.series[name] = (xs, ys)
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    fig.tight_layout()
    _save(fig, out / figure.file)
    return figure


def checkpoint_figure(run: Run, out: Path) -> Figure | None:
    failed = [m for m in marks(run) if m.kind == "save_failed"]
    if not run.saves and not failed:
        return None
    fig, ax = plt.subplots(figsize=HALF)
    figure = Figure("checkpoints.png", "Checkpoint saves",
                    "Per save committed during training: the time from the save's start to "
                    "rank 0's files written (the write runs beside training), and how long it "
                    "held training up (staging into host memory); a log scale, so that both "
                    "read. A save at a stop or at the last step is committed after the last "
                    "logged step: it has no bar. Crosses: saves that failed.")
    steps = [s.step for s in run.saves]
    write = [s.write_s or 0.0 for s in run.saves]
    blocked = [s.blocked_s or 0.0 for s in run.saves]
    failed_at = [_step_in(m.label) for m in failed]
    every = sorted({*steps, *(s for s in failed_at if s is not None)})
    gaps = [b - a for a, b in zip(every, every[1:], strict=False)]
    width = 0.35 * (min(gaps) if gaps else 1)
    ax.set_yscale("log")
    if len(steps) <= MAX_BARS:
        for shift, values, colour, name in ((-1, write, "#1f77b4", "write"),
                                            (1, blocked, "#ff7f0e", "training blocked")):
            bars = ax.bar([s + shift * width / 2 for s in steps], values, width=width,
                          color=colour, label=name)
            labels = [_seconds(v) for v in values]
            if shift < 0 and first_save_note(run):
                labels[0] += "\nfirst save"
            ax.bar_label(bars, labels=labels, fontsize=7.5, padding=1)
    else:  # hundreds of bars read as a comb: points instead
        ax.plot(steps, write, ".-", color="#1f77b4", ms=3, lw=0.8, label="write")
        ax.plot(steps, blocked, ".-", color="#ff7f0e", ms=3, lw=0.8, label="training blocked")
    figure.series["write s"] = (steps, write)
    figure.series["blocked s"] = (steps, blocked)
    if first_save_note(run):
        figure.caption += " " + first_save_note(run)
    if failed:
        at = [s for s in failed_at if s is not None]
        ax.plot(at, [0] * len(at), "x", color=STYLE["save_failed"][0], ms=10, mew=2,
                label="failed", clip_on=False, transform=ax.get_xaxis_transform())
        figure.marks = failed
    if len(every) <= 12:  # a tick under each save
        ax.set_xticks(every)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_xlabel("checkpoint of step")
    ax.set_ylabel("seconds (log scale)")
    positive = [v for v in write + blocked if v > 0]
    if positive:  # room above the tallest bar for its label
        ax.set_ylim(min(positive) / 2, max(positive) * 4)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.5, not 5 x 10^-1
    narrow = positive and max(positive) / min(positive) < 5  # under two decades shown
    ax.yaxis.set_minor_formatter(FuncFormatter(_minor_tick) if narrow else NullFormatter())
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1), ncol=3, frameon=False, fontsize=10)
    fig.tight_layout()
    _save(fig, out / figure.file)
    return figure


def first_save_note(run: Run) -> str:
    """Why the first save took longer than the others, when it took over twice their median:
    the one-time set-up the saves after it reuse."""
    write = [s.write_s for s in run.saves if s.write_s]
    if len(write) < 2 or write[0] <= 2 * statistics.median(write[1:]):
        return ""
    note = (f"First save {write[0]:.1f} s against a median of "
            f"{statistics.median(write[1:]):.1f} s for the others")
    if ((run.config or {}).get("checkpoint") or {}).get("async_mode") == "process":
        return note + (": it includes starting DCP's writer process (a Python with torch, "
                       "per rank), which the saves after it reuse.")
    return note + "."


def _minor_tick(value: float, _) -> str:
    """A log axis' minor tick labelled at 2, 3 and 5 times a power of ten only."""
    return f"{value:g}" if f"{value:.0e}"[0] in "235" else ""


def _seconds(value: float) -> str:
    return "" if value <= 0 else f"{value:.2f}" if value < 10 else f"{value:.0f}"


def _step_in(label: str) -> int | None:
    found = re.search(r"step (\d+)", label)
    return int(found.group(1)) if found else None


def _thin(rows: list, limit: int = MAX_POINTS) -> list:
    """At most about `limit` of `rows`, evenly spaced, the last one kept: a line of a million
    steps draws no better than one of ten thousand, and much slower."""
    if len(rows) <= limit:
        return rows
    stride = -(-len(rows) // limit)
    return rows[::stride] + ([rows[-1]] if (len(rows) - 1) % stride else [])


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
