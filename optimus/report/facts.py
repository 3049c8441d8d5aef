"""The run's facts, for the table at the top of the report: (name, value) pairs of text."""

from __future__ import annotations

import math
import statistics
import time

from pydantic import ValidationError

from optimus.config import ModelConfig
from optimus.report.runlog import Run
from optimus.report.timeline import culprit, failed_save, lost_to_restarts, marks, rewind_text

NONE = "—"


def facts(run: Run) -> list[tuple[str, str]]:
    cfg = run.config or {}
    job = run.journal.get("job") or {}
    plan = run.journal.get("plan") or {}
    last = run.steps[-1] if run.steps else None
    total = (cfg.get("optim") or {}).get("steps")
    failures = [e for e in run.control if e.kind == "failure"]
    excluded = run.journal.get("excluded") or {}
    rows = [
        ("job", str(cfg.get("name") or job.get("name") or run.run_dir.name)),
        ("state", f"{job['state']}: {job.get('reason', '')}" if job.get("state") else NONE),
        ("model", model_size(cfg.get("model"))),
        ("layout", _layout(run.layout, plan)),
        ("steps", NONE if last is None else f"{last.step:,}" + (f" of {total:,}" if total
                                                                 else "")),
        ("tokens", NONE if last is None else f"{last.tokens:,}"),
        ("wall time", _duration(run.end - run.start) if run.start and run.end else NONE),
        ("started", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.start))
         if run.start else NONE),
        ("train loss, final / best", _final_best([s.loss for s in run.steps])),
        ("validation loss, final / best", _final_best([e.loss for e in run.evals])
         + _perplexity(run)),
        ("tokens/s, mean", _mean(_per_step(run, "tokens_per_s"), "{:,.0f}")),
        ("MFU, mean", _mean(_per_step(run, "mfu"), "{:.1%}",
                            NONE + " (no peak FLOP/s known for the device)")),
        ("generations", str(_generations(run))),
        ("faults", f"{len(failures)}" + (": " + "; ".join(culprit(e.fields) for e in failures)
                                          if failures else "")),
        ("excluded nodes", "; ".join(f"{n}: {_short(e.get('reason', ''))}"
                                     for n, e in sorted(excluded.items())) or "none"),
        ("checkpoints committed", _committed(run)),
        ("time lost to restarts", _duration(lost_to_restarts(run))),
        ("pauses", _pauses(run)),
        *stability(run),
    ]
    if run.unreadable:
        rows.append(("unreadable lines", f"{run.unreadable} (cut short by a crash, skipped)"))
    return rows


def stability(run: Run) -> list[tuple[str, str]]:
    """The stability rules' verdicts, the skipped steps, the rewinds and the windows of data
    they skipped; one row when there were none."""
    spikes = [v for v in run.verdicts if v.kind == "spike"]
    divergences = [v for v in run.verdicts if v.kind == "divergence"]
    if not (spikes or divergences or run.skipped or run.rewinds or run.data_skips):
        off = ((run.config or {}).get("stability") or {}).get("enabled") is False
        return [("stability", "off (stability.enabled: false)" if off else
                 "no loss spike, divergence, skipped step or rewind")]
    return [
        ("loss spikes", _verdicts(spikes)),
        ("divergences", _verdicts(divergences)),
        ("skipped steps", f"{len(run.skipped)}" + (": steps " + _few(
            [str(s) for s, _ in run.skipped]) if run.skipped else "")),
        ("rewinds", f"{len(run.rewinds)}" + (": " + _few(
            [rewind_text(r) for r in run.rewinds], sep="; ") if run.rewinds else "")),
        ("skipped data windows", f"{len(run.data_skips)}" + (": " + _few(
            [f"steps {d.first}..{d.last}, samples [{d.start:,}, {d.end:,}) not read"
             for d in run.data_skips], sep="; ") if run.data_skips else "")),
    ]


def _verdicts(found: list) -> str:
    """"3: 2 skipped their step, 1 asked for a rewind; by the loss 3" from verdicts."""
    if not found:
        return "none"
    did = {"skip_step": "skipped their step", "warn": "warned",
           "rewind": "asked for a rewind"}
    actions = [f"{sum(v.action == a for v in found)} {text}" for a, text in did.items()
               if any(v.action == a for v in found)]
    rules = {"loss": "the loss", "grad_norm": "the gradient norm", "trend": "the trend"}
    by = [f"{sum(v.rule == r for v in found)} by {text}" for r, text in rules.items()
          if any(v.rule == r for v in found)]
    return f"{len(found)}: " + ", ".join(actions) + "; " + ", ".join(by)


def _few(items: list[str], limit: int = 10, sep: str = ", ") -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return sep.join(items[:limit]) + more


def model_size(model: dict | None) -> str:
    """Parameters (and those one token uses, for a mixture of experts), and the shape."""
    if not model:
        return NONE + " (no checkpoint manifest or job file in the run dir says)"
    shape = (f"dim {model.get('dim')}, {model.get('n_layers')} layers, "
             f"{model.get('n_heads')} heads, vocab {model.get('vocab_size')}")
    moe = model.get("moe") or {}
    if moe.get("experts"):
        shape += f", {moe['experts']} experts (top {moe.get('top_k')})"
    counted = _parameters(model)
    return f"{counted}; {shape}" if counted else shape


def _parameters(model: dict) -> str:
    """By the model's own formula (optimus.models.counts), which imports torch: a second or
    so, worth it for the one number everyone asks first."""
    try:
        from optimus.models.counts import param_count

        cfg = ModelConfig.model_validate(model)
        total, active = param_count(cfg), param_count(cfg, active=True)
    except (ImportError, ValidationError):  # another version's config: the shape still says
        return ""
    text = f"{_si(total)} parameters"
    return text + (f" ({_si(active)} active per token)" if active != total else "")


def _layout(layout: dict | None, plan: dict) -> str:
    parts = []
    if layout:
        parts.append(" x ".join(f"{k} {layout[k]}" for k in ("dp", "tp", "pp", "ep")
                                if k in layout))
        if layout.get("world_size"):
            parts.append(f"{layout['world_size']} ranks")
    if plan.get("nodes"):
        parts.append(f"{len(plan['nodes'])} node(s) x {plan.get('ranks_per_node')} rank(s) "
                     f"in the last generation")
    return "; ".join(parts) or NONE


def _generations(run: Run) -> int:
    planned = sum(e.kind == "generation" for e in run.control)
    return planned or len(run.segments)


def _committed(run: Run) -> str:
    """Distinct steps committed: seen in the step lines' counters, in stop events, on disk."""
    steps = {s.step for s in run.saves} | set(run.committed)
    steps |= {int(e.fields["checkpoint_step"]) for e in run.rank_events
              if e.kind == "stopped" and isinstance(e.fields.get("checkpoint_step"), int)}
    failed = sum(failed_save(e) for e in run.rank_events)
    text = f"{len(steps)}" + (f" (latest: step {max(steps)})" if steps else "")
    return text + (f"; {failed} failed" if failed else "")


def _pauses(run: Run) -> str:
    spans = [m for m in marks(run) if m.kind == "pause"]
    if not spans:
        return "none"
    return f"{len(spans)}, {_duration(sum(m.end - m.time for m in spans))} in all"


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _final_best(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]  # a NaN loss is no best
    return f"{values[-1]:.4f} / {min(finite):.4f}" if finite else NONE


def _perplexity(run: Run) -> str:
    last = run.evals[-1] if run.evals else None
    return f" (perplexity {last.perplexity:,.2f})" if last and last.perplexity else ""


def _per_step(run: Run, name: str) -> list[tuple[float, int]]:
    """Each logged value with the steps it stands for (those since the step logged before
    it): the first steps, all logged, weigh no more than the later ones, logged one in N."""
    before = [0] + [s.step for s in run.steps[:-1]]
    return [(getattr(s, name), s.step - b) for s, b in zip(run.steps, before, strict=True)]


def _mean(values: list[tuple[float | None, int]], form: str, missing: str = NONE) -> str:
    """The mean of (value, weight) pairs that have a value."""
    values = [(v, w) for v, w in values if v is not None]
    if not values:
        return missing
    return form.format(statistics.fmean([v for v, _ in values], [w for _, w in values]))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _si(n: int) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)
