"""The report page: one HTML file, its figures beside it as PNGs (relative links)."""

from __future__ import annotations

import time
from html import escape
from pathlib import Path

from optimus.data.audit import audit_run
from optimus.report.facts import facts
from optimus.report.figures import Figure, draw_all
from optimus.report.runlog import Run, read_run
from optimus.report.timeline import marks, rewind_text, stability_marks

MAX_ROWS = 200  # rows of the stability table; the rest counted

STYLE_SHEET = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1240px;
       color: #111827; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.1em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.sub { color: #6b7280; margin-top: 0; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; vertical-align: top;
  border-bottom: 1px solid #e5e7eb; text-align: left; }
table.facts th { width: 16em; font-weight: 600; color: #374151; }
img { max-width: 100%; border: 1px solid #e5e7eb; }
.caption { color: #4b5563; margin: 0.3em 0 0; }
td.kind { white-space: nowrap; font-weight: 600; } td.time { white-space: nowrap; }
"""


def build_report(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Write the report of the run in `run_dir` into `out` (default `<run_dir>/report/`):
    `index.html` and its PNG figures. Returns the page's path. Raises DataError when
    `run_dir` holds no run (no metrics.jsonl, or no logged step in it)."""
    run = read_run(run_dir)
    out = Path(out) if out is not None else run.run_dir / "report"
    figures = draw_all(run, out)
    page = out / "index.html"
    page.write_text(render(run, figures, mixture_shares(run)))
    return page


def mixture_shares(run: Run) -> list[dict]:
    """A mixture run's sources, with the share each was asked for and the share it gave, as
    `optimus data audit` counts them; [] for a run of one source."""
    if not any(e.kind == "mixture" for e in run.rank_events):
        return []
    return audit_run(run.run_dir, (run.config or {}).get("seed")).mixture


def render(run: Run, figures: list[Figure], mixture: list[dict] | None = None) -> str:
    facts_rows = facts(run)
    name = dict(facts_rows)["job"]
    parts = [
        "<!doctype html>", "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>Optimus report: {escape(name)}</title><style>{STYLE_SHEET}</style></head>",
        f"<body><h1>Optimus run report: {escape(name)}</h1>",
        f"<p class='sub'>{escape(str(run.run_dir))}, rendered "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} from {escape(_sources(run))}</p>",
        "<table class='facts'>",
        *(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in facts_rows),
        "</table>",
    ]
    for figure in figures:
        parts += [f"<h2>{escape(figure.title)}</h2>",
                  f"<img src='{escape(figure.file)}' alt='{escape(figure.title)}'>",
                  f"<p class='caption'>{escape(figure.caption)}</p>"]
    parts += _mixture_table(mixture or [])
    parts += _stability_table(run)
    parts += _events_table(run)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _mixture_table(mixture: list[dict]) -> list[str]:
    if not mixture:
        return []
    known = all(m["realised"] is not None for m in mixture)
    rows = [f"<tr><td>{escape(m['source'])}</td><td>{_form(m['weight'], '{:g}')}</td>"
            f"<td>{_form(m['share'], '{:.4f}')}</td><td>{_form(m['samples'], '{:,}')}</td>"
            f"<td>{_form(m['realised'], '{:.4f}')}</td></tr>" for m in mixture]
    return ["<h2>Data mixture</h2>", "<table><tr><th>source</th><th>weight</th><th>share "
            "asked</th><th>samples read</th><th>realised share</th></tr>", *rows, "</table>",
            f"<p class='caption'>{escape(_MIXTURE if known else _NO_SEED)}</p>"]


_MIXTURE = ("Share asked: the weight's share of the samples (its slots in every block of the "
            "mixture's order). Realised: the samples the steps that count read from each "
            "source, counted from their global indices as `optimus data audit` does.")
_NO_SEED = ("The realised shares need the run's seed, which no checkpoint manifest or job file "
            "of the run dir says.")


def _form(value, form: str) -> str:
    return "—" if value is None else escape(form.format(value))


def _stability_table(run: Run) -> list[str]:
    """Every verdict and skipped step at its step, every rewind and every window of data it
    skipped, in time order: what the loss figure marks, in words."""
    said = {v.step for v in run.verdicts if v.action == "skip_step"}  # "...: step skipped"
    found = [(m.time, m.kind, m.label) for m in stability_marks(run)
             if m.kind != "skipped" or m.step not in said]
    found += [(r.time, "rewind", rewind_text(r) + (f": {r.reason}" if r.reason else ""))
              for r in run.rewinds]
    found += [(d.time, "data skipped", f"before step {d.step}: the batches of steps "
               f"{d.first}..{d.last}, samples [{d.start:,}, {d.end:,}), not read")
              for d in run.data_skips]
    if not found:
        return []
    found.sort(key=lambda row: row[0])
    rows = [f"<tr><td class='time'>{time.strftime('%H:%M:%S', time.localtime(t))}</td>"
            f"<td class='kind'>{escape(kind)}</td><td>{escape(text)}</td></tr>"
            for t, kind, text in found[:MAX_ROWS]]
    more = (f"<p class='caption'>and {len(found) - MAX_ROWS} more: metrics.jsonl's "
            "<code>stability</code> and <code>data_skip</code> events, events.jsonl's "
            "<code>rewind</code>s.</p>" if len(found) > MAX_ROWS else "")
    return ["<h2>Stability</h2>",
            "<p class='caption'>The stability rules' verdicts and the steps whose update was "
            "skipped (on the steps that count, and each that asked for a rewind), the "
            "controller's rewinds and the windows of data they skipped "
            "(<code>optimus data audit</code> checks them).</p>",
            "<table>", *rows, "</table>", more]


def _events_table(run: Run) -> list[str]:
    found = marks(run)
    where = ("the control plane's events (events.jsonl)" if run.control
             else "rank 0's events (metrics.jsonl; this run has no events.jsonl)")
    if not found:
        return ["<h2>Events</h2>", f"<p>Nothing happened worth a mark, from {where}: no "
                "restart, fault, exclusion, pause, failed save or rewind.</p>"]
    start = run.start or found[0].time
    rows = []
    for m in found:
        when = time.strftime("%H:%M:%S", time.localtime(m.time))
        span = f" for {m.end - m.time:.1f} s" if m.end is not None else ""
        rows.append(f"<tr><td class='time'>{when} (+{m.time - start:.1f} s)</td>"
                    f"<td class='kind'>{escape(m.kind.replace('_', ' '))}</td>"
                    f"<td>{escape(m.label + span)}: {escape(m.detail)}</td></tr>")
    return ["<h2>Events</h2>",
            f"<p class='caption'>The marks across the timeline figure, from {where}; every event "
            "is in events.jsonl (<code>optimus events</code> while the job runs).</p>",
            "<table>", *rows, "</table>"]


def _sources(run: Run) -> str:
    found = ["metrics.jsonl"]
    if run.control:
        found.append("events.jsonl")
    if run.journal:
        found.append("controller.json")
    if run.committed:
        found.append("checkpoint manifests")
    return ", ".join(found)
